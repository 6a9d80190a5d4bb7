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

#include <cstdint>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

namespace {

void check_matrix(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 && t.is_contiguous(), what,
              ": a contiguous float32 CPU matrix");
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
  for (int64_t t = 0; t < T; ++t) {
    const float* xt = xp + t * K;
    float* ut = up + t * r;
    for (int64_t j = 0; j < r; ++j) {
      const float* aj = ap + j * K;
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += xt[k] * aj[k];
      ut[j] = acc;
    }
    float* yt = yp + t * N + lo;
    for (int64_t i = 0; i < n; ++i) {
      float acc = 0.f;
      for (int64_t j = 0; j < r; ++j) acc += ut[j] * bp[i * r + j];
      yt[i] += s * acc;
    }
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
  std::vector<float> g(T * r);
  for (int64_t t = 0; t < T; ++t) {
    const float* d = dyp + t * N + lo;
    for (int64_t j = 0; j < r; ++j) {
      float acc = 0.f;
      for (int64_t i = 0; i < n; ++i) acc += d[i] * bp[i * r + j];
      g[t * r + j] = acc * s;
    }
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
  // dB[i, j] = scaling * sum_t dy[t, lo+i] u[t, j]
  for (int64_t i = 0; i < n * r; ++i) dbp[i] = 0.f;
  for (int64_t t = 0; t < T; ++t) {
    const float* d = dyp + t * N + lo;
    const float* ut = up + t * r;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < r; ++j) dbp[i * r + j] += d[i] * ut[j];
  }
  for (int64_t i = 0; i < n * r; ++i) dbp[i] *= s;
  return {da, db};
}

}  // namespace ruvllm
