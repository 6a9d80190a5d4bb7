"""The learned layers as one C++ call each way (issue 37 item 1, session 19): no autograd graph.

The instant step ran its learned layers as ~60 autograd nodes (a packed projection, a norm, the
RoPE split, attention, SiLU each one node of our C++: learning/packed_linear.py, fused_ops.py,
row_attention.py), and at a dozen rows their Python, bookkeeping and dispatch took ~6 ms of a ~19.5
ms step beside ~10 ms of kernels (docs/learning.md "Session 18"). Here the whole stack, every
learned layer and the final norm, runs forward in one call of learning/csrc/learned_layers.cpp,
which keeps the activations its backward reads, and backward in one more, which gives each
micro-LoRA piece's gradients: one autograd node (WholeLayers) stands for it all, so the sampled
softmax above it and the gradients' way into each parameter's .grad are autograd's as before.

It calls the very kernels the autograd path's nodes call, in the same order on the same operands:
the forward is bitwise that path's, the gradients its sums in its order
(tests/unit/test_learning_whole.py). It applies where that path's nodes are all our C++: the Llama
decoder layer (no q/k norm, no sublayer post-norms: not Gemma 3, Qwen3) with every learned
projection packed, one sequence, its input (the residual stream entering the layers) taking no
gradient. Anything else (float weights, Gemma 3, several sequences, the full context's last layer
that reads the prompt's K/V of the same pass) runs the autograd path, which stays the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd import Function

from ruvllm.lora.peft_adapter import projection_shape
from ruvllm.lora.slots import FUSED
from ruvllm.models.cpu_layer_loop import INT4, INT8
from ruvllm.models.llama import DecoderLayer, LlamaForCausalLM
from ruvllm.quant.linear import QuantLinear

LINEARS = ("qkv", "o", "gate_up", "down")  # learned_layers.cpp's order of a layer's linears


@dataclass(frozen=True)
class WholePlan:
    """The learned layers' weights laid out as learned_layers.cpp reads them, made once."""

    weights: list[torch.Tensor | None]
    kinds: list[int]
    groups: list[int]
    transposed: list[torch.Tensor | None]
    t_groups: list[int]
    final_norm: torch.Tensor
    windows: list[int]
    global_rope: list[bool]  # each layer's RoPE table: the global one, else the local (sliding) one
    scale: float
    eps: float
    heads: tuple[int, int, int]  # (Hq, Hkv, D)
    # each linear's (in LINEARS' order) piece_columns, worked out once: ~70 us of Python a step
    # where each pass did it
    columns: tuple[tuple[tuple[str, int, int], ...], ...] = ()


def piece_columns(cfg: Any, fused: str) -> tuple[tuple[str, int, int], ...]:
    """Each target of the fused projection `fused` (qkv, gate_up, ...) with its columns in the fused
    output, in column order: (target, first column, end column). The one place that order is written:
    the autograd path (MicroLora.pieces) and the one-call layers (WholePlan.columns) add the pieces in
    it, and their results are compared (tests/unit/test_learning_whole.py)."""
    out, lo = [], 0
    for t in FUSED[fused]:
        hi = lo + projection_shape(cfg, t)[1]
        out.append((t, lo, hi))
        lo = hi
    return tuple(out)


def whole_plan(model: LlamaForCausalLM, layers: list[int], transposed: dict[int, Any]) -> WholePlan | None:
    """The plan for `layers` of `model` (`transposed`: each projection's 8-bit transposed copy by
    module id, LearnedLayers._transposed), or None where some piece has no C++ path here."""
    cfg = model.cfg
    if cfg.qk_norm:
        return None
    weights: list[torch.Tensor | None] = []
    kinds, groups, t_slots, t_groups = [], [], [], []
    for i in layers:
        layer = model.layers[i]
        if type(layer) is not DecoderLayer:  # a family's own layer (Gemma 3's post-norms, GELU)
            return None
        weights.append(layer.input_layernorm.weight.detach())
        for name in LINEARS:
            module = getattr(layer, f"{name}_proj", None)
            packed = getattr(module, "_kernel_weight", None) if isinstance(module, QuantLinear) else None
            if packed is None:
                return None
            bias = None if module.bias is None else module.bias.detach()
            weights += [packed.codes, packed.scales, packed.zeros, bias]
            kinds.append(INT4 if packed.int4 else INT8)
            groups.append(packed.group)
            wt = transposed.get(id(module))
            t_slots += [None, None, None] if wt is None else [wt.codes, wt.scales, wt.zeros]
            t_groups.append(0 if wt is None else wt.group)
            assert wt is None or not wt.int4, "the transposed copies are 8-bit (transposed_q8)"
            if name == "o":
                weights.append(getattr(layer, DecoderLayer.MLP_NORM).weight.detach())
    return WholePlan(weights, kinds, groups, t_slots, t_groups, model.norm.weight.detach(),
                     [model.windows[i] or 0 for i in layers], [model.windows[i] is None for i in layers],
                     cfg.attention_scale, cfg.rms_norm_eps, (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim),
                     tuple(piece_columns(cfg, name) for name in LINEARS))


def lora_pieces(plan: WholePlan, layers: list[int], lora: Any) -> tuple[list[torch.Tensor], list[int]]:
    """The micro-LoRA's pieces in the order they are added (layer, linear, column), as
    MicroLora.pieces gives them: A and B each, and (layer's place among `layers`, linear's index in
    LINEARS, first column) each."""
    tensors: list[torch.Tensor] = []
    at: list[int] = []
    if lora is None:
        return tensors, at
    weights = lora.weights
    for li, i in enumerate(layers):
        for j, spans in enumerate(plan.columns):
            for t, lo, _ in spans:
                pair = weights.get((i, t))
                if pair is not None:
                    tensors += pair
                    at += [li, j, lo]
    return tensors, at


class WholeLayers(Function):
    """rows = the learned layers and the final norm over h, as one autograd node differentiable in
    the micro-LoRA's pieces (not in h). Old-style forward(ctx, ...), as the other nodes here."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, plan: WholePlan, ext: Any, cos: list[torch.Tensor],  # type: ignore[override]
                sin: list[torch.Tensor], context: list[torch.Tensor | None], scaling: float, at: list[int],
                *lora: torch.Tensor) -> torch.Tensor:
        kept = ext.learned_layers_forward(h, plan.weights, plan.kinds, plan.groups, plan.final_norm, cos, sin, context,
                                          plan.windows, list(lora), at, plan.scale, plan.eps, scaling, *plan.heads)
        ctx.kept, ctx.plan, ctx.ext = kept, plan, ext
        ctx.rope, ctx.context, ctx.scaling, ctx.at, ctx.lora = (cos, sin), context, scaling, at, lora
        return kept[0]

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple:  # type: ignore[override]
        plan = ctx.plan
        grads = ctx.ext.learned_layers_backward(
            dout.contiguous(), ctx.kept, plan.weights, plan.kinds, plan.groups, plan.transposed, plan.t_groups,
            plan.final_norm, *ctx.rope, ctx.context, plan.windows, [t.detach() for t in ctx.lora], ctx.at,
            plan.scale, plan.eps, ctx.scaling, *plan.heads)
        ctx.kept = None  # (the activations freed with the pass, not with the graph)
        return (None,) * 8 + tuple(grads)


def _call_args(model: LlamaForCausalLM, plan: WholePlan, layers: list[int], positions: torch.Tensor, lora: Any,
               contexts: list[list[tuple[torch.Tensor, torch.Tensor]] | None]) -> tuple:
    """(cos, sin, context, scaling, at, pieces' tensors): what both calls take beside the plan, for
    sequences whose rows' `positions` are concatenated, each with its context (None: none)."""
    glob = model.rope.for_positions(positions)
    local = glob if model.local_rope is model.rope else model.local_rope.for_positions(positions)
    ropes = [glob if g else local for g in plan.global_rope]
    cos = [r[0].contiguous() for r in ropes]
    sin = [r[1].contiguous() for r in ropes]
    kv: list[torch.Tensor | None] = []  # (layer, sequence)'s K/V, layer-major (learned_layers.cpp)
    for i in range(len(layers)):
        for context in contexts:
            kv += [None, None] if context is None else [context[i][0].contiguous(), context[i][1].contiguous()]
    tensors, at = lora_pieces(plan, layers, lora)
    return cos, sin, kv, 1.0 if lora is None else lora.scaling, at, tensors


def whole_forward(model: LlamaForCausalLM, plan: WholePlan, ext: Any, layers: list[int], h: torch.Tensor,
                  positions: torch.Tensor, lora: Any, context: list[tuple[torch.Tensor, torch.Tensor]] | None
                  ) -> torch.Tensor:
    """The final-normed rows [T, H] of one sequence's rows h [T, H] entering `layers` at `positions`,
    `context` each layer's kept K/V of the positions before (not learned through)."""
    cos, sin, kv, scaling, at, tensors = _call_args(model, plan, layers, positions, lora, [context])
    return WholeLayers.apply(h.contiguous(), plan, ext, cos, sin, kv, scaling, at, *tensors)


class WholePass:
    """The same two calls without autograd (issue 37 item 1, session 20): `rows` after the forward,
    `backward(drows)` the micro-LoRA pieces' gradients, each with its parameter. For a step whose
    loss is also one call (InstantLearner.step's default: instant.py), so that no graph is made at
    all; WholeLayers stays the node for everything else.

    Several sequences (session 21): `hs`, `positions` and `contexts` one a sequence, their rows
    concatenated in `rows` (split them by `sizes`); `after`, one a sequence, -1 or an earlier sequence
    (after none, without a context) whose rows of this pass it continues, attending to their K/V and
    learning through them (the KL term's completions after their shared start: anchor.py). A
    sequence's rows are bitwise those of a pass of it alone (learned_layers.cpp)."""

    def __init__(self, model: LlamaForCausalLM, plan: WholePlan, ext: Any, layers: list[int], hs: list[torch.Tensor],
                 positions: list[torch.Tensor], lora: Any,
                 contexts: list[list[tuple[torch.Tensor, torch.Tensor]] | None], after: list[int] | None = None) -> None:
        self.plan, self.ext = plan, ext
        self.sizes = [len(h) for h in hs]
        # one sequence: the call's one-sequence form (sizes and after empty), as session 20 made it
        self.seqs = ([], []) if len(hs) == 1 else (self.sizes, list(after or [-1] * len(hs)))
        self.cos, self.sin, self.kv, self.scaling, self.at, self.params = _call_args(
            model, plan, layers, positions[0] if len(hs) == 1 else torch.cat(positions), lora, contexts)
        self.lora = [t.detach() for t in self.params]
        h = hs[0].detach().contiguous() if len(hs) == 1 else torch.cat([h.detach() for h in hs])
        self.kept = ext.learned_layers_forward(h, plan.weights, plan.kinds, plan.groups, plan.final_norm, self.cos,
                                               self.sin, self.kv, plan.windows, self.lora, self.at, plan.scale,
                                               plan.eps, self.scaling, *plan.heads, *self.seqs)
        self.rows = self.kept[0]

    def backward(self, drows: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        plan = self.plan
        grads = self.ext.learned_layers_backward(
            drows.contiguous(), self.kept, plan.weights, plan.kinds, plan.groups, plan.transposed, plan.t_groups,
            plan.final_norm, self.cos, self.sin, self.kv, plan.windows, self.lora, self.at, plan.scale, plan.eps,
            self.scaling, *plan.heads, *self.seqs)
        self.kept = None
        return list(zip(self.params, grads))
