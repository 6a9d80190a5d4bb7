"""The decoder's layer loop as one C++ call on the CPU (models/csrc/llama_layers.cpp).

At one decoding sequence the Python layer loop's own overhead (module calls, attribute lookups, a
dispatcher call per op) was more than 1 ms of a ~10 ms step. The C++ loop calls the same kernels in
the same order, so a step's hidden states are bitwise the Python loop's (tests/unit/test_llama_layers.py).

One loop serves the Llama family and Gemma 3: a layer class says how the C++ loop runs it (its
LOOP_FORM: GELU-tanh or SiLU, post-norms or not; q/k norms are read from the layer). It applies when
every piece of a layer has a C++ kernel here: the layer's class declares a LOOP_FORM itself (a family
that changes the layer otherwise, or has not been checked against the C++ loop, keeps the Python
loop), each linear is a QuantLinear on our quantized kernel (int4, int8 in groups or per channel; not
W8A8) or a dense fp32 weight on our dense kernel, the model and its norms are fp32, and the step's KV
cache has no quantized tier and runs our paged-attention kernel. Anything else keeps the Python
loop, which stays the reference.

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

@dataclass(frozen=True)
class LoopForm:
    """How the C++ loop runs a layer class: GELU-tanh on the MLP's gate instead of SiLU (Gemma), and
    each sublayer's output normed (post_attention_layernorm, post_feedforward_layernorm) before it
    joins the residual (Gemma's sandwich norms)."""

    gelu_tanh: bool = False
    post_norms: bool = False


# A linear's kind, as csrc/kernels.h numbers them for the C++ layer loops (learning/whole_layers.py too).
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
    # 22 a layer: norm, qkv (4), o (4), MLP norm, gate_up (4), down (4), q norm, k norm, attention's
    # post-norm, the MLP's post-norm (None where the family has none)
    weights: list[torch.Tensor | None]
    kinds: list[int]  # four a layer: qkv, o, gate_up, down
    groups: list[int]
    final_norm: torch.Tensor
    form: LoopForm
    layer_rope: list[int]  # each layer's RoPE table in rope_rows' lists: 1 for a sliding layer's own, else 0
    ops: Any  # the kernels' operator namespace

    @staticmethod
    def build(model: LlamaForCausalLM) -> CpuLayerLoop | None:
        """The loop for this model, or None where some piece has no C++ path here (the module's
        docstring lists them)."""
        form = vars(model.layer_class).get("LOOP_FORM")
        ops = kernels()
        if ops is None or form is None or model.ops.name != "cpu" or not hasattr(model, "norm"):
            return None
        if model.norm.weight.device.type != "cpu" or model.norm.weight.dtype != torch.float32:
            return None
        weights: list[torch.Tensor | None] = []
        kinds: list[int] = []
        groups: list[int] = []
        for layer in model.layers:
            if type(layer) is not model.layer_class:  # swapped for something else: its own forward
                return None
            entries = []
            for name in _LINEARS:
                entry = _linear_entry(getattr(layer, name))
                if entry is None:
                    return None
                entries.append(entry)
            qk = ("q_norm", "k_norm") if model.cfg.qk_norm else ()
            post = ("post_attention_layernorm", "post_feedforward_layernorm") if form.post_norms else ()
            norms = {name: getattr(layer, name).weight.detach()
                     for name in ("input_layernorm", layer.MLP_NORM, *qk, *post)}
            if any(n.dtype != torch.float32 for n in norms.values()):
                return None
            weights.append(norms["input_layernorm"])
            weights.extend(entries[0][2] + entries[1][2])
            weights.append(norms[layer.MLP_NORM])
            weights.extend(entries[2][2] + entries[3][2])
            weights.extend([norms["q_norm"], norms["k_norm"]] if qk else [None, None])
            weights.extend([norms[name] for name in post] if post else [None, None])
            kinds.extend(e[0] for e in entries)
            groups.extend(e[1] for e in entries)
        own_local = model.local_rope is not model.rope
        layer_rope = [int(own_local and w is not None) for w in model.windows]
        return CpuLayerLoop(weights, kinds, groups, model.norm.weight.detach(), form, layer_rope, ops)

    def applies(self, x: torch.Tensor, kv_caches: list[tuple], meta: AttentionMetadata, attention_kernel: Any) -> bool:
        """Whether this step can take it: fp32 rows, our paged-attention kernel over a cache without
        a quantized tier."""
        return (x.dtype == torch.float32 and attention_kernel is self.ops.paged_attention
                and all(m.tier is None for m in meta.by_group or [meta]) and all(len(c) == 2 for c in kv_caches))

    @staticmethod
    def rope_rows(model: LlamaForCausalLM, positions: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """cos and sin rows of the step's positions ([T, 1, D]) in each RoPE table: the global one,
        then the sliding layers' own where the model has one (Gemma 3)."""
        tables = [model.rope] if model.local_rope is model.rope else [model.rope, model.local_rope]
        rows = [t.for_positions(positions) for t in tables]
        return [c for c, _ in rows], [s for _, s in rows]

    def __call__(self, x: torch.Tensor, cos: list[torch.Tensor], sin: list[torch.Tensor], kv_caches: list[tuple],
                 meta: AttentionMetadata, model: LlamaForCausalLM, lora: LoraBatch | None = None) -> torch.Tensor:
        """cos, sin: rope_rows'. `lora`: the step's adapters (their deltas need our LoRA kernel:
        `lora.kernel` set)."""
        cfg = model.cfg
        tensors, bounds = lora.slots.flat() if lora is not None else ([], [])
        metas = meta.by_group or [meta]
        return self.ops.llama_layers(
            x.contiguous(), self.weights, self.kinds, self.groups, [c[0] for c in kv_caches], [c[1] for c in kv_caches],
            self.final_norm, cos, sin, self.layer_rope, [m.slot_mapping for m in metas],
            [m.block_tables for m in metas], [m.row_seq for m in metas], [m.row_ctx for m in metas],
            [m.window for m in metas], model.kv_group, meta.block_size, cfg.attention_scale, cfg.rms_norm_eps,
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.form.gelu_tanh, tensors, bounds,
            None if lora is None else lora.rows)
