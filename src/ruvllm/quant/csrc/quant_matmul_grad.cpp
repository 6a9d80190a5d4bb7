// The input gradient of our quantized linear layer (quant_matmul.cpp), for the learner's backward
// pass over the served packed weights: dx[T, K] = dy[T, N] . W[N, K], W the packed [N, K] weight.
//
// The weight is never held in float32 whole: each thread owns a range of input blocks (32 inputs),
// dequantizes a chunk of CHUNK_N weight rows of its block into a small buffer (8 KB, L1) once, and
// runs every row of dy over it. So the weight's 4 or 8 bits a value are read once per call, as in
// the forward, and the float work is a register-blocked multiply at few rows.
//
// Batch invariance, as in the forward: each dx[t, k] is one chain of FMAs over n = 0..N-1 in order,
// acc = fma(dy[t, n], w[n, k], acc), started at zero, whatever T is, whichever rows share a tile
// and whichever thread owns the block (threads split K, never N). The dequantized w[n, k] is
// q * scale + offset (int4: offset = zero - 8 scale; int8: 0), one FMA, the same for every call.
//
// Layouts: quant_matmul.cpp's (codes [N, K/2] uint8 or [N, K] int8; scales and zeros
// [N/4, K/group, 4] float16 bits as int16).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define RUVLLM_AVX2 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t BLOCK_K = 32;    // inputs per block
constexpr int64_t SCALE_TILE = 4;  // the scales' tile of rows
constexpr int64_t CHUNK_N = 64;    // weight rows dequantized at a time: 64 x 32 floats = 8 KB

inline float half_bits(uint16_t bits) {
#if defined(RUVLLM_AVX2)
  return _cvtsh_ss(bits);  // F16C: one instruction (c10::Half's conversion is a bit-twiddling routine)
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// Rows n0..n0+rows of block b of the weight, dequantized into out[rows][32].
void dequantize_chunk(bool int4, const uint8_t* codes, const uint16_t* scales, const uint16_t* zeros, int64_t K,
                      int64_t ng, int64_t per_group, int64_t b, int64_t n0, int64_t rows, float* out) {
  const int64_t g = b / per_group;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = n0 + r;
    const int64_t si = (n / SCALE_TILE * ng + g) * SCALE_TILE + n % SCALE_TILE;
    const float s = half_bits(scales[si]);
    const float off = int4 ? half_bits(zeros[si]) - 8.f * s : 0.f;
    float* o = out + r * BLOCK_K;
#if defined(RUVLLM_AVX2)
    const __m256 sv = _mm256_set1_ps(s), ov = _mm256_set1_ps(off);
    __m128i lo, hi;  // the block's 32 codes as bytes, inputs 0-15 and 16-31
    if (int4) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + n * (K / 2) + b * BLOCK_K / 2));
      lo = _mm_and_si128(v, _mm_set1_epi8(0x0F));
      hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F));
    } else {
      lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + n * K + b * BLOCK_K));
      hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + n * K + b * BLOCK_K + 16));
    }
    auto widen = [&](__m128i bytes) {  // 8 codes -> 8 int32 (int4 codes unsigned, int8 signed)
      return int4 ? _mm256_cvtepu8_epi32(bytes) : _mm256_cvtepi8_epi32(bytes);
    };
    const __m256i q[4] = {widen(lo), widen(_mm_srli_si128(lo, 8)), widen(hi), widen(_mm_srli_si128(hi, 8))};
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(o + 8 * i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(q[i]), sv, ov));
#else
    for (int64_t j = 0; j < BLOCK_K; ++j) {
      int q;
      if (int4) {
        const uint8_t byte = codes[n * (K / 2) + b * BLOCK_K / 2 + j % 16];
        q = j < 16 ? (byte & 0x0F) : (byte >> 4);
      } else {
        q = reinterpret_cast<const int8_t*>(codes)[n * K + b * BLOCK_K + j];
      }
      o[j] = std::fma(static_cast<float>(q), s, off);
    }
#endif
  }
}

// acc[t][0..32) += sum over the chunk's rows r, in order, of dy[t, n0 + r] * w[r][0..32), for TT
// rows t0.. of dy (acc: dx's block of those rows, read and written back). The block is done in
// halves of 16 inputs, so that TT = 6 rows keep 12 accumulators (independent FMA chains: enough to
// fill both FMA pipes) and the two weight vectors in registers: 8 loads for 12 FMAs a weight row.
template <int TT>
inline void chunk_rows(const float* w, int64_t rows, const float* dy, int64_t N, int64_t n0, int64_t t0, float* dx,
                       int64_t K, int64_t b) {
#if defined(RUVLLM_AVX2)
  for (int half = 0; half < 2; ++half) {
    const int64_t o = b * BLOCK_K + 16 * half;
    __m256 acc[TT][2];
    for (int t = 0; t < TT; ++t)
      for (int i = 0; i < 2; ++i) acc[t][i] = _mm256_loadu_ps(dx + (t0 + t) * K + o + 8 * i);
    const float* wr = w + 16 * half;
    const float* d0 = dy + t0 * N + n0;
    for (int64_t r = 0; r < rows; ++r) {
      const __m256 w0 = _mm256_loadu_ps(wr + r * BLOCK_K), w1 = _mm256_loadu_ps(wr + r * BLOCK_K + 8);
      for (int t = 0; t < TT; ++t) {
        const __m256 d = _mm256_broadcast_ss(d0 + t * N + r);
        acc[t][0] = _mm256_fmadd_ps(d, w0, acc[t][0]);
        acc[t][1] = _mm256_fmadd_ps(d, w1, acc[t][1]);
      }
    }
    for (int t = 0; t < TT; ++t)
      for (int i = 0; i < 2; ++i) _mm256_storeu_ps(dx + (t0 + t) * K + o + 8 * i, acc[t][i]);
  }
#else
  for (int t = 0; t < TT; ++t) {
    float* a = dx + (t0 + t) * K + b * BLOCK_K;
    for (int64_t r = 0; r < rows; ++r) {
      const float d = dy[(t0 + t) * N + n0 + r];
      for (int64_t j = 0; j < BLOCK_K; ++j) a[j] = std::fma(d, w[r * BLOCK_K + j], a[j]);
    }
  }
#endif
}

// Every row of dy over one dequantized chunk: tiles of 6 rows, then the rest as one tile.
inline void all_rows(const float* w, int64_t rows, const float* dy, int64_t T, int64_t N, int64_t n0, float* dx,
                     int64_t K, int64_t b) {
  int64_t t = 0;
  for (; t + 6 <= T; t += 6) chunk_rows<6>(w, rows, dy, N, n0, t, dx, K, b);
  switch (T - t) {
    case 1: chunk_rows<1>(w, rows, dy, N, n0, t, dx, K, b); break;
    case 2: chunk_rows<2>(w, rows, dy, N, n0, t, dx, K, b); break;
    case 3: chunk_rows<3>(w, rows, dy, N, n0, t, dx, K, b); break;
    case 4: chunk_rows<4>(w, rows, dy, N, n0, t, dx, K, b); break;
    case 5: chunk_rows<5>(w, rows, dy, N, n0, t, dx, K, b); break;
    default: break;
  }
}

}  // namespace

namespace ruvllm {

// quant_matmul.cpp: the packed layout's checks; the zeros' bits (nullptr for int8)
const uint16_t* checked_packed(const at::Tensor& codes, const at::Tensor& scales,
                               const std::optional<at::Tensor>& zeros, int64_t group, bool int4, int64_t K);

at::Tensor quant_matmul_grad_input(const at::Tensor& dy, const at::Tensor& codes, const at::Tensor& scales,
                                   const std::optional<at::Tensor>& zeros, int64_t group, bool int4) {
  TORCH_CHECK(dy.dim() == 2 && dy.scalar_type() == at::kFloat && dy.is_contiguous(), "dy: contiguous float32 [T, N]");
  TORCH_CHECK(codes.dim() == 2, "codes: [N, K/2] (int4) or [N, K] (int8)");
  const int64_t T = dy.size(0), N = codes.size(0), K = int4 ? codes.size(1) * 2 : codes.size(1);
  TORCH_CHECK(dy.size(1) == N, "dy's columns must be the weight's output features");
  const uint16_t* zp = checked_packed(codes, scales, zeros, group, int4, K);
  auto dx = at::empty({T, K}, dy.options());
  if (T == 0 || K == 0) return dx;
  float* dxp = dx.data_ptr<float>();
  const float* dyp = dy.data_ptr<float>();
  const auto* cp = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  const int64_t nb = K / BLOCK_K, ng = K / group, per_group = group / BLOCK_K;
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> w(CHUNK_N * BLOCK_K);
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t t = 0; t < T; ++t) std::fill(dxp + t * K + b * BLOCK_K, dxp + t * K + (b + 1) * BLOCK_K, 0.f);
      for (int64_t n0 = 0; n0 < N; n0 += CHUNK_N) {
        const int64_t rows = std::min(CHUNK_N, N - n0);
        dequantize_chunk(int4, cp, sp, zp, K, ng, per_group, b, n0, rows, w.data());
        all_rows(w.data(), rows, dyp, T, N, n0, dxp, K, b);
      }
    }
  });
  return dx;
}

}  // namespace ruvllm
