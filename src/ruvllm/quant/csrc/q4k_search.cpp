// Q4_K's sub-block search at load (`-q q4k`): llama.cpp's make_qkx2_quants with Q4_K's settings, on
// many sub-blocks of 32 weights at once, bit for bit as quant/llamacpp.py's PyTorch statement of it
// computes (tests/unit/test_q8_q4k.py holds both to a float32 re-statement of llama.cpp's C code).
//
// Why C++: the search tries 22 grids per sub-block, each with sums over the 32 weights that must add
// in C's order (one term after another), so the PyTorch form runs ~2,600 small tensor operations per
// 8,192 sub-blocks: 33 s of CPU for the default model's 106 M linear weights, minutes for a 1B model
// (session 21). Here each sum is a loop over the 32 terms with the sub-blocks side by side in the
// vector lanes: the same float32 operations in the same order for every sub-block.
//
// Exactness: the file is compiled without -ffast-math and without contracting a multiply and an add
// into one FMA (the pragma below), so each operation rounds as the C code's does. Every sub-block is
// computed from its own 32 weights alone: the result does not depend on the threads or the batch.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <tuple>

#include "../../csrc/kernels.h"

#pragma GCC push_options
#pragma GCC optimize("no-fast-math", "fp-contract=off")

namespace ruvllm {
namespace {

constexpr int kSub = 32;       // weights per sub-block
constexpr int kLanes = 64;     // sub-blocks searched side by side: each [32][64] buffer is 8 KiB, in L1
constexpr float kNmax = 15.0f;  // codes 0..15

using Block = float[kSub][kLanes];

// out[b] = t[0][b] + t[1][b] + ... + t[31][b], added one term after another (C's loop order).
inline void sum_in_order(const Block& t, float* out, int n) {
  for (int b = 0; b < n; ++b) out[b] = t[0][b];
  for (int i = 1; i < kSub; ++i)
    for (int b = 0; b < n; ++b) out[b] += t[i][b];
}

// q = clamp(nearest((x - low) * inv), 0, 15), ties to even as llama.cpp's nearest_int, which adds and
// subtracts 1.5 * 2^23 as here: exact below 2^22 in magnitude, and anything larger clamps to 0 or 15
// either way. (Written without std::min, std::max and std::nearbyint: under this file's options gcc
// would not inline those header functions, compiled with the others', and the loop stayed scalar.)
inline void grid(const Block& x, const float* inv, const float* low, Block& q, int n) {
  constexpr float kMagic = 12582912.0f;
  for (int i = 0; i < kSub; ++i)
    for (int b = 0; b < n; ++b) {
      float v = ((x[i][b] - low[b]) * inv[b] + kMagic) - kMagic;
      v = v < 0.0f ? 0.0f : v;
      q[i][b] = v > kNmax ? kNmax : v;
    }
}

// sum_i w_i (scale q_i + low - x_i)^2, the products rounded in that order.
inline void error(const Block& x, const Block& w, const float* scale, const float* low, const Block& q,
                  Block& tmp, float* out, int n) {
  for (int i = 0; i < kSub; ++i)
    for (int b = 0; b < n; ++b) {
      float d = q[i][b] * scale[b] + low[b] - x[i][b];
      tmp[i][b] = d * d * w[i][b];
    }
  sum_in_order(tmp, out, n);
}

// n <= kLanes sub-blocks: x [n][32] in, scale [n], min [n] and codes [n][32] out.
void search(const float* x_in, int n, const float* nums, int num_count, float* scale_out, float* min_out,
            float* codes_out) {
  alignas(64) Block x, w, q, t0, t1, t2;
  alignas(64) float av[kLanes], low[kLanes], first_low[kLanes], top[kLanes], sum_w[kLanes], sum_x[kLanes],
      inv[kLanes], scale[kLanes], best[kLanes], kept_inv[kLanes], kept_low[kLanes], sl[kLanes], sl2[kLanes],
      sxl[kLanes], fit_scale[kLanes], fit_low[kLanes], err[kLanes];
  bool flat[kLanes];
  for (int b = 0; b < n; ++b)
    for (int i = 0; i < kSub; ++i) x[i][b] = x_in[b * kSub + i];

  // The weights: sqrt(mean x^2) + |x_i| (the square root correctly rounded, as C's sqrtf).
  for (int i = 0; i < kSub; ++i)
    for (int b = 0; b < n; ++b) t0[i][b] = x[i][b] * x[i][b];
  sum_in_order(t0, av, n);
  for (int b = 0; b < n; ++b) av[b] = __builtin_sqrtf(av[b] / 32.0f);
  for (int i = 0; i < kSub; ++i)
    for (int b = 0; b < n; ++b) w[i][b] = av[b] + __builtin_fabsf(x[i][b]);

  for (int b = 0; b < n; ++b) {
    float lo = x[0][b], hi = x[0][b];
    for (int i = 1; i < kSub; ++i) {
      lo = x[i][b] < lo ? x[i][b] : lo;
      hi = x[i][b] > hi ? x[i][b] : hi;
    }
    lo = lo > 0.0f ? 0.0f : lo;
    first_low[b] = low[b] = lo;
    flat[b] = hi == lo;
    top[b] = flat[b] ? lo + 1.0f : hi;  // flat sub-blocks are patched at the end
  }
  sum_in_order(w, sum_w, n);
  for (int i = 0; i < kSub; ++i)
    for (int b = 0; b < n; ++b) t0[i][b] = w[i][b] * x[i][b];
  sum_in_order(t0, sum_x, n);

  // The min-max grid first.
  for (int b = 0; b < n; ++b) {
    inv[b] = kNmax / (top[b] - low[b]);
    scale[b] = 1.0f / inv[b];
  }
  grid(x, inv, low, q, n);
  error(x, w, scale, low, q, t0, best, n);
  for (int b = 0; b < n; ++b) kept_inv[b] = inv[b], kept_low[b] = low[b];

  // Then each candidate step, laid from the best min found so far, refitted by weighted least squares.
  for (int c = 0; c < num_count; ++c) {
    for (int b = 0; b < n; ++b) inv[b] = nums[c] / (top[b] - low[b]);
    grid(x, inv, low, q, n);
    for (int i = 0; i < kSub; ++i)
      for (int b = 0; b < n; ++b) {
        float wl = w[i][b] * q[i][b];
        t0[i][b] = wl;
        t1[i][b] = wl * q[i][b];
        t2[i][b] = wl * x[i][b];
      }
    sum_in_order(t0, sl, n);
    sum_in_order(t1, sl2, n);
    sum_in_order(t2, sxl, n);
    bool det_positive[kLanes];
    for (int b = 0; b < n; ++b) {
      float det = sum_w[b] * sl2[b] - sl[b] * sl[b];
      float s = (sum_w[b] * sxl[b] - sum_x[b] * sl[b]) / det;
      float l = (sl2[b] * sum_x[b] - sl[b] * sxl[b]) / det;
      bool above = l > 0.0f;  // a grid whose low end is above zero is refitted through zero
      fit_low[b] = above ? 0.0f : l;
      fit_scale[b] = above ? sxl[b] / sl2[b] : s;
      det_positive[b] = det > 0.0f;
    }
    error(x, w, fit_scale, fit_low, q, t0, err, n);
    for (int b = 0; b < n; ++b) {
      if (det_positive[b] && err[b] < best[b]) {
        best[b] = err[b];
        kept_inv[b] = inv[b];
        kept_low[b] = low[b];
        scale[b] = fit_scale[b];
        low[b] = fit_low[b];
      }
    }
  }
  grid(x, kept_inv, kept_low, q, n);
  for (int b = 0; b < n; ++b) {
    scale_out[b] = flat[b] ? 0.0f : scale[b];
    min_out[b] = -(flat[b] ? first_low[b] : low[b]);
    for (int i = 0; i < kSub; ++i) codes_out[b * kSub + i] = flat[b] ? 0.0f : q[i][b];
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> q4k_sub_block_grids(const at::Tensor& x, const at::Tensor& numerators) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == kSub && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "q4k_sub_block_grids: x must be contiguous float32 [S, 32], got ", x.sizes());
  TORCH_CHECK(numerators.dim() == 1 && numerators.scalar_type() == at::kFloat && numerators.is_contiguous(),
              "q4k_sub_block_grids: numerators must be contiguous float32 [C]");
  const int64_t s = x.size(0);
  at::Tensor scale = at::empty({s}, x.options()), mins = at::empty({s}, x.options());
  at::Tensor codes = at::empty({s, kSub}, x.options());
  const float *xp = x.data_ptr<float>(), *np = numerators.data_ptr<float>();
  float *sp = scale.data_ptr<float>(), *mp = mins.data_ptr<float>(), *cp = codes.data_ptr<float>();
  const int count = static_cast<int>(numerators.size(0));
  const int64_t chunks = (s + kLanes - 1) / kLanes;
  // ~64 sub-blocks x 22 grids a chunk (~0.1 ms): 16 chunks a task keep the pool's overhead small.
  at::parallel_for(0, chunks, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t c = lo; c < hi; ++c) {
      const int64_t first = c * kLanes;
      const int n = static_cast<int>(std::min<int64_t>(kLanes, s - first));
      search(xp + first * kSub, n, np, count, sp + first, mp + first, cp + first * kSub);
    }
  });
  return {scale, mins, codes};
}

}  // namespace ruvllm

#pragma GCC pop_options
