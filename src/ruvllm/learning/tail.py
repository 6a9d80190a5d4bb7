"""The learner's view of the model: the layers below the learned ones run as inference (our own
layer code, no KV cache, causal attention over the one sequence), the last `n` layers run again in
PyTorch autograd with a micro-LoRA on chosen projections, so a gradient step touches only them (on
packed Llama layers one node of our C++ for all of them: learning/whole_layers.py).

The learner holds its own copy of the model, loaded as the engine serves it (load_learning_model):
packed weights stay packed (a GGUF's Q4_1 codes), and the learned layers run forward on the
engine's quantized matmul and backward through the same codes (learning/packed_linear.py), so no
float32 copy of them is made (docs/learning.md measures the memory and the time). Where our kernels
cannot build, or for float weights, it is float32 and F.linear, as before. The engine's KV cache
is its own: the learner attends over the one sequence without a cache.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ruvllm.config import ModelConfig, QuantConfig
from ruvllm.layers.ops import LayerOps, torch_ops
from ruvllm.learning.fused_ops import learner_ops
from ruvllm.learning.packed_linear import packed_linear, packed_lora_linear, transposed_q8
from ruvllm.learning.row_attention import row_attention
from ruvllm.learning.whole_layers import WholePass, piece_columns, whole_forward, whole_plan
from ruvllm.loader import ModelSource, iter_weights, load_model_config
from ruvllm.lora.peft_adapter import SUBLAYER, projection_shape
from ruvllm.lora.slots import FUSED
from ruvllm.models.llama import LayerRun, LlamaForCausalLM, causal_attention
from ruvllm.quant.linear import QuantLinear

log = logging.getLogger(__name__)


def load_learning_model(src: ModelSource, packed: bool = True) -> tuple[LlamaForCausalLM, ModelConfig]:
    """The learner's model of `src`, in float32 compute: its weights as the engine's default
    quantization ("auto") holds them on this CPU (a GGUF's 4- and 8-bit codes packed, float weights
    dense), or with `packed` False (or where our kernels cannot build) every weight dense in float32."""
    from ruvllm.cpu_build import kernels
    from ruvllm.models.registry import build_model
    from ruvllm.models.weight_plan import weight_plan
    from ruvllm.quantize.awq_writer import load_float_model

    cfg = load_model_config(src)
    if not packed or kernels() is None:
        model, cfg, _ = load_float_model(src, cfg.max_position_embeddings)
        return model, cfg
    plan = weight_plan(src, QuantConfig(), torch.float32, torch.device("cpu"))
    model = build_model(cfg, iter_weights(src, plan.dtype, keep_quantized=plan.keep_packed), str(src.path),
                        max(2, cfg.max_position_embeddings), plan.dtype, "cpu", plan=plan)
    if any(isinstance(m, QuantLinear) and m._kernel_weight is None for m in model.layers.modules()):
        # a packed layer our kernel cannot run (a shape it does not tile) has no backward here
        del model
        model, cfg, _ = load_float_model(src, cfg.max_position_embeddings)
    return model, cfg


@torch.inference_mode()
def hidden_before(model: LlamaForCausalLM, token_ids: list[int], layer: int) -> torch.Tensor:
    """The residual stream entering decoder layer `layer` for a whole sequence: [T, H] float32."""
    ids = torch.tensor(token_ids, dtype=torch.long)
    x, residual = model.run_layers(model.embed(ids), torch.arange(len(ids)), model.dense_run(model.ops), 0, layer)
    return (x if residual is None else residual + x).float().clone()


@dataclass
class MicroLora:
    """Rank-r A and B for each (layer, target) of the learned layers, float32 with gradients.
    Initialized as peft does: A Kaiming-uniform, B zero (the adapter starts as a no-op)."""

    rank: int
    alpha: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @classmethod
    def create(cls, cfg: ModelConfig, layers: list[int], targets: tuple[str, ...], rank: int, alpha: float,
               seed: int) -> MicroLora:
        g = torch.Generator().manual_seed(seed)
        weights = {}
        for layer in layers:
            for t in targets:
                k, n = projection_shape(cfg, t)
                bound = 1 / math.sqrt(k)
                a = (torch.rand(rank, k, generator=g) * 2 - 1) * bound
                weights[(layer, t)] = (a.requires_grad_(), torch.zeros(n, rank, requires_grad=True))
        return cls(rank, alpha, weights)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def parameters(self) -> list[torch.Tensor]:
        return [t for pair in self.weights.values() for t in pair]

    def base_point(self) -> list[torch.Tensor]:
        """The parameters (in `parameters()` order) nearest these at which the adapter is a no-op, the
        base model's behaviour: A as it is, B zero. EWC++ anchors here."""
        return [t.detach().clone() if i % 2 == 0 else torch.zeros_like(t) for i, t in enumerate(self.parameters())]

    def pieces(self, cfg: ModelConfig, layer: int, fused: str) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """The learned pieces of `layer`'s fused projection `fused` (qkv, gate_up, ...), in column
        order: (first column, end column, A, B) each. The autograd path and the one-call layers
        (whole_layers.py) add them in this order."""
        out = []
        for t, lo, hi in piece_columns(cfg, fused):
            pair = self.weights.get((layer, t))
            if pair is not None:
                out.append((lo, hi, *pair))
        return out

    def delta(self, layer: int, target: str, x: torch.Tensor) -> torch.Tensor | None:
        pair = self.weights.get((layer, target))
        if pair is None:
            return None
        a, b = pair
        return ((x @ a.t()) * self.scaling) @ b.t()  # (scaled at rank r: a [T, r] product, not [T, n])

    def copy(self) -> MicroLora:
        """A detached copy of the weights, with gradients of its own (a term computed off the
        feedback's path on it never touches the tenant's)."""
        return MicroLora(self.rank, self.alpha, {
            key: (a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_())
            for key, (a, b) in self.weights.items()})

    def load_peft_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take the weights of a version written by peft_tensors (learning continues from them)."""
        with torch.no_grad():
            for (layer, t), (a, b) in self.weights.items():
                prefix = f"base_model.model.model.layers.{layer}.{SUBLAYER[t]}.{t}"
                a.copy_(tensors[f"{prefix}.lora_A.weight"])
                b.copy_(tensors[f"{prefix}.lora_B.weight"])

    def peft_tensors(self) -> dict[str, torch.Tensor]:
        """PEFT's tensor names (lora_A / lora_B, the scaling left to the config's alpha)."""
        out = {}
        for (layer, t), (a, b) in self.weights.items():
            prefix = f"base_model.model.model.layers.{layer}.{SUBLAYER[t]}.{t}"
            out[f"{prefix}.lora_A.weight"] = a.detach().clone().contiguous()
            out[f"{prefix}.lora_B.weight"] = b.detach().clone().contiguous()
        return out


class LearnedLayers:
    """The last `n` decoder layers, the final norm and the output embedding, run with autograd in
    float32 over hidden states entering the first of them (packed weights stay packed)."""

    def __init__(self, model: LlamaForCausalLM, n: int, backward: str = "int8", ops: LayerOps | None = None,
                 whole: bool = True) -> None:
        """`backward` ("int8" or "float32"): how the input gradient runs through packed weights, the
        engine's integer kernel over a transposed 8-bit copy of each learned projection made here
        (packed_linear.transposed_q8: one byte a weight, ~15 MB on the default model), or the float32
        kernel over the served codes (no copy). Float weights: F.linear's backward either way.
        `ops`: the layers' element-wise ops; default our kernels as one autograd node each
        (learning/fused_ops.py) where they build, else the torch reference (layers/ops.py).
        `whole`: with the default ops, a pass over one sequence runs every learned layer as one C++
        call each way where they apply (learning/whole_layers.py; False: the autograd path, its
        reference, always)."""
        from ruvllm.cpu_build import kernels

        cfg = model.cfg
        ext = kernels() if ops is None else None
        self.ops = ops or (torch_ops() if ext is None else learner_ops(ext))
        # with the learner ops, attention too is one node of our C++ (learning/row_attention.py)
        self._ext = ext
        self.cfg = cfg
        self.model = model
        self.first = cfg.num_layers - n
        self.layers = list(range(self.first, cfg.num_layers))
        self.head = _head(model)
        # each learned layer's projection modules -> (layer, fused projection name): the linear hook
        # (_linear_for) finds a projection's micro-LoRA pieces by the module it is called with
        self._projections = {id(module): (i, fused) for i in self.layers for fused in FUSED
                             if (module := getattr(model.layers[i], f"{fused}_proj", None)) is not None}
        self._transposed = self._transpose_all() if backward == "int8" else {}
        self._whole = whole_plan(model, self.layers, self._transposed) if whole and ext is not None else None

    def forward(self, h: torch.Tensor, positions: torch.Tensor, lora: MicroLora | None,
                context: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                keep_kv: list | None = None, keep_from: int = 0) -> torch.Tensor:
        """The final-normed hidden states [T, H] of rows entering the learned layers as h [T, H], at
        `positions`; `context`: each learned layer's K/V of earlier positions (not learned through).
        With `keep_kv` (a list), each layer's K/V of these rows is appended to it. The model's own
        layers, in plain torch ops and F.linear (which autograd differentiates). `keep_from`: only
        rows from it on are returned, [T - keep_from, H], and the last layer computes no more of
        the rows before than their K/V (learned through). Several sequences at once: forward_many."""
        cfg = self.cfg
        # one sequence whose rows all return: every learned layer one C++ call each way (no graph);
        # the call gives no gradient of h, and the full context's skipped rows keep the graph
        whole = self._whole is not None and keep_kv is None  # (a plan is made only where the kernels built)
        if whole and (keep_from <= 0 or context is not None) and not h.requires_grad:
            return whole_forward(self.model, self._whole, self._ext, self.layers, h, positions, lora, context)
        model, linear = self.model, self._linear_for(lora)
        run = self._run(linear, None if context is None else dict(zip(self.layers, context)), keep_kv)
        if keep_from <= 0 or keep_kv is not None or context is not None:
            return model.final_norm(*model.run_layers(h, positions, run, self.first), run.ops)
        # The full context's step reads only the target's rows: in the last layer the prompt's rows
        # need their K/V alone, not the attention output, o_proj and MLP (~15% of the step's matmuls).
        last = cfg.num_layers - 1
        x, residual = model.run_layers(h, positions, run, self.first, last)
        layer, ops = model.layers[last], run.ops
        rope = model.rope if model.windows[last] is None else model.local_rope
        before = ops.add_rms_norm(x[:keep_from], None if residual is None else residual[:keep_from],
                                  layer.input_layernorm.weight, cfg.rms_norm_eps)[0]
        _, k, v = layer.qkv(before, *rope.for_positions(positions[:keep_from]), run)
        tail_run = self._run(linear, {last: (k, v)})
        x, residual = layer(x[keep_from:], None if residual is None else residual[keep_from:],
                            rope.for_positions(positions[keep_from:]), tail_run)
        return model.final_norm(x, residual, ops)

    def whole_pass(self, h: torch.Tensor, positions: torch.Tensor, lora: MicroLora | None,
                   context: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> WholePass | None:
        """`forward`'s rows of one sequence (all of them) as the learned layers' C++ calls without
        autograd, with their backward to call by hand (whole_layers.WholePass), where those calls
        apply (as in `forward`); else None."""
        return self.whole_pass_many([h], [positions], lora, [context])

    def whole_pass_many(self, hs: list[torch.Tensor], positions: list[torch.Tensor], lora: MicroLora | None,
                        contexts: list[list[tuple[torch.Tensor, torch.Tensor]] | None],
                        after: list[int] | None = None) -> WholePass | None:
        """`forward_many`'s rows of several sequences (each with its positions and context; `after`:
        each -1 or the earlier sequence whose rows of this pass it continues, as `shared_prefix` does)
        as the learned layers' C++ calls without autograd, their rows concatenated (whole_layers.
        WholePass, issue 37 item 3, session 21), where those calls apply; else None."""
        if self._whole is None or any(h.requires_grad for h in hs):
            return None
        return WholePass(self.model, self._whole, self._ext, self.layers, hs, positions, lora, contexts, after)

    def forward_many(self, hs: list[torch.Tensor], positions: list[torch.Tensor], lora: MicroLora | None,
                     contexts: list[list[tuple[torch.Tensor, torch.Tensor]] | None],
                     shared_prefix: bool = False) -> list[torch.Tensor]:
        """`forward` of several sequences at once, each with its own context (None: none) and
        positions: their rows go through every projection as one batch (each weight read once for
        all, one kernel call instead of one a sequence), each attends to its own context and earlier
        rows alone. With `shared_prefix`, the first sequence is a prefix every other one continues
        (their contexts None): at each layer they attend to its rows' K/V, as computed in this pass
        (learned through), before their own. Returns each sequence's final-normed rows. (What a
        backlog's frozen-context events and the KL term's completions need: issue 37 items 1 and 3.)"""
        model, sizes, ext = self.model, [len(h) for h in hs], self._ext
        scale = self.cfg.attention_scale

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            layer, outs = i - self.first, []
            parts = list(zip(q.split(sizes), k.split(sizes), v.split(sizes), contexts))
            for j, (qs, ks, vs, ctx) in enumerate(parts):
                before = (parts[0][1], parts[0][2]) if shared_prefix and j else None if ctx is None else ctx[layer]
                # our C++ node where the learner ops run, as a one-sequence pass (_run) attends: the
                # rows are then bitwise those of the graphless pass (whole_pass_many, session 21)
                outs.append(causal_attention(qs, ks, vs, scale, model.windows[i], 1, before) if ext is None
                            else row_attention(qs, ks, vs, scale, model.windows[i], before, ext))
            return torch.cat(outs)

        run = LayerRun(self.ops, attend, None, self._linear_for(lora))
        out = model.final_norm(*model.run_layers(torch.cat(hs), torch.cat(positions), run, self.first), run.ops)
        return list(out.split(sizes))

    def _run(self, linear, context: dict[int, tuple] | None, keep_kv: list | None = None) -> LayerRun:  # noqa: ANN001
        """A pass over one sequence (model.dense_run's), its attention one node of our C++ where the
        learner ops run (learning/row_attention.py), else causal_attention's torch ops."""
        model, ext = self.model, self._ext
        if ext is None or keep_kv is not None:
            return model.dense_run(self.ops, linear=linear, context=context, keep_kv=keep_kv)
        scale = self.cfg.attention_scale

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return row_attention(q, k, v, scale, model.windows[i], None if context is None else context[i], ext)
        return LayerRun(self.ops, attend, None, linear)

    def _transpose_all(self) -> dict[int, object]:
        """Each learned packed projection's transposed 8-bit copy, by module id; none for the first
        learned layer's q/k/v, whose input (from the frozen layers) never takes a gradient, nor for a
        shape the 8-bit blocks do not tile (its backward keeps the float32 kernel)."""
        out = {}
        for module_id, (layer, fused) in self._projections.items():
            module = getattr(self.model.layers[layer], f"{fused}_proj")
            packed = getattr(module, "_kernel_weight", None) if isinstance(module, QuantLinear) else None
            if packed is None or (layer == self.first and fused == "qkv"):
                continue
            try:
                out[module_id] = transposed_q8(packed)
            except (AssertionError, RuntimeError, ValueError) as exc:  # said, not silent: it is slower
                log.info("layer %d %s_proj: no 8-bit transposed copy (%s); its backward keeps the float32 kernel",
                         layer, fused, exc)
        return out

    def _linear_for(self, lora: MicroLora | None):  # noqa: ANN202
        """The LayerRun's `linear` hook: a projection's output with the micro-LoRA's deltas on its
        learned pieces (q, k, v of the fused qkv; gate, up). On packed weights one autograd node
        does both (packed_linear.PackedLoraMatmul); on float weights F.linear, then each learned
        piece's delta added where it lies (no split and concatenation of the whole output)."""
        cfg, transposed = self.cfg, self._transposed
        # each projection's learned pieces found once for the pass, not at each of its calls
        by_module = {} if lora is None else {mid: lora.pieces(cfg, *where) for mid, where in self._projections.items()}

        def linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
            learned = by_module.get(id(module), [])
            packed = getattr(module, "_kernel_weight", None) if isinstance(module, QuantLinear) else None
            if packed is not None:  # the served codes, forward and backward (learning/packed_linear.py)
                wt = transposed.get(id(module))
                if learned:
                    return packed_lora_linear(x, packed, module.bias, lora.scaling, learned, wt)
                return packed_linear(x, packed, module.bias, wt)
            y = F.linear(x, module.weight, module.bias)
            for lo, hi, a, b in learned:
                delta = ((x @ a.t()) * lora.scaling) @ b.t()  # (scaled at rank r: a [T, r] product)
                y = y + F.pad(delta, (lo, y.shape[-1] - hi))
            return y
        return linear


def _head(model: LlamaForCausalLM) -> torch.Tensor:
    """The output embedding [V, H] in float32, for the (sampled) softmax's rows: the dense table of a
    tied head (its packed copy serves the engine's logits), a packed head's weights read back
    through the head itself (one pass over identity rows, whose 8-bit rounding is exact)."""
    if model.cfg.tie_word_embeddings or not hasattr(model, "lm_head"):
        return model.embed_tokens.weight.detach().float()
    head = model.lm_head
    if isinstance(head, QuantLinear):
        with torch.no_grad():
            return head(torch.eye(head.in_features)).t().contiguous()
    return head.weight.detach().float()
