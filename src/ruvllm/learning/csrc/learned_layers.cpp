// The learned layers' forward and backward without autograd's graph (issue 37 item 1, session 19):
// every learned decoder layer of the instant step and the final norm in one call forward, one call
// backward, the activations the backward reads kept by the forward and handed back to the caller.
//
// Why: at the step's dozen rows, autograd's ~60 nodes a step (one a projection, norm, RoPE split,
// attention, SiLU) cost their Python, their bookkeeping and a dispatch each way, ~6 ms of a ~19.5 ms
// step on the quiet 2-core host (docs/learning.md "Session 18"), beside ~10 ms of kernels. Here the
// same kernels run in the same order on the same operands, called as plain C++ functions (as
// models/csrc/llama_layers.cpp does for serving): the packed matmul (quant_matmul) forward, its input
// gradient over the transposed 8-bit copy (quant_matmul again) or the served codes
// (quant_matmul_grad_input), the fused norm, RoPE and SiLU ops and their backward passes
// (element_grad.cpp), the rows' attention (row_attention.cpp) and the micro-LoRA pieces
// (micro_lora.cpp). So the forward is bitwise the autograd path's and the gradients are its sums in
// its order (tests/unit/test_learning_whole.py checks both); learning/whole_layers.py decides when it
// applies (the Llama layer on packed weights, no q/k norm) and the autograd path stays the reference.
//
// The layout of the arguments (learning/whole_layers.py writes the same):
// - weights, kSlots a layer: the input norm's weight, then for each of the 4 linears (qkv, o,
//   gate_up, down) its codes, scales, zero points (int4) and bias, then (after o) the MLP's norm.
// - kinds and groups, one a linear: kInt4 or kInt8 (quant_matmul's int4 flag), the group size.
// - transposed, 3 slots a linear (codes, scales, zero points of W^T in 8 bits), t_groups one a linear,
//   0 where the linear has no copy (its input gradient runs the float32 kernel over its codes).
// - lora: each piece's A [r, K] and B [n, r]; lora_at: (layer, linear, first column) a piece, in the
//   order the pieces are added (the autograd path's: layer, then linear, then column).
// - context: each (layer, sequence)'s kept K/V (2 slots each, layer-major, None where there is none).
// - sizes: the sequences' row counts, their rows concatenated in h (empty: h is one sequence); after:
//   for each sequence, -1, or an earlier sequence (itself after none, without a context) whose rows of
//   this pass it continues: at every layer it attends to that one's K/V before its own, and the
//   gradient flows into them (the KL term's completions after their shared start; session 21). Every
//   op but attention works row by row on the concatenation, and each row's arithmetic does not depend
//   on the rows beside it (the packed kernel quantizes and sums each row alone), so a sequence's rows
//   are bitwise what a pass of it alone gives; attention runs a sequence at a time.
// The first learned layer's input (the residual stream entering it) takes no gradient: its q/k/v
// projection's input gradient and its input norm's backward are not computed.
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>

#include "../../csrc/kernels.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace ruvllm {

namespace {

constexpr int64_t kSlots = 2 + 4 * kLinears;  // the two norms' weights and 4 slots a linear
constexpr int64_t kLinearAt[kLinears] = {1, 5, 10, 14};  // each linear's first slot in a layer
constexpr int64_t kMlpNorm = 9;
// What the forward keeps a layer, in this order after the output (then the final norm's sum, then
// each piece's rank-r product u, then the other sequences' attention probabilities, (layer,
// sequence) from the second sequence on): the input norm's sum and output, q, k, v, attention's
// probabilities (of the first sequence), attention's output, the MLP norm's sum and output, gate_up,
// the MLP's product.
enum Kept : int64_t { kS1, kH1, kQ, kK, kV, kP, kO, kS2, kH2, kGateUp, kAct, kKept };

using Slots = c10::List<std::optional<at::Tensor>>;

struct Args {
  const Slots& weights;
  at::IntArrayRef kinds, groups;
  const Slots& context;
  at::IntArrayRef windows;
  std::vector<int64_t> off, len, after;  // each sequence's first row, rows, and the one it continues (-1)
  at::TensorList lora;
  at::IntArrayRef lora_at;
  double scale, eps, scaling;
  int64_t hq, hkv, d, layers, pieces;

  int64_t seqs() const { return static_cast<int64_t>(len.size()); }
  // sequence s's rows of a [T, ...] activation (contiguous: a slice of the first dimension)
  at::Tensor rows(const at::Tensor& t, int64_t s) const { return seqs() == 1 ? t : t.narrow(0, off[s], len[s]); }
  // sequence s's attention context at layer l: the continued sequence's K/V of this pass, or its own kept
  std::optional<at::Tensor> ctx(int64_t layer, int64_t s, int64_t i, const at::Tensor& k, const at::Tensor& v) const {
    if (after[s] >= 0) return rows(i == 0 ? k : v, after[s]);
    return context.get(2 * (layer * seqs() + s) + i);
  }
  // where the forward keeps sequence s's (s > 0) probabilities at layer l
  int64_t p_at(int64_t layer, int64_t s) const { return 2 + layers * kKept + pieces + layer * (seqs() - 1) + s - 1; }

  at::Tensor weight(int64_t layer, int64_t slot) const { return weights.get(layer * kSlots + slot).value(); }
  std::optional<at::Tensor> maybe(int64_t layer, int64_t slot) const { return weights.get(layer * kSlots + slot); }

  // As PackedLoraMatmul's forward: the packed matmul, the bias, each of the linear's pieces' delta
  // added into its columns in order (its u kept in `us`, by piece).
  at::Tensor linear(int64_t layer, int64_t j, const at::Tensor& x, std::vector<at::Tensor>& us) const {
    const int64_t at = kLinearAt[j], i = layer * kLinears + j;
    at::Tensor y = quant_matmul(x, weight(layer, at), weight(layer, at + 1), maybe(layer, at + 2), groups[i],
                                kinds[i] == kInt4);
    if (auto bias = maybe(layer, at + 3)) y.add_(*bias);
    for (int64_t p = 0; p < pieces; ++p)
      if (lora_at[3 * p] == layer && lora_at[3 * p + 1] == j)
        us[p] = micro_lora_add_(y, x, lora[2 * p], lora[2 * p + 1], lora_at[3 * p + 2], scaling);
    return y;
  }
};

Args checked(const at::Tensor& h, const Slots& weights, at::IntArrayRef kinds, at::IntArrayRef groups,
             const Slots& context, at::IntArrayRef windows, at::TensorList lora, at::IntArrayRef lora_at,
             double scale, double eps, double scaling, int64_t hq, int64_t hkv, int64_t d, at::TensorList cos,
             at::TensorList sin, at::IntArrayRef sizes, at::IntArrayRef after) {
  const int64_t n = static_cast<int64_t>(windows.size());
  std::vector<int64_t> off, len, aft;
  if (sizes.empty()) {
    TORCH_CHECK(after.empty() || (after.size() == 1 && after[0] == -1), "after: one a sequence");
    off = {0}, len = {h.size(0)}, aft = {-1};
  } else {
    TORCH_CHECK(after.size() == sizes.size(), "after: one a sequence");
    int64_t rows = 0;
    for (size_t s = 0; s < sizes.size(); ++s) {
      TORCH_CHECK(sizes[s] > 0, "sizes: each sequence at least one row");
      const int64_t a = after[s];
      TORCH_CHECK(a == -1 || (a >= 0 && a < static_cast<int64_t>(s) && after[a] == -1),
                  "after: -1 or an earlier sequence that continues none");
      off.push_back(rows), len.push_back(sizes[s]), aft.push_back(a);
      rows += sizes[s];
    }
    TORCH_CHECK(rows == h.size(0), "sizes: they add up to h's rows");
  }
  const int64_t seqs = static_cast<int64_t>(len.size());
  TORCH_CHECK(n > 0, "at least one learned layer");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == n * kSlots, "weights: ", kSlots, " slots a layer");
  TORCH_CHECK(static_cast<int64_t>(kinds.size()) == n * kLinears && static_cast<int64_t>(groups.size()) == n * kLinears,
              "kinds, groups: one a linear");
  TORCH_CHECK(static_cast<int64_t>(context.size()) == 2 * n * seqs, "context: 2 slots a layer and sequence");
  for (int64_t s = 0; s < seqs; ++s)
    for (int64_t l = 0; l < n; ++l) {
      if (aft[s] >= 0 || (aft.size() > 1 && std::find(aft.begin(), aft.end(), s) != aft.end()))
        TORCH_CHECK(!context.get(2 * (l * seqs + s)).has_value() && !context.get(2 * (l * seqs + s) + 1).has_value(),
                    "context: none for a sequence that continues another, or that another continues");
    }
  TORCH_CHECK(static_cast<int64_t>(cos.size()) == n && static_cast<int64_t>(sin.size()) == n, "cos, sin: one a layer");
  TORCH_CHECK(lora.size() % 2 == 0 && lora_at.size() == lora.size() / 2 * 3,
              "lora: A and B a piece; lora_at: 3 a piece");
  TORCH_CHECK(h.device().is_cpu() && h.scalar_type() == at::kFloat && h.dim() == 2 && h.is_contiguous(),
              "h: a contiguous float32 CPU [T, H] tensor");
  for (int64_t i = 0; i < n * kLinears; ++i)
    TORCH_CHECK(kinds[i] == kInt4 || kinds[i] == kInt8, "kinds: packed int4 or int8");
  const int64_t pieces = static_cast<int64_t>(lora.size()) / 2;
  for (int64_t p = 0; p < pieces; ++p)
    TORCH_CHECK(lora_at[3 * p] >= 0 && lora_at[3 * p] < n && lora_at[3 * p + 1] >= 0 && lora_at[3 * p + 1] < kLinears,
                "lora_at: a learned layer and a linear");
  return {weights, kinds, groups, context, windows, off, len, aft, lora, lora_at, scale, eps, scaling, hq, hkv, d, n,
          pieces};
}

}  // namespace

// [the final-normed rows [T, H], then per layer the kKept activations, then the final norm's sum,
// then each piece's u]: what learned_layers_backward reads back.
std::vector<at::Tensor> learned_layers_forward(const at::Tensor& h, const c10::List<std::optional<at::Tensor>>& weights,
                                               at::IntArrayRef kinds, at::IntArrayRef groups,
                                               const at::Tensor& final_norm, at::TensorList cos, at::TensorList sin,
                                               const c10::List<std::optional<at::Tensor>>& context,
                                               at::IntArrayRef windows, at::TensorList lora, at::IntArrayRef lora_at,
                                               double scale, double eps, double scaling, int64_t num_heads,
                                               int64_t num_kv_heads, int64_t head_dim, at::IntArrayRef sizes,
                                               at::IntArrayRef after) {
  const Args a = checked(h, weights, kinds, groups, context, windows, lora, lora_at, scale, eps, scaling, num_heads,
                         num_kv_heads, head_dim, cos, sin, sizes, after);
  const int64_t T = h.size(0), S = a.seqs();
  std::vector<at::Tensor> kept(1 + a.layers * kKept + 1 + a.pieces + a.layers * (S - 1));
  std::vector<at::Tensor> us(a.pieces);
  at::Tensor x = h, residual;
  for (int64_t l = 0; l < a.layers; ++l) {
    at::Tensor* k = kept.data() + 1 + l * kKept;
    // the stream entering the first learned layer is whole (residual None): its norm alone
    if (l == 0) {
      k[kS1] = x;
      k[kH1] = rms_norm(x, a.weight(l, 0), eps);
    } else {
      std::tie(k[kH1], k[kS1]) = add_rms_norm(x, residual, a.weight(l, 0), eps);
    }
    at::Tensor qkv = a.linear(l, 0, k[kH1], us);
    std::tie(k[kQ], k[kK], k[kV]) =
        qkv_rope(qkv, cos[l], sin[l], num_heads, num_kv_heads, head_dim, std::nullopt, std::nullopt, 0.);
    std::vector<at::Tensor> os(S);
    for (int64_t s = 0; s < S; ++s)  // a sequence at a time, each against its own context
      std::tie(os[s], s ? kept[a.p_at(l, s)] : k[kP]) =
          row_attention(a.rows(k[kQ], s), a.rows(k[kK], s), a.rows(k[kV], s), a.ctx(l, s, 0, k[kK], k[kV]),
                        a.ctx(l, s, 1, k[kK], k[kV]), scale, windows[l]);
    k[kO] = (S == 1 ? os[0] : at::cat(os, 0)).view({T, num_heads * head_dim});
    at::Tensor y = a.linear(l, 1, k[kO], us);
    std::tie(k[kH2], k[kS2]) = add_rms_norm(y, k[kS1], a.weight(l, kMlpNorm), eps);
    k[kGateUp] = a.linear(l, 2, k[kH2], us);
    k[kAct] = silu_and_mul(k[kGateUp]);
    x = a.linear(l, 3, k[kAct], us);
    residual = k[kS2];
  }
  std::tie(kept[0], kept[1 + a.layers * kKept]) = add_rms_norm(x, residual, final_norm, eps);
  for (int64_t p = 0; p < a.pieces; ++p) kept[2 + a.layers * kKept + p] = us[p];
  return kept;
}

// Each piece's (dA, dB), in lora's order, from the final rows' gradient `dout` and the forward's `kept`.
std::vector<at::Tensor> learned_layers_backward(
    const at::Tensor& dout, at::TensorList kept, const c10::List<std::optional<at::Tensor>>& weights,
    at::IntArrayRef kinds, at::IntArrayRef groups, const c10::List<std::optional<at::Tensor>>& transposed,
    at::IntArrayRef t_groups, const at::Tensor& final_norm, at::TensorList cos, at::TensorList sin,
    const c10::List<std::optional<at::Tensor>>& context, at::IntArrayRef windows, at::TensorList lora,
    at::IntArrayRef lora_at, double scale, double eps, double scaling, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, at::IntArrayRef sizes, at::IntArrayRef after) {
  TORCH_CHECK(kept.size() >= 2 + kKept, "kept: learned_layers_forward's list");
  const at::Tensor& h = kept[1 + kS1];
  const Args a = checked(h, weights, kinds, groups, context, windows, lora, lora_at, scale, eps, scaling, num_heads,
                         num_kv_heads, head_dim, cos, sin, sizes, after);
  const int64_t S = a.seqs();
  TORCH_CHECK(static_cast<int64_t>(kept.size()) == 1 + a.layers * kKept + 1 + a.pieces + a.layers * (S - 1),
              "kept: learned_layers_forward's list");
  TORCH_CHECK(static_cast<int64_t>(transposed.size()) == 3 * a.layers * kLinears &&
                  static_cast<int64_t>(t_groups.size()) == a.layers * kLinears,
              "transposed: 3 slots a linear; t_groups: one a linear");
  TORCH_CHECK(dout.sizes() == kept[0].sizes() && dout.scalar_type() == at::kFloat && dout.is_contiguous(),
              "dout: the output's shape, contiguous float32");
  const int64_t T = dout.size(0);
  std::vector<at::Tensor> grads(2 * a.pieces);

  // A linear's backward, as PackedLoraMatmul's: the input gradient through W (its transposed 8-bit
  // copy where there is one) when asked for, then each of its pieces' dA, dB and share of dx.
  auto linear_grad = [&](int64_t l, int64_t j, const at::Tensor& dy, const at::Tensor& x, bool input) {
    const int64_t i = l * kLinears + j, at = kLinearAt[j];
    std::optional<at::Tensor> dx;
    if (input) {
      if (auto codes = transposed.get(3 * i))
        dx = quant_matmul(dy, *codes, transposed.get(3 * i + 1).value(), transposed.get(3 * i + 2), t_groups[i], false);
      else
        dx = quant_matmul_grad_input(dy, a.weight(l, at), a.weight(l, at + 1), a.maybe(l, at + 2), groups[i],
                                     kinds[i] == kInt4);
    }
    for (int64_t p = 0; p < a.pieces; ++p) {
      if (lora_at[3 * p] != l || lora_at[3 * p + 1] != j) continue;
      std::tie(grads[2 * p], grads[2 * p + 1]) =
          micro_lora_grad(dy, x, kept[2 + a.layers * kKept + p], lora[2 * p], lora[2 * p + 1], lora_at[3 * p + 2],
                          scaling, dx);
    }
    return dx;
  };

  // the final norm's sum is the last layer's output plus its residual: both take this gradient
  at::Tensor dx = rms_norm_grad(dout, kept[1 + a.layers * kKept], final_norm, eps, std::nullopt), dres = dx;
  for (int64_t l = a.layers - 1; l >= 0; --l) {
    const at::Tensor* k = kept.data() + 1 + l * kKept;
    at::Tensor dact = linear_grad(l, 3, dx, k[kAct], true).value();
    at::Tensor dgate_up = silu_and_mul_grad(dact, k[kGateUp]);
    at::Tensor dh2 = linear_grad(l, 2, dgate_up, k[kH2], true).value();
    // the MLP norm's sum is attention's output plus the stream before it: both take ds2
    at::Tensor ds2 = rms_norm_grad(dh2, k[kS2], a.weight(l, kMlpNorm), eps, dres);
    at::Tensor dout_attn = linear_grad(l, 1, ds2, k[kO], true).value();
    // (a kept context takes no gradient here: its dck, dcv are not computed)
    const at::Tensor dattn = dout_attn.view({T, num_heads, head_dim});
    at::Tensor dq, dk, dv;
    if (S == 1) {
      std::tie(dq, dk, dv, std::ignore, std::ignore) = row_attention_grad_rows(
          dattn, k[kQ], k[kK], k[kV], a.ctx(l, 0, 0, k[kK], k[kV]), a.ctx(l, 0, 1, k[kK], k[kV]), k[kP], scale,
          windows[l], false);
    } else {
      // a sequence at a time, in order; a continued sequence's dK/dV gather its continuers' context
      // gradients after its own, in their order (fixed: the same bits at any thread count)
      dq = at::empty_like(k[kQ]), dk = at::zeros_like(k[kK]), dv = at::zeros_like(k[kV]);
      for (int64_t s = 0; s < S; ++s) {
        auto [dqs, dks, dvs, dck, dcv] = row_attention_grad_rows(
            a.rows(dattn, s), a.rows(k[kQ], s), a.rows(k[kK], s), a.rows(k[kV], s), a.ctx(l, s, 0, k[kK], k[kV]),
            a.ctx(l, s, 1, k[kK], k[kV]), s ? kept[a.p_at(l, s)] : k[kP], scale, windows[l], a.after[s] >= 0);
        a.rows(dq, s).copy_(dqs);
        a.rows(dk, s).add_(dks);
        a.rows(dv, s).add_(dvs);
        if (a.after[s] >= 0) {
          a.rows(dk, a.after[s]).add_(dck);
          a.rows(dv, a.after[s]).add_(dcv);
        }
      }
    }
    at::Tensor dqkv = qkv_rope_grad(dq, dk, dv, cos[l], sin[l], num_heads, num_kv_heads, head_dim);
    if (l == 0) {  // the stream entering the learned layers takes no gradient: the pieces' alone
      linear_grad(l, 0, dqkv, k[kH1], false);
      break;
    }
    at::Tensor dh1 = linear_grad(l, 0, dqkv, k[kH1], true).value();
    dx = rms_norm_grad(dh1, k[kS1], a.weight(l, 0), eps, ds2);
    dres = dx;
  }
  return grads;
}

}  // namespace ruvllm
