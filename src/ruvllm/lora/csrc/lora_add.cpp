// Many LoRA adapters over one batch (the segmented Punica/S-LoRA scheme): rows are grouped by the
// adapter slot they use, and each group gets its shrink (x A^T) and expand (. B) while the base
// matmul has already run once for all rows.
//
// Layout of one (fused) projection's slots, made by ruvllm/lora/slots.py:
//   A      [S, n_sub * R, K]  the rank-R shrink of each sub-projection (q, k, v of a fused qkv), stacked
//   B      [S, R, N]          the expand, scale folded in: column n of sub-projection i multiplies
//                             u[i * R + j]; columns of one sub-projection are bounds[i] .. bounds[i+1]
//   ranks  [S, n_sub] int32   each slot's rank per sub-projection (0: no LoRA there)
//   row_slot [T] int32        the slot of each row of x, -1 for the base model alone; or
//            [D, T] int32     D levels of stacked adapters (a named adapter, then its tenant's learned
//                             micro-LoRA): level 0's deltas are added to y, then level 1's, and so on,
//                             each level exactly as a call of its own (a row's sum y + d0 + d1 in that
//                             fixed order, whichever levels the other rows of the batch use)
//   row_weight [T, n_sub]     optional: each row's weight for each sub-projection's delta (X-LoRA's
//                             per-token scalings; its mixture of adapters is one call per adapter)
//
// Batch invariance: a row's delta is computed from that row and its slot's weights alone, every
// dot product over K in one fixed order and every output summed over j = 0 .. r-1 in order, then
// added to y once. Which rows share the batch or a thread changes how the work is split, never a
// row's arithmetic. A slot's weights are read from memory once per call for all of its rows (an
// adapter's A and B of one layer are ~0.6 MiB at rank 16 on the default model: read per row, 32
// rows would stream them 32 times): the shrink takes a few A rows at a time over all the slot's
// rows, the expand a block of rows over all columns, sweeping each row of y once in order while
// the slot's B stays in the core's cache.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>
#include "../../csrc/vec.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define RUVLLM_LORA_AVX2 1
#endif

namespace {

// u[i][jj] = x[i] . a[jj] over K for TR rows and TJ shrink rows at once (the registers hold the
// TR x TJ sums; each x and a vector is loaded once for all of them). Every (row, shrink row) sum is
// computed in one fixed order whatever the tile: eight lanes of FMAs over K, their sum in a fixed
// tree, then the tail in order.
template <int TR, int TJ>
inline void shrink_tile(const float* const* x, const float* const* a, int64_t K, float* const* u, const int64_t* col) {
  int64_t k = 0;
  float s[TR][TJ];
#if defined(RUVLLM_LORA_AVX2)
  __m256 acc[TR][TJ];
  for (int i = 0; i < TR; ++i)
    for (int j = 0; j < TJ; ++j) acc[i][j] = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) {
    __m256 av[TJ];
    for (int j = 0; j < TJ; ++j) av[j] = _mm256_loadu_ps(a[j] + k);
    for (int i = 0; i < TR; ++i) {
      const __m256 xv = _mm256_loadu_ps(x[i] + k);
      for (int j = 0; j < TJ; ++j) acc[i][j] = _mm256_fmadd_ps(xv, av[j], acc[i][j]);
    }
  }
  for (int i = 0; i < TR; ++i)
    for (int j = 0; j < TJ; ++j) s[i][j] = ruvllm::hsum8(acc[i][j]);
#else
  for (int i = 0; i < TR; ++i)
    for (int j = 0; j < TJ; ++j) s[i][j] = 0.f;
#endif
  for (int i = 0; i < TR; ++i)
    for (int j = 0; j < TJ; ++j) {
      float v = s[i][j];
      for (int64_t kk = k; kk < K; ++kk) v = std::fma(x[i][kk], a[j][kk], v);
      u[i][col[j]] = v;
    }
}

// For TR rows: d[c] = sum over j < r of u[i][j] * b[j * ldb + c], in order of j from zero, then
// y[i][c] += d[c], over n columns. The vector and scalar paths do the same exact FMAs per column,
// so neither the tile nor a column's path changes a value.
template <int TR>
inline void expand_tile(float* const* y, const float* const* u, const float* b, int64_t ldb, int64_t r, int64_t n) {
  int64_t c = 0;
#if defined(RUVLLM_LORA_AVX2)
  for (; c + 32 <= n; c += 32) {
    __m256 d[TR][4];
    for (int i = 0; i < TR; ++i)
      for (int q = 0; q < 4; ++q) d[i][q] = _mm256_setzero_ps();
    for (int64_t j = 0; j < r; ++j) {
      const float* bj = b + j * ldb + c;
      const __m256 b0 = _mm256_loadu_ps(bj), b1 = _mm256_loadu_ps(bj + 8), b2 = _mm256_loadu_ps(bj + 16),
                   b3 = _mm256_loadu_ps(bj + 24);
      for (int i = 0; i < TR; ++i) {
        const __m256 uj = _mm256_set1_ps(u[i][j]);
        d[i][0] = _mm256_fmadd_ps(uj, b0, d[i][0]);
        d[i][1] = _mm256_fmadd_ps(uj, b1, d[i][1]);
        d[i][2] = _mm256_fmadd_ps(uj, b2, d[i][2]);
        d[i][3] = _mm256_fmadd_ps(uj, b3, d[i][3]);
      }
    }
    for (int i = 0; i < TR; ++i)
      for (int q = 0; q < 4; ++q)
        _mm256_storeu_ps(y[i] + c + 8 * q, _mm256_add_ps(_mm256_loadu_ps(y[i] + c + 8 * q), d[i][q]));
  }
  for (; c + 8 <= n; c += 8) {
    for (int i = 0; i < TR; ++i) {
      __m256 d = _mm256_setzero_ps();
      for (int64_t j = 0; j < r; ++j) d = _mm256_fmadd_ps(_mm256_set1_ps(u[i][j]), _mm256_loadu_ps(b + j * ldb + c), d);
      _mm256_storeu_ps(y[i] + c, _mm256_add_ps(_mm256_loadu_ps(y[i] + c), d));
    }
  }
#endif
  for (; c < n; ++c)
    for (int i = 0; i < TR; ++i) {
      float d = 0.f;
      for (int64_t j = 0; j < r; ++j) d = std::fma(u[i][j], b[j * ldb + c], d);
      y[i][c] += d;
    }
}

constexpr size_t ROWS = 24;   // rows of x an expand task takes (a multiple of TR)
constexpr int SJ = 4;         // shrink rows a task takes at once
constexpr int TR = 3;         // rows of x a tile takes at once

}  // namespace

namespace ruvllm {

namespace {

// One level: each row's delta from its slot in `slot` [T] (-1: none), added to y once.
void lora_add_level(at::Tensor& y, const at::Tensor& x, const at::Tensor& A, const at::Tensor& B,
                    const at::Tensor& ranks, const int32_t* slot, at::IntArrayRef bounds,
                    const std::optional<at::Tensor>& row_weight);

}  // namespace

void lora_add(at::Tensor& y, const at::Tensor& x, const at::Tensor& A, const at::Tensor& B,
              const at::Tensor& ranks, const at::Tensor& row_slot, at::IntArrayRef bounds,
              const std::optional<at::Tensor>& row_weight) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "lora_add: x [T, K] and y [T, N]");
  const int64_t T = x.size(0);
  TORCH_CHECK(row_slot.scalar_type() == at::kInt && row_slot.is_contiguous() &&
                  ((row_slot.dim() == 1 && row_slot.size(0) == T) || (row_slot.dim() == 2 && row_slot.size(1) == T)),
              "lora_add: row_slot int32 [T] or [D, T]");
  TORCH_CHECK(!row_weight || row_slot.dim() == 1, "lora_add: row_weight takes one level of slots");
  const int64_t levels = row_slot.dim() == 1 ? 1 : row_slot.size(0);
  const int32_t* slots = row_slot.data_ptr<int32_t>();
  // in order: a stacked row's deltas are summed into y as one call per level would
  for (int64_t d = 0; d < levels; ++d) lora_add_level(y, x, A, B, ranks, slots + d * T, bounds, row_weight);
}

namespace {

void lora_add_level(at::Tensor& y, const at::Tensor& x, const at::Tensor& A, const at::Tensor& B,
                    const at::Tensor& ranks, const int32_t* slot, at::IntArrayRef bounds,
                    const std::optional<at::Tensor>& row_weight) {
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
  if (row_weight)
    TORCH_CHECK(row_weight->scalar_type() == at::kFloat && row_weight->is_contiguous() && row_weight->dim() == 2 &&
                row_weight->size(0) == T && row_weight->size(1) == n_sub, "lora_add: row_weight float32 [T, n_sub]");
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

  // shrink: one task per (slot, up to SJ shrink rows), over all of the slot's rows
  struct Shrink { int64_t s, a0, n; };
  std::vector<Shrink> shrink;
  for (int64_t s = 0; s < S; ++s) {
    if (rows[s].empty()) continue;
    for (int64_t i = 0; i < n_sub; ++i)
      for (int64_t j = 0; j < rk[s * n_sub + i]; j += SJ)
        shrink.push_back({s, i * R + j, std::min<int64_t>(SJ, rk[s * n_sub + i] - j)});
  }
  if (shrink.empty()) return;
  // small work runs on the caller's thread (the split never changes a row's arithmetic)
  const int64_t grain = std::max<int64_t>(1, 65536 / (K * SJ * std::max<int64_t>(1, T)));
  at::parallel_for(0, static_cast<int64_t>(shrink.size()), grain, [&](int64_t b, int64_t e) {
    for (int64_t q = b; q < e; ++q) {
      const Shrink& task = shrink[q];
      const std::vector<int64_t>& rs = rows[task.s];
      const float* a[SJ];
      int64_t col[SJ];
      for (int j = 0; j < task.n; ++j) {
        a[j] = ap + (task.s * U + task.a0 + j) * K;
        col[j] = task.a0 + j;
      }
      size_t t = 0;
      for (; t < rs.size(); t += TR) {
        const int nr = static_cast<int>(std::min<size_t>(TR, rs.size() - t));
        const float* x[TR];
        float* u_rows[TR];
        for (int i = 0; i < nr; ++i) {
          x[i] = xp + rs[t + i] * K;
          u_rows[i] = u.data() + rs[t + i] * U;
        }
        // the tile's shape picks which sums share registers, never how a sum is formed
        if (nr == TR && task.n == SJ) {
          shrink_tile<TR, SJ>(x, a, K, u_rows, col);
        } else {
          for (int i = 0; i < nr; ++i)
            for (int j = 0; j < task.n; ++j) shrink_tile<1, 1>(x + i, a + j, K, u_rows + i, col + j);
        }
      }
    }
  });

  // a row's weights scale its shrink results (a fixed multiply per value: the row's own arithmetic)
  if (row_weight) {
    const float* w = row_weight->data_ptr<float>();
    for (int64_t s = 0; s < S; ++s)
      for (int64_t t : rows[s])
        for (int64_t i = 0; i < n_sub; ++i)
          for (int64_t j = 0; j < rk[s * n_sub + i]; ++j) u[t * U + i * R + j] *= w[t * n_sub + i];
  }

  // expand: one task per (slot, block of ROWS rows) over all columns: each row of y is written in
  // one sequential sweep, and the slot's B (at most R x N) stays in the core's cache across the block
  struct Expand { int64_t s; size_t r0, r1; };
  std::vector<Expand> expand;
  for (int64_t s = 0; s < S; ++s)
    for (size_t r0 = 0; r0 < rows[s].size(); r0 += ROWS) expand.push_back({s, r0, std::min(rows[s].size(), r0 + ROWS)});
  at::parallel_for(0, static_cast<int64_t>(expand.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t q = b; q < e; ++q) {
      const Expand& task = expand[q];
      const std::vector<int64_t>& rs = rows[task.s];
      for (int64_t i = 0; i < n_sub; ++i) {
        const int64_t lo = bounds[i], hi = bounds[i + 1], r = rk[task.s * n_sub + i];
        if (lo >= hi || r == 0) continue;
        const float* bp_s = bp + task.s * R * N + lo;
        size_t t = task.r0;
        for (; t + TR <= task.r1; t += TR) {
          float* y_rows[TR];
          const float* u_rows[TR];
          for (int k = 0; k < TR; ++k) {
            y_rows[k] = yp + rs[t + k] * N + lo;
            u_rows[k] = u.data() + rs[t + k] * U + i * R;
          }
          expand_tile<TR>(y_rows, u_rows, bp_s, N, r, hi - lo);
        }
        for (; t < task.r1; ++t) {
          float* y_row = yp + rs[t] * N + lo;
          const float* u_row = u.data() + rs[t] * U + i * R;
          expand_tile<1>(&y_row, &u_row, bp_s, N, r, hi - lo);
        }
      }
    }
  });
}

}  // namespace

}  // namespace ruvllm
