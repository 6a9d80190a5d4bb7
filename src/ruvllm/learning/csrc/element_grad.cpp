// The learner's element-wise backward passes (issue 37 item 1, session 18): the input gradients of
// the ops the learned layers run forward as serving's fused kernels (layers/csrc/fused_ops.cpp):
// the residual add with RMS norm, SiLU-and-multiply, and the fused q/k/v split with RoPE on q and k.
//
// Why C++: at the instant step's dozen rows each op's arithmetic is a few thousand values, and
// written out in torch ops each backward took 8-12 ops and as many allocations (~2.3 ms of the
// step's backward on a loaded core, timed node by node). One call each here: the step 1.4-1.6 ms
// faster (docs/learning.md "Session 18"). Every row is computed on its own, in
// float32, in a fixed order (the same at any row count: what the step learns does not depend on
// which rows share a call); the norms' weights are frozen, so no gradient is computed for them.
//
// Checked against the torch reference's autograd by tests/unit/test_learning_fused.py.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>

namespace {

void check_grad_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 && t.is_contiguous(), what,
              ": a contiguous float32 CPU [T, H] tensor");
}

}  // namespace

namespace ruvllm {

// h = rms_norm(s) * weight: ds = r g - s r^3 mean(g s), g = dh weight, r = 1 / sqrt(mean(s^2) + eps),
// plus `dsum` (the gradient reaching s directly: the residual stream's) when given.
at::Tensor rms_norm_grad(const at::Tensor& dh, const at::Tensor& s, const at::Tensor& weight, double eps,
                         const std::optional<at::Tensor>& dsum) {
  check_grad_rows(s, "s");
  check_grad_rows(dh, "dh");
  TORCH_CHECK(dh.sizes() == s.sizes(), "dh: s's shape");
  const int64_t T = s.size(0), H = s.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 1 && weight.size(0) == H && weight.is_contiguous(),
              "weight: float32 [H]");
  if (dsum) {
    check_grad_rows(*dsum, "dsum");
    TORCH_CHECK(dsum->sizes() == s.sizes(), "dsum: s's shape");
  }
  at::Tensor out = at::empty_like(s);
  const float *g = dh.const_data_ptr<float>(), *x = s.const_data_ptr<float>(), *w = weight.const_data_ptr<float>();
  const float* d = dsum ? dsum->const_data_ptr<float>() : nullptr;
  float* o = out.mutable_data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const float *gt = g + t * H, *xt = x + t * H;
    float ss = 0.f, gs = 0.f;
    for (int64_t i = 0; i < H; ++i) {
      ss += xt[i] * xt[i];
      gs += gt[i] * w[i] * xt[i];
    }
    const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
    const float c = r * r * r * gs / static_cast<float>(H);
    float* ot = o + t * H;
    if (d) {
      const float* dt = d + t * H;
      for (int64_t i = 0; i < H; ++i) ot[i] = r * gt[i] * w[i] - xt[i] * c + dt[i];
    } else {
      for (int64_t i = 0; i < H; ++i) ot[i] = r * gt[i] * w[i] - xt[i] * c;
    }
  }
  return out;
}

// y = silu(gate) * up over gate_up = [gate, up] [T, 2I]: d gate = dy up silu'(gate), d up = dy silu(gate),
// silu'(a) = sig (1 + a (1 - sig)) = sig + silu (1 - sig).
at::Tensor silu_and_mul_grad(const at::Tensor& dy, const at::Tensor& gate_up) {
  check_grad_rows(gate_up, "gate_up");
  check_grad_rows(dy, "dy");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) == 2 * I && dy.size(0) == T && dy.size(1) == I, "dy [T, I] for gate_up [T, 2I]");
  at::Tensor out = at::empty_like(gate_up);
  const float *gp = gate_up.const_data_ptr<float>(), *dp = dy.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const float *g = gp + t * 2 * I, *u = g + I, *dt = dp + t * I;
    float *dg = op + t * 2 * I, *du = dg + I;
    for (int64_t i = 0; i < I; ++i) {
      // (exp's argument bounded, as the forward's: -ffast-math assumes no infinities)
      const float sig = 1.f / (1.f + std::exp(std::min(-g[i], 80.f)));
      const float silu = g[i] * sig;
      dg[i] = dt[i] * u[i] * (sig + silu * (1.f - sig));
      du[i] = dt[i] * silu;
    }
  }
  return out;
}

// The fused projection's gradient [T, (Hq + 2 Hkv) D] from q's, k's and v's ([T, H, D] each; an absent
// one is zero). RoPE's neox half split, y[i] = x[i] cos[i] - x[i+h] sin[i] and y[i+h] = x[i+h] cos[i+h]
// + x[i] sin[i+h] (i < h = D/2), runs backward as dx[i] = dy[i] cos[i] + dy[i+h] sin[i+h] and
// dx[i+h] = dy[i+h] cos[i+h] - dy[i] sin[i]; v's gradient is copied.
at::Tensor qkv_rope_grad(const std::optional<at::Tensor>& dq, const std::optional<at::Tensor>& dk,
                         const std::optional<at::Tensor>& dv, const at::Tensor& cos, const at::Tensor& sin,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  const int64_t D = head_dim, h = D / 2, T = cos.size(0);
  TORCH_CHECK(D % 2 == 0 && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T * D && sin.numel() == T * D,
              "cos, sin: contiguous float32 [T, 1, D] or [T, D], D even");
  const std::optional<at::Tensor>* grads[3] = {&dq, &dk, &dv};
  const int64_t heads[3] = {num_heads, num_kv_heads, num_kv_heads};
  for (int p = 0; p < 3; ++p) {
    if (!*grads[p]) continue;
    const at::Tensor& g = **grads[p];
    TORCH_CHECK(g.scalar_type() == at::kFloat && g.is_contiguous() && g.numel() == T * heads[p] * D,
                "dq, dk, dv: contiguous float32 [T, H, D]");
  }
  const int64_t W = (num_heads + 2 * num_kv_heads) * D;
  at::Tensor out = at::empty({T, W}, cos.options());
  const float *cp = cos.const_data_ptr<float>(), *sp = sin.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const float *c = cp + t * D, *s = sp + t * D;
    float* row = op + t * W;
    for (int p = 0; p < 3; ++p) {
      const int64_t width = heads[p] * D;
      if (!*grads[p]) {
        std::fill(row, row + width, 0.f);
      } else if (p == 2) {
        std::memcpy(row, (*grads[p])->const_data_ptr<float>() + t * width, width * sizeof(float));
      } else {
        const float* g = (*grads[p])->const_data_ptr<float>() + t * width;
        for (int64_t head = 0; head < heads[p]; ++head) {
          const float* gh = g + head * D;
          float* xh = row + head * D;
          for (int64_t i = 0; i < h; ++i) {
            xh[i] = gh[i] * c[i] + gh[i + h] * s[i + h];
            xh[i + h] = gh[i + h] * c[i + h] - gh[i] * s[i];
          }
        }
      }
      row += width;
    }
  }
  return out;
}

}  // namespace ruvllm
