// The layer loop's signature (models/csrc/llama_layers.cpp), declared once for its definition and for
// csrc/ops.cpp, which registers it with every other kernel.
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <optional>

namespace ruvllm {
at::Tensor llama_layers(const at::Tensor& x, const c10::List<std::optional<at::Tensor>>& weights,
                        at::IntArrayRef kinds, at::IntArrayRef groups, at::TensorList k_caches,
                        at::TensorList v_caches, const at::Tensor& final_norm, at::TensorList cos,
                        at::TensorList sin, at::IntArrayRef layer_rope, at::TensorList slot_mappings,
                        at::TensorList block_tables, at::TensorList row_seqs, at::TensorList row_ctxs,
                        at::IntArrayRef windows, at::IntArrayRef layer_group, int64_t block_size, double scale,
                        double eps, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, bool gelu_tanh,
                        at::TensorList lora, at::IntArrayRef lora_bounds, const std::optional<at::Tensor>& row_slot);
}  // namespace ruvllm
