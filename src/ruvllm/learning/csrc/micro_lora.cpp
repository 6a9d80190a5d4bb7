// The micro-LoRA's delta on a packed projection's output and its gradients, one call each (issue 37
// item 1, session 18): y[:, lo:hi] += scaling * (x A^T) B^T forward, and backward, from dy and the
// forward's rank-r product u = x A^T, the input's share dx += scaling * (dy[:, lo:hi] B) A and the
// parameters' dA = scaling * (dy[:, lo:hi] B)^T x, dB = scaling * dy[:, lo:hi]^T u.
//
// Why: at the instant step's dozen rows and rank 2 these are ~0.1 M multiply-adds a piece, and as
// torch ops (two products and a slice forward, four products, two scalings and a slice backward)
// each op's dispatch cost more than its arithmetic: one call each way made the step 1.2-1.4 ms
// faster for its 12 pieces (docs/learning.md "Session 18"). Every sum runs in a fixed order, in
// float32.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "../../csrc/vec.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

void check_matrix(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 && t.is_contiguous(), what,
              ": a contiguous float32 CPU matrix");
}

// a . b over K values: four chains of FMAs at a time where K allows (a single chain of K / 8
// dependent FMAs made these products latency-bound: ~20-30 us a piece of the default model, session 20).
inline float lora_dot(const float* a, const float* b, int64_t K) {
#if defined(__AVX2__) && defined(__FMA__)
  if (K % 32 == 0) {
    __m256 c0 = _mm256_setzero_ps(), c1 = _mm256_setzero_ps(), c2 = _mm256_setzero_ps(), c3 = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
      c0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), c0);
      c1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 8), _mm256_loadu_ps(b + k + 8), c1);
      c2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 16), _mm256_loadu_ps(b + k + 16), c2);
      c3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 24), _mm256_loadu_ps(b + k + 24), c3);
    }
    return ruvllm::hsum8(_mm256_add_ps(_mm256_add_ps(c0, c1), _mm256_add_ps(c2, c3)));
  }
#endif
  float acc = 0.f;
  for (int64_t k = 0; k < K; ++k) acc += a[k] * b[k];
  return acc;
}

// B [n, r] as [r, n] (a few KB): its columns contiguous for the loops over n.
std::vector<float> transposed(const float* b, int64_t n, int64_t r) {
  std::vector<float> out(n * r);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < r; ++j) out[j * n + i] = b[i * r + j];
  return out;
}

}  // namespace

namespace ruvllm {

// u = x A^T [T, r], and y[:, lo:lo+n] += scaling * u B^T in place. x [T, K], a [r, K], b [n, r], y [T, N].
at::Tensor micro_lora_add_(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, int64_t lo,
                           double scaling) {
  for (auto [t, what] : {std::pair{&y, "y"}, {&x, "x"}, {&a, "a"}, {&b, "b"}}) check_matrix(*t, what);
  const int64_t T = x.size(0), K = x.size(1), r = a.size(0), n = b.size(0), N = y.size(1);
  TORCH_CHECK(a.size(1) == K && b.size(1) == r && y.size(0) == T && lo >= 0 && lo + n <= N,
              "x [T, K], a [r, K], b [n, r], y [T, N] with the piece's columns inside it");
  at::Tensor u = at::empty({T, r}, x.options());
  const float *xp = x.const_data_ptr<float>(), *ap = a.const_data_ptr<float>(), *bp = b.const_data_ptr<float>();
  float *up = u.mutable_data_ptr<float>(), *yp = y.mutable_data_ptr<float>();
  const float s = static_cast<float>(scaling);
  const std::vector<float> bt = transposed(bp, n, r);
  std::vector<float> acc(n);
  for (int64_t t = 0; t < T; ++t) {
    const float* xt = xp + t * K;
    float* ut = up + t * r;
    for (int64_t j = 0; j < r; ++j) ut[j] = lora_dot(xt, ap + j * K, K);
    // acc = sum_j u_j B[:, j] over j in order, then y += scaling acc (the loops over n vectorize)
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t j = 0; j < r; ++j) {
      const float uj = ut[j], *bj = bt.data() + j * n;
      for (int64_t i = 0; i < n; ++i) acc[i] += uj * bj[i];
    }
    float* yt = yp + t * N + lo;
    for (int64_t i = 0; i < n; ++i) yt[i] += s * acc[i];
  }
  return u;
}

// (dA [r, K], dB [n, r]) and, where dx is given ([T, K]), dx += scaling * g A in place, with
// g = dy[:, lo:lo+n] B [T, r]. dy [T, N], x [T, K], u [T, r] (the forward's), a [r, K], b [n, r].
std::tuple<at::Tensor, at::Tensor> micro_lora_grad(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& u,
                                                   const at::Tensor& a, const at::Tensor& b, int64_t lo,
                                                   double scaling, const std::optional<at::Tensor>& dx) {
  for (auto [t, what] : {std::pair{&dy, "dy"}, {&x, "x"}, {&u, "u"}, {&a, "a"}, {&b, "b"}}) check_matrix(*t, what);
  const int64_t T = x.size(0), K = x.size(1), r = a.size(0), n = b.size(0), N = dy.size(1);
  TORCH_CHECK(a.size(1) == K && b.size(1) == r && u.size(0) == T && u.size(1) == r && dy.size(0) == T && lo >= 0 &&
                  lo + n <= N,
              "dy [T, N], x [T, K], u [T, r], a [r, K], b [n, r] with the piece's columns inside dy");
  if (dx) {
    check_matrix(*dx, "dx");
    TORCH_CHECK(dx->sizes() == x.sizes(), "dx: x's shape");
  }
  at::Tensor da = at::empty({r, K}, x.options()), db = at::empty({n, r}, x.options());
  const float *dyp = dy.const_data_ptr<float>(), *xp = x.const_data_ptr<float>(), *up = u.const_data_ptr<float>();
  const float *ap = a.const_data_ptr<float>(), *bp = b.const_data_ptr<float>();
  float *dap = da.mutable_data_ptr<float>(), *dbp = db.mutable_data_ptr<float>();
  float* dxp = dx ? dx->mutable_data_ptr<float>() : nullptr;
  const float s = static_cast<float>(scaling);
  // g = dy[:, lo:lo+n] B, scaled once: [T, r]
  const std::vector<float> bt = transposed(bp, n, r);
  std::vector<float> g(T * r);
  for (int64_t t = 0; t < T; ++t) {
    const float* d = dyp + t * N + lo;
    for (int64_t j = 0; j < r; ++j) g[t * r + j] = lora_dot(d, bt.data() + j * n, n) * s;
  }
  // dA[j, :] = sum_t g[t, j] x[t, :]; dx[t, :] += sum_j g[t, j] A[j, :]
  for (int64_t j = 0; j < r; ++j) {
    float* daj = dap + j * K;
    for (int64_t k = 0; k < K; ++k) daj[k] = 0.f;
    for (int64_t t = 0; t < T; ++t) {
      const float gj = g[t * r + j];
      const float* xt = xp + t * K;
      for (int64_t k = 0; k < K; ++k) daj[k] += gj * xt[k];
    }
  }
  if (dxp) {
    for (int64_t t = 0; t < T; ++t) {
      float* dxt = dxp + t * K;
      for (int64_t j = 0; j < r; ++j) {
        const float gj = g[t * r + j];
        const float* aj = ap + j * K;
        for (int64_t k = 0; k < K; ++k) dxt[k] += gj * aj[k];
      }
    }
  }
  // dB[i, j] = scaling * sum_t dy[t, lo+i] u[t, j], summed as [r, n] (contiguous over i), then laid out
  std::vector<float> dbt(r * n, 0.f);
  for (int64_t t = 0; t < T; ++t) {
    const float* d = dyp + t * N + lo;
    for (int64_t j = 0; j < r; ++j) {
      const float uj = up[t * r + j];
      float* out = dbt.data() + j * n;
      for (int64_t i = 0; i < n; ++i) out[i] += d[i] * uj;
    }
  }
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < r; ++j) dbp[i * r + j] = dbt[j * n + i] * s;
  return {da, db};
}

}  // namespace ruvllm

namespace ruvllm {

// One Adam step over every micro-LoRA tensor in one call (issue 37 item 1, session 20): for each i,
// step_i += 1, then exp_avg_i, exp_avg_sq_i and param_i updated from grad_i as torch's fused CPU
// Adam (aten/src/ATen/native/cpu/FusedAdamKernel.cpp, ADAM_MODE::ORIGINAL, no amsgrad, no maximize)
// computes them, operation for operation in float32 with its double-precision coefficients: the
// moving average as its lerp (weight 1 - beta1 < 0.5: m + (1 - beta1) (g - m) in one FMA), the
// squares' average ((1 - beta2) g) g + v beta2 (one FMA), then param + (-lr / bc1) m / (sqrt(v) /
// sqrt(bc2) + eps); weight decay g + param wd (one FMA). tests/unit/test_learning_adam.py compares
// the bits with torch's.
//
// Why: torch's kernel enters a parallel region for each tensor and its dispatch a dozen times more:
// over the micro-LoRA's 24 tensors of 32,256 values it took ~0.15-0.25 ms of the step, where these
// few vector operations a value take tens of microseconds (docs/learning.md "Session 20").
// (Built without contracting products and sums into FMAs beyond those written, which -ffast-math would
// allow: the FMAs here are the ones torch's build made, found by comparing the bits.)
__attribute__((optimize("fp-contract=off", "no-fast-math"))) void micro_lora_adam_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                      at::TensorList steps, double lr, double beta1, double beta2, double eps, double weight_decay) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && steps.size() == n,
              "params, grads, exp_avgs, exp_avg_sqs, steps: one each a parameter");
  for (size_t i = 0; i < n; ++i) {
    for (const at::Tensor* t : {&params[i], &grads[i], &exp_avgs[i], &exp_avg_sqs[i]})
      TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous() &&
                      t->numel() == params[i].numel(),
                  "params, grads, exp_avgs, exp_avg_sqs: contiguous float32 CPU tensors of the parameter's size");
    TORCH_CHECK(steps[i].scalar_type() == at::kFloat && steps[i].numel() == 1, "steps: float32 counts");
  }
  for (size_t i = 0; i < n; ++i) {
    float* step = steps[i].mutable_data_ptr<float>();
    *step += 1.f;
    const double s = *step;
    const double bc1 = 1 - std::pow(beta1, s), bc2 = 1 - std::pow(beta2, s);
    const float step_size = static_cast<float>(-(lr / bc1)), bc2_sqrt = static_cast<float>(std::sqrt(bc2));
    const float w1 = static_cast<float>(1 - beta1), b2 = static_cast<float>(beta2), w2 = static_cast<float>(1 - beta2);
    const float wd = static_cast<float>(weight_decay), ep = static_cast<float>(eps);
    float *p = params[i].mutable_data_ptr<float>(), *m = exp_avgs[i].mutable_data_ptr<float>();
    float* v = exp_avg_sqs[i].mutable_data_ptr<float>();
    const float* g = grads[i].const_data_ptr<float>();
    const int64_t size = params[i].numel();
    int64_t d = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; d + 8 <= size; d += 8) {
      __m256 pv = _mm256_loadu_ps(p + d), gv = _mm256_loadu_ps(g + d);
      if (wd != 0.f) gv = _mm256_fmadd_ps(pv, _mm256_set1_ps(wd), gv);
      __m256 mv = _mm256_loadu_ps(m + d);
      // the lerp, as torch's blendv picks it for a weight under 0.5 (the weight 1 - beta1 < 0.5 is
      // checked by the caller): weight (g - m) + m
      mv = _mm256_fmadd_ps(_mm256_set1_ps(w1), _mm256_sub_ps(gv, mv), mv);
      __m256 vv = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(w2), gv), gv,
                                  _mm256_mul_ps(_mm256_loadu_ps(v + d), _mm256_set1_ps(b2)));
      _mm256_storeu_ps(m + d, mv);
      _mm256_storeu_ps(v + d, vv);
      const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vv), _mm256_set1_ps(bc2_sqrt)),
                                         _mm256_set1_ps(ep));
      pv = _mm256_add_ps(pv, _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(step_size), mv), denom));
      _mm256_storeu_ps(p + d, pv);
    }
#endif
    for (; d < size; ++d) {
      float gd = g[d];
      if (wd != 0.f) gd = std::fma(p[d], wd, gd);
      m[d] = std::fma(w1, gd - m[d], m[d]);
      v[d] = std::fma(v[d], b2, (w2 * gd) * gd);  // (torch's scalar tail contracts the other product)
      p[d] += (step_size * m[d]) / (std::sqrt(v[d]) / bc2_sqrt + ep);
    }
  }
}

}  // namespace ruvllm
