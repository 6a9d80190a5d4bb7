// Our C++ CPU kernels as PyTorch operators (torch.ops.<extension name>.*), one library for all.
//
// Why operators rather than a pybind11 module: torch/library.h compiles in a fraction of the time
// of torch/extension.h, which the kernels' sources would otherwise each include (a cold build went
// from ~70 to ~20 CPU seconds); the dispatcher releases the GIL during a call as it does for torch's
// own ops; and an operator with a schema and a fake kernel (ruvllm/cpu_build.py registers those)
// is what torch.compile needs to trace a step through it.
//
// The namespace is the extension's name, which carries its build tag (ruvllm/cpu_build.py), so two
// builds loaded in one process never claim the same namespace.
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "kernels.h"

TORCH_LIBRARY(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor row_seq, "
        "Tensor row_ctx, int block_size, float scale, int window=0) -> Tensor");
  m.def("paged_attention_tiered(Tensor q, Tensor k_cache, Tensor v_cache, Tensor k_codes, Tensor v_codes, "
        "Tensor k_meta, Tensor v_meta, Tensor block_tables, Tensor row_seq, Tensor row_ctx, int block_size, "
        "float scale, int num_hot_blocks, int hot_tokens, int bits) -> Tensor");
  // Writes the cold tier in place: codes and meta are declared mutated.
  m.def("quantize_kv_blocks(Tensor kv_cache, Tensor src_slots, Tensor(a!) codes, Tensor(b!) meta, "
        "Tensor dst_slots, int bits) -> ()");
  m.def("dense_matmul(Tensor x, Tensor w) -> Tensor");
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor words, Tensor rows) -> ()");
  m.def("quant_matmul(Tensor x, Tensor codes, Tensor scales, Tensor? zeros, int group, bool int4) -> Tensor");
  // The learner's backward through quant_matmul: dx = dy . W.
  m.def("quant_matmul_grad_input(Tensor dy, Tensor codes, Tensor scales, Tensor? zeros, int group, bool int4) "
        "-> Tensor");
  // Q4_K's sub-block search at load (-q q4k): each sub-block's scale, min and codes.
  m.def("q4k_sub_block_grids(Tensor x, Tensor numerators) -> (Tensor, Tensor, Tensor)");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("qkv_rope(Tensor qkv, Tensor cos, Tensor sin, int num_heads, int num_kv_heads, int head_dim, "
        "Tensor? q_norm=None, Tensor? k_norm=None, float eps=0.) -> (Tensor, Tensor, Tensor)");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  // Writes k and v into the caches in place.
  m.def("qkv_rope_cache(Tensor qkv, Tensor cos, Tensor sin, int num_heads, int num_kv_heads, int head_dim, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, Tensor? q_norm=None, Tensor? k_norm=None, "
        "float eps=0.) -> Tensor");
  // Adds each row's adapter delta to y in place.
  m.def("lora_add(Tensor(a!) y, Tensor x, Tensor A, Tensor B, Tensor ranks, Tensor row_slot, int[] bounds, Tensor? row_weight=None) -> ()");
  m.def("llama_layers(Tensor x, Tensor?[] weights, int[] kinds, int[] groups, Tensor(a!)[] k_caches, "
        "Tensor(b!)[] v_caches, Tensor final_norm, Tensor[] cos, Tensor[] sin, int[] layer_rope, "
        "Tensor[] slot_mappings, Tensor[] block_tables, Tensor[] row_seqs, Tensor[] row_ctxs, int[] windows, "
        "int[] layer_group, int block_size, float scale, float eps, int num_heads, int num_kv_heads, int head_dim, "
        "bool gelu_tanh, Tensor[] lora, int[] lora_bounds, Tensor? row_slot) -> Tensor");
  // The learner's backward passes and its attention over a dozen rows.
  m.def("rms_norm_grad(Tensor dh, Tensor s, Tensor weight, float eps, Tensor? dsum) -> Tensor");
  m.def("silu_and_mul_grad(Tensor dy, Tensor gate_up) -> Tensor");
  m.def("qkv_rope_grad(Tensor? dq, Tensor? dk, Tensor? dv, Tensor cos, Tensor sin, int num_heads, "
        "int num_kv_heads, int head_dim) -> Tensor");
  m.def("micro_lora_add_(Tensor(a!) y, Tensor x, Tensor a, Tensor b, int lo, float scaling) -> Tensor");
  m.def("micro_lora_grad(Tensor dy, Tensor x, Tensor u, Tensor a, Tensor b, int lo, float scaling, Tensor(b!)? dx) "
        "-> (Tensor, Tensor)");
  // One Adam step over the micro-LoRA's tensors (torch's fused CPU Adam's arithmetic), in place.
  m.def("micro_lora_adam_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
        "Tensor(d!)[] steps, float lr, float beta1, float beta2, float eps, float weight_decay) -> ()");
  m.def("row_attention(Tensor q, Tensor k, Tensor v, Tensor? ck, Tensor? cv, float scale, int window) "
        "-> (Tensor, Tensor)");
  m.def("row_attention_grad(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor? ck, Tensor? cv, Tensor p, "
        "float scale, int window) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // The learned layers' whole forward (the activations the backward reads kept) and backward.
  m.def("learned_layers_forward(Tensor h, Tensor?[] weights, int[] kinds, int[] groups, Tensor final_norm, "
        "Tensor[] cos, Tensor[] sin, Tensor?[] context, int[] windows, Tensor[] lora, int[] lora_at, float scale, "
        "float eps, float scaling, int num_heads, int num_kv_heads, int head_dim, int[] sizes=[], int[] after=[]) "
        "-> Tensor[]");
  m.def("learned_layers_backward(Tensor dout, Tensor[] kept, Tensor?[] weights, int[] kinds, int[] groups, "
        "Tensor?[] transposed, int[] t_groups, Tensor final_norm, Tensor[] cos, Tensor[] sin, Tensor?[] context, "
        "int[] windows, Tensor[] lora, int[] lora_at, float scale, float eps, float scaling, int num_heads, "
        "int num_kv_heads, int head_dim, int[] sizes=[], int[] after=[]) -> Tensor[]");
  // The sampled softmax's drawn candidates pooled: each row's log-sum-exp over them and its gradient.
  m.def("drawn_pool(Tensor rows, Tensor drawn, Tensor bias, Tensor masked) -> (Tensor, Tensor)");
  // The instant step's sampled-softmax loss and its rows' gradient in one call (no autograd graph).
  m.def("sampled_loss(Tensor rows, Tensor exact, Tensor drawn, Tensor bias, Tensor masked, Tensor index, "
        "float score) -> (Tensor, Tensor, Tensor)");
}

// Each kernel's CPU implementation. All are registered here, none beside its code: torch/library.h and
// the registration templates cost each source that includes them ~3.5-5 s more to compile (g++ alone,
// loaded host: 13.7 against 9.1 s for micro_lora.cpp), and a cold build is part of every set-up.
TORCH_LIBRARY_IMPL(TORCH_EXTENSION_NAME, CPU, m) {
  m.impl("paged_attention", &ruvllm::paged_attention);
  m.impl("paged_attention_tiered", &ruvllm::paged_attention_tiered);
  m.impl("quantize_kv_blocks", &ruvllm::quantize_kv_blocks);
  m.impl("dense_matmul", &ruvllm::dense_matmul);
  m.impl("apply_token_bitmask", &ruvllm::apply_token_bitmask);
  m.impl("quant_matmul", &ruvllm::quant_matmul);
  m.impl("quant_matmul_grad_input", &ruvllm::quant_matmul_grad_input);
  m.impl("q4k_sub_block_grids", &ruvllm::q4k_sub_block_grids);
  m.impl("rms_norm", &ruvllm::rms_norm);
  m.impl("add_rms_norm", &ruvllm::add_rms_norm);
  m.impl("qkv_rope", &ruvllm::qkv_rope);
  m.impl("silu_and_mul", &ruvllm::silu_and_mul);
  m.impl("qkv_rope_cache", &ruvllm::qkv_rope_cache);
  m.impl("lora_add", &ruvllm::lora_add);
  m.impl("llama_layers", &ruvllm::llama_layers);
  m.impl("rms_norm_grad", &ruvllm::rms_norm_grad);
  m.impl("silu_and_mul_grad", &ruvllm::silu_and_mul_grad);
  m.impl("qkv_rope_grad", &ruvllm::qkv_rope_grad);
  m.impl("micro_lora_add_", &ruvllm::micro_lora_add_);
  m.impl("micro_lora_grad", &ruvllm::micro_lora_grad);
  m.impl("micro_lora_adam_", &ruvllm::micro_lora_adam_);
  m.impl("row_attention", &ruvllm::row_attention);
  m.impl("row_attention_grad", &ruvllm::row_attention_grad);
  m.impl("learned_layers_forward", &ruvllm::learned_layers_forward);
  m.impl("learned_layers_backward", &ruvllm::learned_layers_backward);
  m.impl("drawn_pool", &ruvllm::drawn_pool);
  m.impl("sampled_loss", &ruvllm::sampled_loss);
}
