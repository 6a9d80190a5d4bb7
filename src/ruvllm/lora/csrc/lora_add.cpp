// Many LoRA adapters over one batch (the segmented Punica/S-LoRA scheme): rows are grouped by the
// adapter slot they use, and each group gets its shrink (x A^T) and expand (. B) while the base
// matmul has already run once for all rows.
//
// Layout of one (fused) projection's slots, made by ruvllm/lora/slots.py:
//   A      [S, n_sub * R, K]  the rank-R shrink of each sub-projection (q, k, v of a fused qkv), stacked
//   B      [S, R, N]          the expand, scale folded in: column n of sub-projection i multiplies
//                             u[i * R + j]; columns of one sub-projection are bounds[i] .. bounds[i+1]
//   ranks  [S, n_sub] int32   each slot's rank per sub-projection (0: no LoRA there)
//   row_slot [T] int32        the slot of each row of x, -1 for the base model alone
//
// Batch invariance: a row's delta is computed from that row and its slot's weights alone, every
// dot product over K in one fixed order and every output summed over j = 0 .. r-1 in order, then
// added to y once. Which rows share the batch or a thread changes how the work is split, never a
// row's arithmetic. Each slot's weights are read once per call for all of its rows (an adapter's
// A and B of one layer are ~0.6 MiB at rank 16 on the default model: read per row, 32 rows would
// stream them 32 times).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define RUVLLM_LORA_AVX2 1
#endif

namespace {

// One fixed order for a dot product over K: eight lanes of FMAs, their sum in a fixed tree, then
// the tail in order.
inline float dot(const float* a, const float* b, int64_t K) {
  int64_t k = 0;
  float s = 0.f;
#if defined(RUVLLM_LORA_AVX2)
  __m256 acc = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  s = _mm_cvtss_f32(h);
#endif
  for (; k < K; ++k) s = std::fma(a[k], b[k], s);
  return s;
}

// d[0..n) = sum over j < r of u[j] * b[j * ldb + 0..n), in order of j; then y[0..n) += d.
inline void expand_add(float* y, const float* u, const float* b, int64_t ldb, int64_t r, int64_t n) {
  int64_t c = 0;
#if defined(RUVLLM_LORA_AVX2)
  for (; c + 8 <= n; c += 8) {
    __m256 d = _mm256_setzero_ps();
    for (int64_t j = 0; j < r; ++j) d = _mm256_fmadd_ps(_mm256_set1_ps(u[j]), _mm256_loadu_ps(b + j * ldb + c), d);
    _mm256_storeu_ps(y + c, _mm256_add_ps(_mm256_loadu_ps(y + c), d));
  }
#endif
  for (; c < n; ++c) {
    float d = 0.f;
    for (int64_t j = 0; j < r; ++j) d = std::fma(u[j], b[j * ldb + c], d);
    y[c] += d;
  }
}

constexpr int64_t COLS = 64;  // the expand's column chunk: fixed, so a column's code path never varies

}  // namespace

namespace ruvllm {

void lora_add(at::Tensor& y, const at::Tensor& x, const at::Tensor& A, const at::Tensor& B,
              const at::Tensor& ranks, const at::Tensor& row_slot, at::IntArrayRef bounds) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat && A.scalar_type() == at::kFloat &&
              B.scalar_type() == at::kFloat, "lora_add: float32 tensors");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && y.dim() == 2 && y.is_contiguous() && x.size(0) == y.size(0),
              "lora_add: x [T, K] and y [T, N], contiguous");
  TORCH_CHECK(A.dim() == 3 && A.is_contiguous() && B.dim() == 3 && B.is_contiguous(), "lora_add: A and B contiguous, 3-d");
  const int64_t T = x.size(0), K = x.size(1), N = y.size(1), S = A.size(0), R = B.size(1);
  const int64_t n_sub = static_cast<int64_t>(bounds.size()) - 1;
  TORCH_CHECK(n_sub >= 1 && bounds[0] == 0 && bounds[n_sub] == N, "lora_add: bounds run from 0 to N");
  for (int64_t i = 0; i < n_sub; ++i) TORCH_CHECK(bounds[i] <= bounds[i + 1], "lora_add: bounds ascend");
  TORCH_CHECK(A.size(1) == n_sub * R && A.size(2) == K && B.size(0) == S && B.size(2) == N,
              "lora_add: A [S, n_sub R, K] and B [S, R, N]");
  TORCH_CHECK(ranks.scalar_type() == at::kInt && ranks.is_contiguous() && ranks.dim() == 2 && ranks.size(0) == S &&
              ranks.size(1) == n_sub, "lora_add: ranks int32 [S, n_sub]");
  TORCH_CHECK(row_slot.scalar_type() == at::kInt && row_slot.is_contiguous() && row_slot.numel() == T,
              "lora_add: row_slot int32 [T]");
  const int32_t* slot = row_slot.data_ptr<int32_t>();
  const int32_t* rk = ranks.data_ptr<int32_t>();
  std::vector<std::vector<int64_t>> rows(S);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slot[t] >= -1 && slot[t] < S, "lora_add: row ", t, " has slot ", slot[t], " of ", S);
    if (slot[t] >= 0) rows[slot[t]].push_back(t);
  }
  for (int64_t s = 0; s < S; ++s)
    for (int64_t i = 0; i < n_sub; ++i)
      TORCH_CHECK(rk[s * n_sub + i] >= 0 && rk[s * n_sub + i] <= R, "lora_add: rank out of range");
  const float* xp = x.data_ptr<float>();
  const float* ap = A.data_ptr<float>();
  const float* bp = B.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t U = n_sub * R;
  std::vector<float> u(T * U, 0.f);

  // shrink: one task per (slot, A row), over all of the slot's rows
  std::vector<std::pair<int64_t, int64_t>> shrink;
  for (int64_t s = 0; s < S; ++s) {
    if (rows[s].empty()) continue;
    for (int64_t i = 0; i < n_sub; ++i)
      for (int64_t j = 0; j < rk[s * n_sub + i]; ++j) shrink.emplace_back(s, i * R + j);
  }
  if (shrink.empty()) return;
  // small work runs on the caller's thread (the split never changes a row's arithmetic)
  const int64_t per_task = K * std::max<int64_t>(1, T);
  at::parallel_for(0, static_cast<int64_t>(shrink.size()), std::max<int64_t>(1, 32768 / per_task),
                   [&](int64_t b, int64_t e) {
    for (int64_t q = b; q < e; ++q) {
      const auto [s, a] = shrink[q];
      const float* arow = ap + (s * U + a) * K;
      for (int64_t t : rows[s]) u[t * U + a] = dot(xp + t * K, arow, K);
    }
  });

  // expand: one task per (slot, chunk of COLS columns), over all of the slot's rows
  std::vector<std::pair<int64_t, int64_t>> expand;
  for (int64_t s = 0; s < S; ++s)
    if (!rows[s].empty())
      for (int64_t c = 0; c < N; c += COLS) expand.emplace_back(s, c);
  at::parallel_for(0, static_cast<int64_t>(expand.size()), std::max<int64_t>(1, 32768 / (COLS * R * std::max<int64_t>(1, T))),
                   [&](int64_t b, int64_t e) {
    for (int64_t q = b; q < e; ++q) {
      const auto [s, c0] = expand[q];
      const int64_t c1 = std::min(N, c0 + COLS);
      for (int64_t i = 0; i < n_sub; ++i) {
        const int64_t lo = std::max(c0, bounds[i]), hi = std::min(c1, bounds[i + 1]), r = rk[s * n_sub + i];
        if (lo >= hi || r == 0) continue;
        for (int64_t t : rows[s])
          expand_add(yp + t * N + lo, u.data() + t * U + i * R, bp + s * R * N + lo, N, r, hi - lo);
      }
    }
  });
}

}  // namespace ruvllm
