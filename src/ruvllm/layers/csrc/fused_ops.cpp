// The elementwise work between a decoder layer's matmuls, fused for the CPU: RMSNorm with the
// residual add, the q/k/v split with (q/k norm and) RoPE, SiLU-and-mul. In eager PyTorch these are ~25 small ops a
// layer (F.rms_norm alone is six: pow, mean, add, rsqrt, mul, mul), and at one decoding sequence
// their dispatch costs more than their arithmetic (docs/performance.md). One call each here.
//
// Every row is computed on its own, the same way at any row count (threads split rows), so
// results do not depend on the batch. Arithmetic is in float32 whatever the storage dtype, rounded
// once on store, as PyTorch's own CPU kernels compute these ops.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

namespace ruvllm {
namespace {

// y = x / sqrt(mean(x^2) + eps) * w over one row of H values.
template <typename T>
inline void rms_norm_row(const T* x, const T* w, T* y, int64_t H, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < H; ++i) {
    const float v = static_cast<float>(x[i]);
    ss += v * v;
  }
  const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
  for (int64_t i = 0; i < H; ++i) y[i] = static_cast<T>(static_cast<float>(x[i]) * r * static_cast<float>(w[i]));
}

// Neox half-split rotation of one head: out[i] = x[i] cos[i] - x[i+h] sin[i] for i < h, and
// x[i] cos[i] + x[i-h] sin[i] for the second half.
template <typename T>
inline void rope_head(const T* x, const T* cos, const T* sin, T* out, int64_t D) {
  const int64_t h = D / 2;
  for (int64_t i = 0; i < h; ++i) {
    const float a = static_cast<float>(x[i]), b = static_cast<float>(x[i + h]);
    out[i] = static_cast<T>(a * static_cast<float>(cos[i]) - b * static_cast<float>(sin[i]));
    out[i + h] = static_cast<T>(b * static_cast<float>(cos[i + h]) + a * static_cast<float>(sin[i + h]));
  }
}

// One head of q or k: RMS-normed over its D values into `tmp` (rounded to the dtype, as a separate
// norm's output is), then rotated into out. Not inlined: qkv_rope and qkv_rope_cache run one compiled
// body, so the Python loop (qkv_rope) and the C++ layer loop (qkv_rope_cache) get the same bits.
template <typename T>
__attribute__((noinline)) void norm_rope_head(const T* x, const T* w, float eps, T* tmp, const T* cos,
                                              const T* sin, T* out, int64_t D) {
  rms_norm_row(x, w, tmp, D, eps);
  rope_head(tmp, cos, sin, out, D);
}

void check_rows(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "x: a contiguous CPU [T, H] tensor");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous() && w.scalar_type() == x.scalar_type(),
              "weight: [H] in x's dtype");
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight);
  at::Tensor y = at::empty_like(x);
  const int64_t T = x.size(0), H = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t *xp = x.const_data_ptr<scalar_t>(), *wp = weight.const_data_ptr<scalar_t>();
    scalar_t* yp = y.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) rms_norm_row(xp + t * H, wp, yp + t * H, H, static_cast<float>(eps));
    });
  });
  return y;
}

// (rms_norm(x + residual) * weight, x + residual); the sum is rounded to the dtype first, as the
// separate add would round it.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_rows(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() && residual.scalar_type() == x.scalar_type(),
              "residual: contiguous, x's shape and dtype");
  at::Tensor y = at::empty_like(x), sum = at::empty_like(x);
  const int64_t T = x.size(0), H = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t *xp = x.const_data_ptr<scalar_t>(), *rp = residual.const_data_ptr<scalar_t>();
    const scalar_t* wp = weight.const_data_ptr<scalar_t>();
    scalar_t *yp = y.mutable_data_ptr<scalar_t>(), *sp = sum.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        for (int64_t i = 0; i < H; ++i)
          sp[t * H + i] = static_cast<scalar_t>(static_cast<float>(rp[t * H + i]) + static_cast<float>(xp[t * H + i]));
        rms_norm_row(sp + t * H, wp, yp + t * H, H, static_cast<float>(eps));
      }
    });
  });
  return {y, sum};
}

namespace {

// q and k's per-head RMSNorm weights (Qwen3, Gemma 3): both or neither, [D] in qkv's dtype.
void check_qk_norms(const at::Tensor& qkv, const std::optional<at::Tensor>& q_norm,
                    const std::optional<at::Tensor>& k_norm, int64_t head_dim) {
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q_norm and k_norm: both or neither");
  for (const auto* w : {&q_norm, &k_norm})
    if (w->has_value())
      TORCH_CHECK((*w)->dim() == 1 && (*w)->size(0) == head_dim && (*w)->is_contiguous() &&
                      (*w)->scalar_type() == qkv.scalar_type(),
                  "q_norm, k_norm: contiguous [head_dim] in qkv's dtype");
}

void check_qkv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
               int64_t num_kv_heads, int64_t head_dim) {
  const int64_t T = qkv.size(0), D = head_dim, width = (num_heads + 2 * num_kv_heads) * D;
  TORCH_CHECK(qkv.device().is_cpu() && qkv.dim() == 2 && qkv.size(1) == width && qkv.stride(1) == 1,
              "qkv: [T, (Hq + 2 Hkv) D] with unit stride along a row");
  TORCH_CHECK(D % 2 == 0 && cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T * D &&
                  sin.numel() == T * D && cos.scalar_type() == qkv.scalar_type() &&
                  sin.scalar_type() == qkv.scalar_type(),
              "cos, sin: contiguous [T, 1, D] in qkv's dtype, D even");
}

// Row t of qkv: q's heads rotated into q_out, k's rotated into k_row(t), v copied into v_row(t).
// With q/k norm weights (qw, kw; else null) each head is RMS-normed before its rotation.
template <typename scalar_t, typename KRow, typename VRow>
void qkv_rope_rows(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
                   int64_t num_kv_heads, int64_t D, scalar_t* qp, KRow k_row, VRow v_row, const scalar_t* qw = nullptr,
                   const scalar_t* kw = nullptr, float eps = 0.f) {
  const int64_t T = qkv.size(0), row = qkv.stride(0);
  const scalar_t* xp = qkv.const_data_ptr<scalar_t>();
  const scalar_t *cp = cos.const_data_ptr<scalar_t>(), *sp = sin.const_data_ptr<scalar_t>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    std::vector<scalar_t> tmp(qw ? D : 0);  // a normed head before its rotation
    auto head = [&](const scalar_t* x, const scalar_t* w, const scalar_t* c, const scalar_t* s, scalar_t* out) {
      if (w) norm_rope_head(x, w, eps, tmp.data(), c, s, out, D);
      else rope_head(x, c, s, out, D);
    };
    for (int64_t t = t0; t < t1; ++t) {
      const scalar_t* src = xp + t * row;
      for (int64_t h = 0; h < num_heads; ++h) head(src + h * D, qw, cp + t * D, sp + t * D, qp + (t * num_heads + h) * D);
      src += num_heads * D;
      scalar_t* kd = k_row(t);
      for (int64_t h = 0; h < num_kv_heads; ++h) head(src + h * D, kw, cp + t * D, sp + t * D, kd + h * D);
      src += num_kv_heads * D;
      scalar_t* vd = v_row(t);
      for (int64_t i = 0; i < num_kv_heads * D; ++i) vd[i] = src[i];
    }
  });
}

}  // namespace

// qkv [T, (Hq + 2 Hkv) D] (the fused projection's output) -> q [T, Hq, D] and k [T, Hkv, D] rotated,
// v [T, Hkv, D] copied, all contiguous. cos, sin: [T, 1, D] or [T, D], the step's rows. q_norm,
// k_norm ([D], both or neither): each q and k head RMS-normed (eps) before its rotation.
std::tuple<at::Tensor, at::Tensor, at::Tensor> qkv_rope(const at::Tensor& qkv, const at::Tensor& cos,
                                                        const at::Tensor& sin, int64_t num_heads,
                                                        int64_t num_kv_heads, int64_t head_dim,
                                                        const std::optional<at::Tensor>& q_norm,
                                                        const std::optional<at::Tensor>& k_norm, double eps) {
  check_qkv(qkv, cos, sin, num_heads, num_kv_heads, head_dim);
  check_qk_norms(qkv, q_norm, k_norm, head_dim);
  const int64_t T = qkv.size(0), D = head_dim, kv = num_kv_heads * D;
  at::Tensor q = at::empty({T, num_heads, D}, qkv.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor k = at::empty({T, num_kv_heads, D}, q.options());
  at::Tensor v = at::empty({T, num_kv_heads, D}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "qkv_rope", [&] {
    scalar_t *kp = k.mutable_data_ptr<scalar_t>(), *vp = v.mutable_data_ptr<scalar_t>();
    qkv_rope_rows<scalar_t>(qkv, cos, sin, num_heads, num_kv_heads, D, q.mutable_data_ptr<scalar_t>(),
                            [&](int64_t t) { return kp + t * kv; }, [&](int64_t t) { return vp + t * kv; },
                            q_norm ? q_norm->const_data_ptr<scalar_t>() : nullptr,
                            k_norm ? k_norm->const_data_ptr<scalar_t>() : nullptr, static_cast<float>(eps));
  });
  return {q, k, v};
}

// As qkv_rope, with k and v written straight into the paged caches ([slots, Hkv, D]) at each row's
// slot (slot_mapping [T]) instead of into new tensors: the values index_copy_ would store. Returns q.
at::Tensor qkv_rope_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
                          int64_t num_kv_heads, int64_t head_dim, at::Tensor& k_cache, at::Tensor& v_cache,
                          const at::Tensor& slot_mapping, const std::optional<at::Tensor>& q_norm,
                          const std::optional<at::Tensor>& k_norm, double eps) {
  check_qkv(qkv, cos, sin, num_heads, num_kv_heads, head_dim);
  check_qk_norms(qkv, q_norm, k_norm, head_dim);
  const int64_t T = qkv.size(0), D = head_dim, kv = num_kv_heads * D;
  for (const at::Tensor* c : {&k_cache, &v_cache})
    TORCH_CHECK(c->dim() == 3 && c->size(1) == num_kv_heads && c->size(2) == D && c->is_contiguous() &&
                    c->scalar_type() == qkv.scalar_type(),
                "caches: contiguous [slots, Hkv, D] in qkv's dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == T,
              "slot_mapping: contiguous int64 [T]");
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0);
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " is outside the cache (", num_slots, " slots)");
  at::Tensor q = at::empty({T, num_heads, D}, qkv.options().memory_format(at::MemoryFormat::Contiguous));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "qkv_rope_cache", [&] {
    scalar_t *kp = k_cache.mutable_data_ptr<scalar_t>(), *vp = v_cache.mutable_data_ptr<scalar_t>();
    qkv_rope_rows<scalar_t>(qkv, cos, sin, num_heads, num_kv_heads, D, q.mutable_data_ptr<scalar_t>(),
                            [&](int64_t t) { return kp + slots[t] * kv; }, [&](int64_t t) { return vp + slots[t] * kv; },
                            q_norm ? q_norm->const_data_ptr<scalar_t>() : nullptr,
                            k_norm ? k_norm->const_data_ptr<scalar_t>() : nullptr, static_cast<float>(eps));
  });
  return q;
}

// gate_up [T, 2I] -> silu(gate) * up [T, I].
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up: a contiguous CPU [T, 2I] tensor");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  at::Tensor y = at::empty({T, I}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* gp = gate_up.const_data_ptr<scalar_t>();
    scalar_t* yp = y.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const scalar_t *g = gp + t * 2 * I, *u = g + I;
        for (int64_t i = 0; i < I; ++i) {
          const float a = static_cast<float>(g[i]);
          // (exp's argument bounded: -ffast-math assumes no infinities)
          yp[t * I + i] = static_cast<scalar_t>(a / (1.f + std::exp(std::min(-a, 80.f))) * static_cast<float>(u[i]));
        }
      }
    });
  });
  return y;
}

}  // namespace ruvllm
