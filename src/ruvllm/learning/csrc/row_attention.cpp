// Causal attention forward and backward for the learner's few rows (issue 37 item 1, session 18).
//
// The instant step runs a dozen query rows through each learned layer against the prompt's kept K/V
// and their own. In torch that was a concatenation of the kept and new K/V, a mask built from two
// aranges, the head reshapes and scaled_dot_product_attention, then their backward nodes, for ~0.5 M
// multiply-adds a layer. Here one call each way, the softmax's probabilities kept from the forward
// for the backward: the step 0.5-0.6 ms faster for its 4 layers (docs/learning.md "Session 18").
//
// Rows: q [T, Hq, D], k and v [T, Hkv, D] (the new rows), ck and cv [C, Hkv, D] (the context before
// them: the frozen prompt's kept K/V, or the prompt's rows of this pass at the full context's last
// layer; C may be 0). The backward gives both their gradients. Query t sits at position C + t and
// sees keys j <= C + t (and j > C + t - window with a window); query head h reads K/V head
// h / (Hq / Hkv). Per (head, query) the arithmetic runs in a fixed order over the keys, in float32,
// the same at any row count.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "../../csrc/vec.h"

namespace {

struct Shape {
  int64_t T, C, S, Hq, Hkv, D, group;
};

Shape checked(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& ck,
              const std::optional<at::Tensor>& cv) {
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 3 && t->is_contiguous(),
                "q, k, v: contiguous float32 CPU [T, H, D]");
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k.size(1);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == T && k.size(2) == D && Hkv > 0 && Hq % Hkv == 0,
              "k, v: [T, Hkv, D] with Hkv dividing q's heads");
  TORCH_CHECK(ck.has_value() == cv.has_value(), "ck and cv: both or neither");
  int64_t C = 0;
  if (ck) {
    for (const at::Tensor* t : {&*ck, &*cv})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 3 && t->is_contiguous() && t->size(1) == Hkv &&
                      t->size(2) == D,
                  "ck, cv: contiguous float32 [C, Hkv, D]");
    TORCH_CHECK(ck->size(0) == cv->size(0), "ck, cv: the same rows");
    C = ck->size(0);
  }
  return {T, C, C + T, Hq, Hkv, D, Hq / Hkv};
}

// Key j's row of head g: the context's for j < C, else the new rows'.
inline const float* key_row(const float* ctx, const float* own, const Shape& s, int64_t j, int64_t g) {
  return j < s.C ? ctx + (j * s.Hkv + g) * s.D : own + ((j - s.C) * s.Hkv + g) * s.D;
}

// The first key query t sees (its last is C + t).
inline int64_t first_key(const Shape& s, int64_t t, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, s.C + t - window + 1) : 0;
}

// out[j - j0] = a . row(j) for keys j0 <= j < j1, D inputs. Each dot is eight lanes over the inputs in
// order, then hsum8: the same bits for a key whichever keys share a pass. Four keys a pass keep four
// independent chains of FMAs in flight: a key at a time, one chain of D / 8 dependent FMAs and its sum
// made the attention latency-bound (~5 G multiply-adds a second at D = 64; session 20).
template <typename Row>
inline void dots(const float* a, Row row, int64_t j0, int64_t j1, int64_t D, float* out) {
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 8 == 0) {
    int64_t j = j0;
    for (; j + 4 <= j1; j += 4) {
      const float *r0 = row(j), *r1 = row(j + 1), *r2 = row(j + 2), *r3 = row(j + 3);
      __m256 c0 = _mm256_setzero_ps(), c1 = _mm256_setzero_ps(), c2 = _mm256_setzero_ps(), c3 = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 av = _mm256_loadu_ps(a + d);
        c0 = _mm256_fmadd_ps(av, _mm256_loadu_ps(r0 + d), c0);
        c1 = _mm256_fmadd_ps(av, _mm256_loadu_ps(r1 + d), c1);
        c2 = _mm256_fmadd_ps(av, _mm256_loadu_ps(r2 + d), c2);
        c3 = _mm256_fmadd_ps(av, _mm256_loadu_ps(r3 + d), c3);
      }
      out[j - j0] = ruvllm::hsum8(c0);
      out[j + 1 - j0] = ruvllm::hsum8(c1);
      out[j + 2 - j0] = ruvllm::hsum8(c2);
      out[j + 3 - j0] = ruvllm::hsum8(c3);
    }
    for (; j < j1; ++j) {
      const float* r = row(j);
      __m256 c = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) c = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(r + d), c);
      out[j - j0] = ruvllm::hsum8(c);
    }
    return;
  }
#endif
  for (int64_t j = j0; j < j1; ++j) {
    const float* r = row(j);
    float dot = 0.f;
    for (int64_t d = 0; d < D; ++d) dot += a[d] * r[d];
    out[j - j0] = dot;
  }
}

// out = sum_j w[j - j0] row(j) over keys j0 <= j < j1 in order (out overwritten), D outputs: held in
// registers 32 at a time across the keys, where a store and reload of out for each key chained them.
template <typename Row>
inline void weighted_sum(const float* w, Row row, int64_t j0, int64_t j1, int64_t D, float* out) {
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 32 == 0) {
    for (int64_t d = 0; d < D; d += 32) {
      __m256 o0 = _mm256_setzero_ps(), o1 = _mm256_setzero_ps(), o2 = _mm256_setzero_ps(), o3 = _mm256_setzero_ps();
      for (int64_t j = j0; j < j1; ++j) {
        const float* r = row(j) + d;
        const __m256 wj = _mm256_set1_ps(w[j - j0]);
        o0 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(r), o0);
        o1 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(r + 8), o1);
        o2 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(r + 16), o2);
        o3 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(r + 24), o3);
      }
      _mm256_storeu_ps(out + d, o0);
      _mm256_storeu_ps(out + d + 8, o1);
      _mm256_storeu_ps(out + d + 16, o2);
      _mm256_storeu_ps(out + d + 24, o3);
    }
    return;
  }
#endif
  std::fill(out, out + D, 0.f);
  for (int64_t j = j0; j < j1; ++j) {
    const float* r = row(j);
    for (int64_t d = 0; d < D; ++d) out[d] += w[j - j0] * r[d];
  }
}

}  // namespace

namespace ruvllm {

// (o [T, Hq, D], p [Hq, T, S]): the attention's output and its probabilities (zero where masked).
std::tuple<at::Tensor, at::Tensor> row_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 const std::optional<at::Tensor>& ck,
                                                 const std::optional<at::Tensor>& cv, double scale, int64_t window) {
  const Shape s = checked(q, k, v, ck, cv);
  at::Tensor o = at::empty({s.T, s.Hq, s.D}, q.options());
  at::Tensor p = at::zeros({s.Hq, s.T, s.S}, q.options());
  const float *qp = q.const_data_ptr<float>(), *kp = k.const_data_ptr<float>(), *vp = v.const_data_ptr<float>();
  const float* ckp = ck ? ck->const_data_ptr<float>() : nullptr;
  const float* cvp = cv ? cv->const_data_ptr<float>() : nullptr;
  float *op = o.mutable_data_ptr<float>(), *pp = p.mutable_data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, s.Hq, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h) {
      const int64_t g = h / s.group;
      auto krow = [&](int64_t j) { return key_row(ckp, kp, s, j, g); };
      auto vrow = [&](int64_t j) { return key_row(cvp, vp, s, j, g); };
      for (int64_t t = 0; t < s.T; ++t) {
        const float* qr = qp + (t * s.Hq + h) * s.D;
        float* pr = pp + (h * s.T + t) * s.S;
        const int64_t j0 = first_key(s, t, window), j1 = s.C + t + 1;
        dots(qr, krow, j0, j1, s.D, pr + j0);
        float m = std::numeric_limits<float>::lowest();  // (-ffast-math: no infinities; a query sees itself)
        for (int64_t j = j0; j < j1; ++j) {
          pr[j] *= sc;
          m = std::max(m, pr[j]);
        }
        float sum = 0.f;
        for (int64_t j = j0; j < j1; ++j) {
          pr[j] = std::exp(pr[j] - m);
          sum += pr[j];
        }
        const float inv = 1.f / sum;
        for (int64_t j = j0; j < j1; ++j) pr[j] *= inv;
        weighted_sum(pr + j0, vrow, j0, j1, s.D, op + (t * s.Hq + h) * s.D);
      }
    }
  });
  return {o, p};
}

// (dq, dk, dv, dck, dcv) from do [T, Hq, D] and the forward's p: dp_j = do . v_j,
// ds_j = p_j (dp_j - sum_i p_i dp_i), dq = scale sum_j ds_j k_j, dk_j = scale sum_t ds_j q_t and
// dv_j = sum_t p_j do_t over the queries (and heads of a K/V head) that see key j, in order.
// Without `context_grads` the context's dck and dcv are not computed (returned as zeros): the learned
// layers' frozen context takes none, and its keys are most of the keys (39 of 51 at the step).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> row_attention_grad_rows(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& ck, const std::optional<at::Tensor>& cv, const at::Tensor& p, double scale,
    int64_t window, bool context_grads) {
  const Shape s = checked(q, k, v, ck, cv);
  TORCH_CHECK(dout.sizes() == q.sizes() && dout.scalar_type() == at::kFloat && dout.is_contiguous(),
              "dout: q's shape, contiguous float32");
  TORCH_CHECK(p.scalar_type() == at::kFloat && p.is_contiguous() && p.dim() == 3 && p.size(0) == s.Hq &&
                  p.size(1) == s.T && p.size(2) == s.S,
              "p: the forward's [Hq, T, S] probabilities");
  at::Tensor dq = at::empty_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v);
  at::Tensor dck = at::zeros({s.C, s.Hkv, s.D}, q.options()), dcv = at::zeros({s.C, s.Hkv, s.D}, q.options());
  float *dckp = dck.mutable_data_ptr<float>(), *dcvp = dcv.mutable_data_ptr<float>();
  const float *qp = q.const_data_ptr<float>(), *kp = k.const_data_ptr<float>(), *vp = v.const_data_ptr<float>();
  const float* ckp = ck ? ck->const_data_ptr<float>() : nullptr;
  const float* cvp = cv ? cv->const_data_ptr<float>() : nullptr;
  const float *dop = dout.const_data_ptr<float>(), *pp = p.const_data_ptr<float>();
  float *dqp = dq.mutable_data_ptr<float>(), *dkp = dk.mutable_data_ptr<float>(), *dvp = dv.mutable_data_ptr<float>();
  const float sc = static_cast<float>(scale);
  // Threads split K/V heads: each owns its heads' dk, dv rows (and its query heads' dq), so no two
  // threads add into the same row and each sum runs in the same order on any thread.
  at::parallel_for(0, s.Hkv, 1, [&](int64_t g0, int64_t g1) {
    std::vector<float> dp(s.S), ds(s.S);
    for (int64_t g = g0; g < g1; ++g) {
      auto krow = [&](int64_t j) { return key_row(ckp, kp, s, j, g); };
      auto vrow = [&](int64_t j) { return key_row(cvp, vp, s, j, g); };
      for (int64_t h = g * s.group; h < (g + 1) * s.group; ++h) {
        for (int64_t t = 0; t < s.T; ++t) {
          const float *dor = dop + (t * s.Hq + h) * s.D, *qr = qp + (t * s.Hq + h) * s.D;
          const float* pr = pp + (h * s.T + t) * s.S;
          const int64_t j0 = first_key(s, t, window), j1 = s.C + t + 1;
          dots(dor, vrow, j0, j1, s.D, dp.data());
          float dot_sum = 0.f;
          for (int64_t j = j0; j < j1; ++j) dot_sum += pr[j] * dp[j - j0];
          for (int64_t j = j0; j < j1; ++j) ds[j - j0] = pr[j] * (dp[j - j0] - dot_sum) * sc;
          weighted_sum(ds.data(), krow, j0, j1, s.D, dqp + (t * s.Hq + h) * s.D);
          for (int64_t j = context_grads ? j0 : std::max(j0, s.C); j < j1; ++j) {
            const float d_s = ds[j - j0];
            float* dkr = j < s.C ? dckp + (j * s.Hkv + g) * s.D : dkp + ((j - s.C) * s.Hkv + g) * s.D;
            float* dvr = j < s.C ? dcvp + (j * s.Hkv + g) * s.D : dvp + ((j - s.C) * s.Hkv + g) * s.D;
            for (int64_t d = 0; d < s.D; ++d) {
              dkr[d] += d_s * qr[d];
              dvr[d] += pr[j] * dor[d];
            }
          }
        }
      }
    }
  });
  return {dq, dk, dv, dck, dcv};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> row_attention_grad(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& ck, const std::optional<at::Tensor>& cv, const at::Tensor& p, double scale,
    int64_t window) {
  return row_attention_grad_rows(dout, q, k, v, ck, cv, p, scale, window, true);
}

}  // namespace ruvllm
