// Dense float32 linear layers on the CPU: y[M, N] = x[M, K] . W[N, K]^T, each output row the same
// bits whatever M is.
//
// Why our own: PyTorch's fp32 CPU matmul is MKL's sgemm, which picks another kernel for a few rows
// than for many, so a row computed alone differed in its last bits from the same row computed in a
// batch (layers/dense.py has the measurements). Padding every small call to 4 rows made MKL take
// one kernel, at ~3x the time of a one-row GEMV: a decode step of the default model spent ~60 ms
// in padded matmuls where reading the weights once takes ~20 ms.
//
// Batch invariance: y[m, n] is one dot product, x[m] . W[n], always computed the same way: eight
// float lanes accumulated with FMAs over K in order, reduced in a fixed order, then the K % 8 tail
// added in order. Which micro-kernel, tile or thread computes it changes nothing in that sequence.
//
// Speed: a tile of NR weight rows is loaded once per block of MB input rows and reused for each
// of them (a decode step reads the weights once; a prompt chunk reads them once per 64 rows);
// threads split the output features N.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include "../../csrc/vec.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

// 4 x 3 accumulators, 3 weight vectors and 1 input vector: the 16 AVX2 registers.
constexpr int64_t NR = 3;   // weight rows per tile
constexpr int64_t MR = 4;   // input rows per micro-kernel call
constexpr int64_t MB = 64;  // input rows a tile passes over before the next tile (they stay in L2)

// The K % 8 tail (and the whole dot product where AVX2 is absent). -ffast-math may vectorize and
// reorder its sum, but one compiled function serves every output (noinline, and on GCC noclone:
// no specialized copy per caller), so every output gets the same order. (The models' K are
// multiples of 8: it is not called on their path.)
#if defined(__GNUC__) && !defined(__clang__)
#define RUVLLM_ONE_COPY __attribute__((noinline, noclone))
#else
#define RUVLLM_ONE_COPY __attribute__((noinline))
#endif

RUVLLM_ONE_COPY float tail_dot(const float* x, const float* w, int64_t k0, int64_t K, float acc) {
  for (int64_t k = k0; k < K; ++k) acc += x[k] * w[k];
  return acc;
}

#if defined(__AVX2__) && defined(__FMA__)

// The 4-row kernel holds its loaded vectors in registers (ruvllm::in_register): GCC 12 had folded
// the weight loads into the FMAs, 16 loads per 12 FMAs instead of 7, and the loads set the pace:
// 39-58 GFLOP/s at 64-512 rows on this 2-core AVX2 EPYC (one thread), up to 1.7x MKL's time; held,
// 48-72 GFLOP/s there, and 0.58-1.00x the time at 16-512 rows (`benchmarks/dense_matmul.py
// --compare-with`, docs/benchmarks.md). The 1- and 2-row kernels wait on memory, and held they measured up to 1.16x
// slower: they are left to the compiler.
// y[m, n] for mr input rows and nr weight rows; every (m, n) has its own accumulator.
template <int mr, int nr>
void micro(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy) {
  const int64_t K8 = K - K % 8;
  __m256 acc[mr][nr];
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 wv[nr];
    for (int j = 0; j < nr; ++j) {
      wv[j] = _mm256_loadu_ps(w + j * K + k);
      if constexpr (mr > 2) ruvllm::in_register(wv[j]);
    }
    for (int i = 0; i < mr; ++i) {
      __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
      if constexpr (mr > 2) ruvllm::in_register(xv);
      for (int j = 0; j < nr; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < mr; ++i)
    for (int j = 0; j < nr; ++j) {
      const float dot = ruvllm::hsum8(acc[i][j]);
      y[i * ldy + j] = K8 == K ? dot : tail_dot(x + i * ldx, w + j * K, K8, K, dot);
    }
}

template <int mr>
void micro_rows(int nr, const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy) {
  switch (nr) {
    case 3: micro<mr, 3>(x, ldx, w, K, y, ldy); break;
    case 2: micro<mr, 2>(x, ldx, w, K, y, ldy); break;
    default: micro<mr, 1>(x, ldx, w, K, y, ldy); break;
  }
}

#endif

// Weight rows [n0, n1) (at most NR) against input rows [m0, m1).
void tile(const float* x, const float* w, int64_t K, int64_t N, int64_t m0, int64_t m1, int64_t n0, int64_t n1,
          float* y) {
#if defined(__AVX2__) && defined(__FMA__)
  const int nr = static_cast<int>(n1 - n0);
  int64_t m = m0;
  for (; m + MR <= m1; m += MR) micro_rows<MR>(nr, x + m * K, K, w + n0 * K, K, y + m * N + n0, N);
  if (m1 - m >= 2) {
    micro_rows<2>(nr, x + m * K, K, w + n0 * K, K, y + m * N + n0, N);
    m += 2;
  }
  if (m < m1) micro_rows<1>(nr, x + m * K, K, w + n0 * K, K, y + m * N + n0, N);
#else
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t n = n0; n < n1; ++n) y[m * N + n] = tail_dot(x + m * K, w + n * K, 0, K, 0.f);
#endif
}

}  // namespace

namespace ruvllm {

// x [M, K], w [N, K], both contiguous float32 -> y [M, N].
at::Tensor dense_matmul(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous(), "w: contiguous float32 [N, K]");
  TORCH_CHECK(x.size(1) == w.size(1), "x [M, K] and w [N, K] must share K");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (N + NR - 1) / NR;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
      const int64_t m1 = std::min(M, m0 + MB);
      for (int64_t t = t0; t < t1; ++t) tile(xp, wp, K, N, m0, m1, t * NR, std::min(N, (t + 1) * NR), yp);
    }
  });
  return y;
}

}  // namespace ruvllm
