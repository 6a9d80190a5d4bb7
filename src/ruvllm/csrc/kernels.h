// Every C++ kernel's signature, declared once: csrc/ops.cpp registers them all as operators, and the
// sources that call others (models/csrc/llama_layers.cpp, learning/csrc/learned_layers.cpp) call them
// as plain functions through these declarations, so a changed signature fails to compile everywhere
// at once instead of linking against a stale copy.
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>
#include <vector>

namespace ruvllm {
// A linear's kind in the layer loops' weight lists (llama_layers, learned_layers; models/cpu_layer_loop.py
// and learning/whole_layers.py write the same numbers), and the four linears a layer: qkv, o, gate_up, down.
inline constexpr int64_t kDense = 0;  // fp32 weight [N, K] on dense_matmul
inline constexpr int64_t kInt4 = 1;   // quant_matmul's int4 codes, scales, zeros
inline constexpr int64_t kInt8 = 2;   // quant_matmul's int8 codes, scales
inline constexpr int64_t kLinears = 4;

// attention/csrc/paged_attention.cpp
at::Tensor paged_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                           at::Tensor row_seq, at::Tensor row_ctx, int64_t block_size, double scale,
                           int64_t window);
at::Tensor paged_attention_tiered(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor k_codes,
                                  at::Tensor v_codes, at::Tensor k_meta, at::Tensor v_meta, at::Tensor block_tables,
                                  at::Tensor row_seq, at::Tensor row_ctx, int64_t block_size, double scale,
                                  int64_t num_hot_blocks, int64_t hot_tokens, int64_t bits);
void quantize_kv_blocks(at::Tensor kv_cache, at::Tensor src_slots, at::Tensor codes, at::Tensor meta,
                        at::Tensor dst_slots, int64_t bits);
// layers/csrc/dense_matmul.cpp
at::Tensor dense_matmul(const at::Tensor& x, const at::Tensor& w);
// layers/csrc/token_mask.cpp
void apply_token_bitmask(at::Tensor logits, const at::Tensor& words, const at::Tensor& rows);
// layers/csrc/fused_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor, at::Tensor> qkv_rope(const at::Tensor& qkv, const at::Tensor& cos,
                                                        const at::Tensor& sin, int64_t num_heads,
                                                        int64_t num_kv_heads, int64_t head_dim,
                                                        const std::optional<at::Tensor>& q_norm,
                                                        const std::optional<at::Tensor>& k_norm, double eps);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
at::Tensor qkv_rope_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
                          int64_t num_kv_heads, int64_t head_dim, at::Tensor& k_cache, at::Tensor& v_cache,
                          const at::Tensor& slot_mapping, const std::optional<at::Tensor>& q_norm,
                          const std::optional<at::Tensor>& k_norm, double eps);
// lora/csrc/lora_add.cpp
void lora_add(at::Tensor& y, const at::Tensor& x, const at::Tensor& A, const at::Tensor& B,
              const at::Tensor& ranks, const at::Tensor& row_slot, at::IntArrayRef bounds,
              const std::optional<at::Tensor>& row_weight);
// quant/csrc/quant_matmul.cpp
at::Tensor quant_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const std::optional<at::Tensor>& zeros, int64_t group, bool int4);
// quant/csrc/quant_matmul_grad.cpp
at::Tensor quant_matmul_grad_input(const at::Tensor& dy, const at::Tensor& codes, const at::Tensor& scales,
                                   const std::optional<at::Tensor>& zeros, int64_t group, bool int4);
// quant/csrc/q4k_search.cpp
std::tuple<at::Tensor, at::Tensor, at::Tensor> q4k_sub_block_grids(const at::Tensor& x, const at::Tensor& numerators);
// models/csrc/llama_layers.cpp
at::Tensor llama_layers(const at::Tensor& x, const c10::List<std::optional<at::Tensor>>& weights,
                        at::IntArrayRef kinds, at::IntArrayRef groups, at::TensorList k_caches,
                        at::TensorList v_caches, const at::Tensor& final_norm, at::TensorList cos,
                        at::TensorList sin, at::IntArrayRef layer_rope, at::TensorList slot_mappings,
                        at::TensorList block_tables, at::TensorList row_seqs, at::TensorList row_ctxs,
                        at::IntArrayRef windows, at::IntArrayRef layer_group, int64_t block_size, double scale,
                        double eps, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, bool gelu_tanh,
                        at::TensorList lora, at::IntArrayRef lora_bounds, const std::optional<at::Tensor>& row_slot);
// The learner's own operators (serving never calls them):
// learning/csrc/element_grad.cpp
at::Tensor rms_norm_grad(const at::Tensor& dh, const at::Tensor& s, const at::Tensor& weight, double eps,
                         const std::optional<at::Tensor>& dsum);
at::Tensor silu_and_mul_grad(const at::Tensor& dy, const at::Tensor& gate_up);
at::Tensor qkv_rope_grad(const std::optional<at::Tensor>& dq, const std::optional<at::Tensor>& dk,
                         const std::optional<at::Tensor>& dv, const at::Tensor& cos, const at::Tensor& sin,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim);
// learning/csrc/micro_lora.cpp
at::Tensor micro_lora_add_(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, int64_t lo,
                           double scaling);
std::tuple<at::Tensor, at::Tensor> micro_lora_grad(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& u,
                                                   const at::Tensor& a, const at::Tensor& b, int64_t lo,
                                                   double scaling, const std::optional<at::Tensor>& dx);
void micro_lora_adam_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                      at::TensorList steps, double lr, double beta1, double beta2, double eps, double weight_decay);
// learning/csrc/row_attention.cpp
std::tuple<at::Tensor, at::Tensor> row_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 const std::optional<at::Tensor>& ck,
                                                 const std::optional<at::Tensor>& cv, double scale, int64_t window);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> row_attention_grad(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& ck, const std::optional<at::Tensor>& cv, const at::Tensor& p, double scale,
    int64_t window);
// row_attention_grad with the context's dck, dcv computed only where asked (zeros otherwise).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> row_attention_grad_rows(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& ck, const std::optional<at::Tensor>& cv, const at::Tensor& p, double scale,
    int64_t window, bool context_grads);
// learning/csrc/learned_layers.cpp
std::vector<at::Tensor> learned_layers_forward(const at::Tensor& h, const c10::List<std::optional<at::Tensor>>& weights,
                                               at::IntArrayRef kinds, at::IntArrayRef groups,
                                               const at::Tensor& final_norm, at::TensorList cos, at::TensorList sin,
                                               const c10::List<std::optional<at::Tensor>>& context,
                                               at::IntArrayRef windows, at::TensorList lora, at::IntArrayRef lora_at,
                                               double scale, double eps, double scaling, int64_t num_heads,
                                               int64_t num_kv_heads, int64_t head_dim, at::IntArrayRef sizes,
                                               at::IntArrayRef after);
std::vector<at::Tensor> learned_layers_backward(
    const at::Tensor& dout, at::TensorList kept, const c10::List<std::optional<at::Tensor>>& weights,
    at::IntArrayRef kinds, at::IntArrayRef groups, const c10::List<std::optional<at::Tensor>>& transposed,
    at::IntArrayRef t_groups, const at::Tensor& final_norm, at::TensorList cos, at::TensorList sin,
    const c10::List<std::optional<at::Tensor>>& context, at::IntArrayRef windows, at::TensorList lora,
    at::IntArrayRef lora_at, double scale, double eps, double scaling, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, at::IntArrayRef sizes, at::IntArrayRef after);
// learning/csrc/sampled_logits.cpp
std::tuple<at::Tensor, at::Tensor> drawn_pool(const at::Tensor& rows, const at::Tensor& drawn, const at::Tensor& bias,
                                              const at::Tensor& masked);
std::tuple<at::Tensor, at::Tensor, at::Tensor> sampled_loss(const at::Tensor& rows, const at::Tensor& exact,
                                                            const at::Tensor& drawn, const at::Tensor& bias,
                                                            const at::Tensor& masked, const at::Tensor& index,
                                                            double score);
}  // namespace ruvllm
