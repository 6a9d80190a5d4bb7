"""The decoder's layer loop as one C++ call on the CPU (models/csrc/llama_layers.cpp).

At one decoding sequence the Python layer loop's own overhead (module calls, attribute lookups, a
dispatcher call per op) was more than 1 ms of a ~10 ms step. The C++ loop calls the same kernels in
the same order, so a step's hidden states are bitwise the Python loop's (tests/unit/test_llama_layers.py).

It applies when every piece of a layer has a C++ kernel here: each linear is a QuantLinear on our
quantized kernel (int4, int8 in groups or per channel; not W8A8) or a dense fp32 weight on our dense
kernel, the model computes in fp32, there are no q/k norms (Qwen3), and the KV cache has no
quantized tier. Anything else keeps the Python loop, which stays the reference.

`CpuLayerLoop.build(model)` lays the weights out once; the model drops it when its parameters move
(`_apply`) or are loaded. Code that swaps a layer's modules or parameters after that must call
`model.invalidate_layer_loop()`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ruvllm.attention.metadata import AttentionMetadata
from ruvllm.cpu_build import kernels
from ruvllm.layers import dense
from ruvllm.quant.linear import QuantLinear

if TYPE_CHECKING:
    from ruvllm.lora.batch import LoraBatch
    from ruvllm.models.llama import LlamaForCausalLM

# A linear's kind, as llama_layers.cpp numbers them.
DENSE, INT4, INT8 = 0, 1, 2
_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _linear_entry(module: torch.nn.Module) -> tuple[int, int, list[torch.Tensor | None]] | None:
    """(kind, group, [weight or codes, scales, zeros, bias]) for the C++ loop, or None if it has no
    C++ path there."""
    if isinstance(module, QuantLinear):
        kw = module._kernel_weight  # None unless it runs our kernel (not W8A8, not CUDA)
        if kw is None:
            return None
        bias = module.bias
        if bias is not None and bias.dtype != torch.float32:
            return None
        return (INT4 if kw.int4 else INT8), kw.group, [kw.codes, kw.scales, kw.zeros, bias]
    if isinstance(module, dense.DenseLinear):
        w, bias = module.weight, module.bias
        if w.dtype != torch.float32 or (bias is not None and bias.dtype != torch.float32) or not dense._simd():
            return None  # dense_linear would not take our kernel either
        return DENSE, 0, [w.detach(), None, None, None if bias is None else bias.detach()]
    return None


@dataclass(frozen=True)
class CpuLayerLoop:
    weights: list[torch.Tensor | None]  # 18 a layer: norm, qkv (4), o (4), norm, gate_up (4), down (4)
    kinds: list[int]  # four a layer: qkv, o, gate_up, down
    groups: list[int]
    final_norm: torch.Tensor
    ops: Any  # the kernels' operator namespace

    @staticmethod
    def build(model: LlamaForCausalLM) -> CpuLayerLoop | None:
        """The loop for this model, or None where some piece has no C++ path here."""
        cfg = model.cfg
        ops = kernels()
        if ops is None or model.ops.name != "cpu" or cfg.qk_norm or not hasattr(model, "norm"):
            return None
        if model.norm.weight.device.type != "cpu" or model.norm.weight.dtype != torch.float32:
            return None
        weights: list[torch.Tensor | None] = []
        kinds: list[int] = []
        groups: list[int] = []
        for layer in model.layers:
            entries = []
            for name in _LINEARS:
                entry = _linear_entry(getattr(layer, name))
                if entry is None:
                    return None
                entries.append(entry)
            norms = (layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach())
            if any(n.dtype != torch.float32 for n in norms):
                return None
            weights.append(norms[0])
            weights.extend(entries[0][2] + entries[1][2])
            weights.append(norms[1])
            weights.extend(entries[2][2] + entries[3][2])
            kinds.extend(e[0] for e in entries)
            groups.extend(e[1] for e in entries)
        return CpuLayerLoop(weights, kinds, groups, model.norm.weight.detach(), ops)

    def applies(self, x: torch.Tensor, kv_caches: list[tuple], meta: AttentionMetadata, attention_kernel: Any) -> bool:
        """Whether this step can take it: fp32 rows, our paged-attention kernel over a cache without
        a quantized tier."""
        return (x.dtype == torch.float32 and attention_kernel is self.ops.paged_attention
                and meta.tier is None and all(len(c) == 2 for c in kv_caches))

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_caches: list[tuple],
                 meta: AttentionMetadata, model: LlamaForCausalLM, lora: LoraBatch | None = None) -> torch.Tensor:
        """`lora`: the step's adapters (their deltas need our LoRA kernel: `lora.kernel` set)."""
        cfg = model.cfg
        tensors, bounds = lora.slots.flat() if lora is not None else ([], [])
        return self.ops.llama_layers(
            x.contiguous(), self.weights, self.kinds, self.groups, [c[0] for c in kv_caches], [c[1] for c in kv_caches],
            self.final_norm, cos, sin, meta.slot_mapping, meta.block_tables, meta.row_seq, meta.row_ctx,
            meta.block_size, cfg.head_dim ** -0.5, cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            tensors, bounds, None if lora is None else lora.rows)
