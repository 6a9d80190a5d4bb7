// The decoder's layer loop on the CPU, in C++: every layer of a step in one operator call, for the
// Llama family (Llama, Qwen2, Qwen3) and Gemma 3, one loop with a few switches for their differences.
//
// Why: at one decoding sequence the Python loop (module calls, attribute lookups, ~8 dispatcher
// calls a layer) cost more than 1 ms a step, as much as the attention itself (docs/performance.md).
// Here the loop calls the very kernels the Python loop calls (quant_matmul, dense_matmul, the fused
// ops, paged_attention, ATen's gelu), in the same order on the same operands, as plain C++ functions.
// So its output is bitwise the Python loop's (tests/unit/test_llama_layers.py), and batch invariance
// carries over from the kernels. The one change: RoPE writes k and v straight into the cache slots
// (qkv_rope_cache), where the Python loop writes them to new tensors and then index_copy_s them.
//
// What differs by family, each read from the arguments: q/k RMSNorm before RoPE (Qwen3, Gemma 3:
// the layer's q and k norm weights given), a norm on each sublayer's output before it joins the
// residual (Gemma 3's "sandwich": the post-norm weights given), GELU-tanh instead of SiLU on the
// MLP's gate (gelu_tanh), and per layer its RoPE table (Gemma's sliding layers have their own base)
// and its KV group's metadata (windowed and global layers keep separate block tables, kv_groups.py).
//
// models/cpu_layer_loop.py decides when it applies (our kernels for every linear, fp32, no quantized
// KV tier) and lays the weights out; anything else runs the Python loop.
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/gelu.h>
#include "../../csrc/kernels.h"

#include <optional>
#include <tuple>
#include <vector>

namespace ruvllm {

namespace {

// Tensors per linear in the weights list: weight (or codes), scales, zeros, bias.
constexpr int64_t kLinearSlots = 4;
// Per layer: input norm, qkv, o, the MLP's input norm, gate_up, down (kLinearSlots each), then the
// optional ones (None where the family has none): q norm, k norm, attention's and the MLP's post-norm.
constexpr int64_t kLayerSlots = 2 + 4 * kLinearSlots + 4;
constexpr int64_t kQNorm = 2 + 4 * kLinearSlots, kKNorm = kQNorm + 1, kAttnPostNorm = kQNorm + 2,
                  kMlpPostNorm = kQNorm + 3;

struct Linear {
  int64_t kind, group;
  const c10::List<std::optional<at::Tensor>>* w;
  int64_t at;  // index of its first slot

  at::Tensor get(int64_t i) const { return (*w)[at + i].value(); }
  std::optional<at::Tensor> maybe(int64_t i) const { return (*w)[at + i]; }

  // As QuantLinear.forward / dense_linear compute it for a contiguous fp32 [T, K] x.
  at::Tensor operator()(const at::Tensor& x) const {
    at::Tensor y = kind == kDense ? dense_matmul(x, get(0))
                                  : quant_matmul(x, get(0), get(1), maybe(2), group, kind == kInt4);
    if (auto bias = maybe(3)) {
      if (kind == kDense) y.add_(*bias);
      else y = y.add(*bias);  // QuantLinear adds out of place (the same sum)
    }
    return y;
  }
};

}  // namespace

// x [T, H] (the embeddings), weights: kLayerSlots tensors a layer (None where a linear or the family
// has no such part); kinds and groups: four a layer (qkv, o, gate_up, down); caches: each layer's
// [slots, Hkv, D] keys and values. cos, sin: the step's rows of each RoPE table ([T, 1, D]), layer_rope
// each layer's table. slot_mappings, block_tables, row_seqs, row_ctxs and windows: each KV group's
// metadata (window 0: global), layer_group each layer's group. scale: attention's. With row_slot (a
// step with LoRA adapters): lora holds each layer's slots, A, B and ranks for qkv, o, gate_up and
// down (twelve a layer), lora_bounds their output bounds (qkv's, o's, gate_up's, down's, one after
// the other), and each linear's output gets each row's adapter delta where the Python loop adds it
// (lora/batch.py). Returns the final norm's output [T, H].
at::Tensor llama_layers(const at::Tensor& x, const c10::List<std::optional<at::Tensor>>& weights,
                        at::IntArrayRef kinds, at::IntArrayRef groups, at::TensorList k_caches,
                        at::TensorList v_caches, const at::Tensor& final_norm, at::TensorList cos,
                        at::TensorList sin, at::IntArrayRef layer_rope, at::TensorList slot_mappings,
                        at::TensorList block_tables, at::TensorList row_seqs, at::TensorList row_ctxs,
                        at::IntArrayRef windows, at::IntArrayRef layer_group, int64_t block_size, double scale,
                        double eps, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, bool gelu_tanh,
                        at::TensorList lora, at::IntArrayRef lora_bounds, const std::optional<at::Tensor>& row_slot) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(v_caches.size()) == layers, "one value cache a layer");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kLayerSlots, "weights: ", kLayerSlots, " a layer");
  TORCH_CHECK(static_cast<int64_t>(kinds.size()) == layers * kLinears &&
                  static_cast<int64_t>(groups.size()) == layers * kLinears,
              "kinds and groups: four a layer");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x: contiguous float32 [T, H]");
  for (int64_t i = 0; i < layers * kLinears; ++i)
    TORCH_CHECK(kinds[i] == kDense || kinds[i] == kInt4 || kinds[i] == kInt8, "unknown linear kind ", kinds[i]);
  const int64_t tables = static_cast<int64_t>(cos.size()), kv_groups = static_cast<int64_t>(slot_mappings.size());
  TORCH_CHECK(static_cast<int64_t>(sin.size()) == tables && static_cast<int64_t>(layer_rope.size()) == layers,
              "cos and sin: one a RoPE table; layer_rope: one a layer");
  TORCH_CHECK(static_cast<int64_t>(block_tables.size()) == kv_groups &&
                  static_cast<int64_t>(row_seqs.size()) == kv_groups &&
                  static_cast<int64_t>(row_ctxs.size()) == kv_groups &&
                  static_cast<int64_t>(windows.size()) == kv_groups &&
                  static_cast<int64_t>(layer_group.size()) == layers,
              "slot_mappings, block_tables, row_seqs, row_ctxs, windows: one a KV group; layer_group: one a layer");
  for (int64_t l = 0; l < layers; ++l)
    TORCH_CHECK(layer_rope[l] >= 0 && layer_rope[l] < tables && layer_group[l] >= 0 && layer_group[l] < kv_groups,
                "layer ", l, ": RoPE table or KV group out of range");
  const int64_t q_size = num_heads * head_dim;
  // each projection's bounds within lora_bounds: qkv 4 values, o 2, gate_up 3, down 2
  const int64_t bound_at[kLinears + 1] = {0, 4, 6, 9, 11};
  if (row_slot) {
    TORCH_CHECK(static_cast<int64_t>(lora.size()) == layers * kLinears * 3, "lora: twelve tensors a layer");
    TORCH_CHECK(static_cast<int64_t>(lora_bounds.size()) == bound_at[kLinears], "lora_bounds: eleven values");
  }
  auto with_lora = [&](int64_t l, int64_t j, at::Tensor y, const at::Tensor& in) {
    if (row_slot) {
      const int64_t at = (l * kLinears + j) * 3;
      lora_add(y, in, lora[at], lora[at + 1], lora[at + 2], *row_slot,
               lora_bounds.slice(bound_at[j], bound_at[j + 1] - bound_at[j]), std::nullopt);
    }
    return y;
  };
  // A sublayer's output as it joins the residual: normed first where the family has a post-norm.
  auto joining = [&](const at::Tensor& y, const std::optional<at::Tensor>& post_norm) {
    return post_norm ? rms_norm(y, *post_norm, eps) : y;
  };
  at::Tensor h, residual, hidden = x;
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t base = l * kLayerSlots;
    auto linear = [&](int64_t j) {  // j: 0 qkv, 1 o, 2 gate_up, 3 down
      return Linear{kinds[l * kLinears + j], groups[l * kLinears + j], &weights, base + 1 + j * kLinearSlots +
                                                                                    (j >= 2 ? 1 : 0)};
    };
    const at::Tensor ln1 = weights[base].value(), ln2 = weights[base + 1 + 2 * kLinearSlots].value();
    if (l == 0) {
      h = rms_norm(hidden, ln1, eps);
      residual = hidden;
    } else {
      std::tie(h, residual) = add_rms_norm(hidden, residual, ln1, eps);
    }
    const int64_t g = layer_group[l], r = layer_rope[l];
    at::Tensor k_cache = k_caches[l], v_cache = v_caches[l];
    const at::Tensor q = qkv_rope_cache(with_lora(l, 0, linear(0)(h), h), cos[r], sin[r], num_heads, num_kv_heads,
                                        head_dim, k_cache, v_cache, slot_mappings[g], weights[base + kQNorm],
                                        weights[base + kKNorm], eps);
    const at::Tensor o = paged_attention(q, k_cache, v_cache, block_tables[g], row_seqs[g], row_ctxs[g], block_size,
                                         scale, windows[g])
                             .reshape({-1, q_size});
    std::tie(h, residual) =
        add_rms_norm(joining(with_lora(l, 1, linear(1)(o), o), weights[base + kAttnPostNorm]), residual, ln2, eps);
    const at::Tensor gate_up = with_lora(l, 2, linear(2)(h), h);
    at::Tensor a;
    if (gelu_tanh) {  // as the Python loop's F.gelu(gate, approximate="tanh") * up: the same ATen ops
      const int64_t inter = gate_up.size(1) / 2;
      a = at::gelu(gate_up.narrow(1, 0, inter), "tanh").mul(gate_up.narrow(1, inter, inter));
    } else {
      a = silu_and_mul(gate_up);
    }
    hidden = joining(with_lora(l, 3, linear(3)(a), a), weights[base + kMlpPostNorm]);
  }
  if (layers == 0) return rms_norm(hidden, final_norm, eps);
  return std::get<0>(add_rms_norm(hidden, residual, final_norm, eps));
}

}  // namespace ruvllm
