// The other of the kernels' two translation units (cpu_build.py; csrc/loops_unit.cpp says why two):
// the kernels the layer loops call.
#include "../attention/csrc/paged_attention.cpp"
#include "../layers/csrc/dense_matmul.cpp"
#include "../layers/csrc/fused_ops.cpp"
#include "../learning/csrc/element_grad.cpp"
#include "../learning/csrc/micro_lora.cpp"
#include "../learning/csrc/row_attention.cpp"
#include "../lora/csrc/lora_add.cpp"
#include "../quant/csrc/quant_matmul.cpp"
#include "../quant/csrc/quant_matmul_grad.cpp"
