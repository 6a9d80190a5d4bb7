"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) over a flat batch and a paged KV cache.

Tokens of all sequences in a step are one flat [T] batch; attention metadata tells each layer which
cache slots to write and which keys each query row may see. The layer is defined once: the engine,
the learner (autograd) and AWQ/SmoothQuant calibration run it with their own `LayerRun`, and other
families override only what differs (models/gemma3.py; docs/architecture.md, "How to add a model
family"). The C++ loop (cpu_layer_loop.py) is this layer's fast path (and Gemma 3's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ruvllm.attention.backend import AttentionBackend
from ruvllm.attention.metadata import AttentionMetadata
from ruvllm.config import ModelConfig
from ruvllm.errors import CorruptModelError
from ruvllm.kv_groups import kv_layout
from ruvllm.layers.dense import DenseLinear, dense_linear
from ruvllm.layers.ops import LayerOps, torch_ops
from ruvllm.layers.rotary import RotaryEmbedding
from ruvllm.models.cpu_layer_loop import CpuLayerLoop, LoopForm
from ruvllm.quant.linear import QuantLinear
from ruvllm.quant.plan import Weight, fuse_pieces, realize, stored_form
from ruvllm.quant.weights import QuantizedWeight

if TYPE_CHECKING:
    from ruvllm.lora.batch import LoraBatch, XLoraBatch
    from ruvllm.models.weight_plan import WeightPlan

@dataclass(frozen=True)
class LayerRun:
    """How a layer's pieces run in one pass: the ops (layers/ops.py); attend(layer, q [T, Hq, D], k, v
    [T, Hkv, D]) -> [T, Hq, D] (the paged cache's, or dense_run's); lora(layer, fused projection "qkv",
    "o", "gate_up" or "down", its input, its output) -> the output with adapter deltas (the engine's
    per-row adapters, the learner's micro-LoRA); linear(module, x): the module's call (our kernels,
    forward hooks) or, for autograd, F.linear of its weight."""

    ops: LayerOps
    attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    lora: Callable[[int, str, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    linear: Callable[[nn.Module, torch.Tensor], torch.Tensor] = nn.Module.__call__


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None = None,
                     sequences: int = 1, context: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Attention without a cache: q [N*T, Hq, D] and k, v [N*T, Hkv, D] hold N sequences of T
    positions end to end; each query sees its sequence's keys up to its own position (the last
    `window` of them with a window). `context`: K/V of the positions before (one sequence), seen too."""
    if context is not None:
        k, v = torch.cat([context[0], k]), torch.cat([context[1], v])
    t, s = q.shape[0] // sequences, k.shape[0] // sequences
    query, key = torch.arange(s - t, s)[:, None], torch.arange(s)
    mask = (key <= query) & (key > query - (window or s))

    def heads(x: torch.Tensor) -> torch.Tensor:  # [N*T, h, D] -> [N, h, T, D]
        return x.reshape(sequences, -1, *x.shape[1:]).transpose(1, 2)

    o = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), attn_mask=mask, scale=scale, enable_gqa=True)
    return o.transpose(1, 2).reshape(q.shape)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class DecoderLayer(nn.Module):
    """The residual stream is carried beside each sublayer's output and added inside the next norm
    (one fused kernel): forward takes and returns that pair (residual None: x is the whole stream)."""

    MLP_NORM = "post_attention_layernorm"  # the norm whose output enters the MLP (AWQ folds into it)
    # How the C++ layer loop runs this layer (cpu_layer_loop.py). Read from each class's own
    # namespace, not inherited: a subclass that changes the layer runs the Python loop until it
    # declares its form (and the C++ loop is checked bitwise against the Python loop for it).
    LOOP_FORM = LoopForm()

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.cfg, self.index = cfg, index
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # q, k and v (and gate and up) fused: one matmul instead of three (two) per layer. Dense
        # weights compute each row the same at any batch size (layers/dense.py).
        self.qkv_proj = DenseLinear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = DenseLinear(cfg.q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_up_proj = DenseLinear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = DenseLinear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: tuple, run: LayerRun
                ) -> tuple[torch.Tensor, torch.Tensor]:
        eps = self.cfg.rms_norm_eps
        h, residual = run.ops.add_rms_norm(x, residual, self.input_layernorm.weight, eps)
        o = run.attend(self.index, *self.qkv(h, *rope, run)).reshape(-1, self.cfg.q_size)
        o = self.project("o_proj", "o", o, run)
        h, residual = run.ops.add_rms_norm(self.joining(o, "post_attention_layernorm", run), residual,
                                           getattr(self, self.MLP_NORM).weight, eps)
        return self.joining(self.mlp(h, run), "post_feedforward_layernorm", run), residual

    def joining(self, y: torch.Tensor, post_norm: str, run: LayerRun) -> torch.Tensor:
        """A sublayer's output as it joins the residual stream: as it is (Gemma 3 norms it first)."""
        return y

    def project(self, name: str, fused: str, x: torch.Tensor, run: LayerRun) -> torch.Tensor:
        y = run.linear(getattr(self, name), x)
        return y if run.lora is None else run.lora(self.index, fused, x, y)

    def qkv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, run: LayerRun
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fused q/k/v projection of the normed input, (q/k norm,) RoPE: q [T, Hq, D], k and v [T, Hkv, D]."""
        cfg, ops = self.cfg, run.ops
        qkv = self.project("qkv_proj", "qkv", h, run)
        if not cfg.qk_norm:
            return ops.qkv_rope(qkv, cos, sin, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        if ops.qk_norm_rope is not None:  # the norms and RoPE in one kernel (the C++ loop's)
            return ops.qk_norm_rope(qkv, self.q_norm.weight, self.k_norm.weight, cfg.rms_norm_eps, cos, sin,
                                    cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = ops.rms_norm(q.view(-1, cfg.num_heads, cfg.head_dim), self.q_norm.weight, cfg.rms_norm_eps)
        k = ops.rms_norm(k.view(-1, cfg.num_kv_heads, cfg.head_dim), self.k_norm.weight, cfg.rms_norm_eps)
        q, k = ops.rope(q, k, cos, sin)
        return q, k, v.reshape(-1, cfg.num_kv_heads, cfg.head_dim).contiguous()

    def mlp(self, h: torch.Tensor, run: LayerRun) -> torch.Tensor:
        a = self.act_and_mul(self.project("gate_up_proj", "gate_up", h, run), run)
        return self.project("down_proj", "down", a, run)

    def act_and_mul(self, gate_up: torch.Tensor, run: LayerRun) -> torch.Tensor:
        return run.ops.silu_and_mul(gate_up)


class LlamaForCausalLM(nn.Module):
    layer_class = DecoderLayer
    norm_offset = 0.0  # norm weights are held as the multiplier norm_offset + w (Gemma's 1 + w)

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, ops: LayerOps | None = None,
                 local_rope: RotaryEmbedding | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.ops = ops or torch_ops()
        # A table given, so nn.Embedding skips its random init: loading fills it, and on the meta
        # device that init (normal_) imports torch._dynamo, seconds of every fresh process's start-up.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(self.layer_class(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.tie_word_embeddings:
            self.lm_head = DenseLinear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope, self.local_rope = rope, local_rope or rope  # local: sliding-window layers' own base
        # Each layer's KV group, whose metadata it reads (kv_groups.py), and its window (None: global).
        layout = kv_layout(cfg)
        self.kv_group = [layout.place(i)[0] for i in range(cfg.num_layers)]
        self.windows = [layout.groups[g].window for g in self.kv_group]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple], meta: AttentionMetadata,
                attn: AttentionBackend, lora: LoraBatch | XLoraBatch | None = None) -> torch.Tensor:
        x = self.embed(input_ids)
        # A step with adapters takes the C++ loop only where their deltas run on our kernel too.
        loop = self._layer_loop() if lora is None or lora.in_layer_loop else None
        if loop is not None and loop.applies(x, kv_caches, meta, getattr(attn, "kernel", None)):
            return loop(x, *loop.rope_rows(self, positions), kv_caches, meta, self, lora)  # the same kernels
        metas, scale = meta.by_group or [meta], self.cfg.attention_scale

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            k_cache, v_cache, *cold = kv_caches[i]  # cold: a quantized tier's
            return attn.forward(q, k, v, k_cache, v_cache, metas[self.kv_group[i]], scale, *cold)

        run = LayerRun(self.ops, attend, None if lora is None else lora.add)
        return self.final_norm(*self.run_layers(x, positions, run), self.ops)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, run: LayerRun, first: int = 0,
                   last: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layers first..last-1 over the residual stream x at `positions`: (x, the residual beside it)."""
        residual, glob = None, self.rope.for_positions(positions)
        ropes = glob, glob if self.local_rope is self.rope else self.local_rope.for_positions(positions)
        for layer in self.layers[first:last]:
            x, residual = layer(x, residual, ropes[self.windows[layer.index] is not None], run)
        return x, residual

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor | None, ops: LayerOps) -> torch.Tensor:
        return ops.add_rms_norm(x, residual, self.norm.weight, self.cfg.rms_norm_eps)[0]

    def dense_run(self, ops: LayerOps, sequences: int = 1,
                  linear: Callable = nn.Module.__call__, context: dict[int, tuple] | None = None,
                  keep_kv: list | None = None) -> LayerRun:
        """A pass over whole sequences without a KV cache (the learner, calibration): causal attention
        at each layer's window over `sequences` of equal length laid end to end. context: per layer
        index, K/V of earlier positions; keep_kv: each layer's K/V appended to it, in layer order."""
        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if keep_kv is not None:
                keep_kv.append((k.detach(), v.detach()))
            return causal_attention(q, k, v, self.cfg.attention_scale, self.windows[i], sequences,
                                    None if context is None else context[i])
        return LayerRun(ops, attend, None, linear)

    def _layer_loop(self) -> CpuLayerLoop | None:
        """The C++ layer loop for this model's weights (models/cpu_layer_loop.py), built on first use;
        None where some piece has no C++ path here (a layer class without its own LOOP_FORM among them)."""
        if "_loop" not in self.__dict__:
            cpu = torch.device(self.norm.weight.device).type == "cpu"
            self.__dict__["_loop"] = CpuLayerLoop.build(self) if cpu else None
        return self.__dict__["_loop"]

    def invalidate_layer_loop(self) -> None:
        """Forget the C++ loop's view of the weights: after a module or parameter is replaced."""
        self.__dict__.pop("_loop", None)

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 (nn.Module's signature)
        self.invalidate_layer_loop()  # .to() and the like replace the tensors it holds
        return super()._apply(fn, recurse)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "lm_head"):
            return self.lm_head(hidden)
        return dense_linear(hidden, self.embed_tokens.weight)

    # --- weights -------------------------------------------------------------------------------
    def target(self, name: str) -> tuple[str, int | None, int]:
        """Our parameter for a Hugging Face tensor name, the row offset into it (fused q/k/v and
        gate/up), and the number of rows the tensor should have there (for fused pieces)."""
        cfg = self.cfg
        fused = {  # HF projection -> (our module, row offset, rows)
            "q_proj": ("qkv_proj", 0, cfg.q_size), "k_proj": ("qkv_proj", cfg.q_size, cfg.kv_size),
            "v_proj": ("qkv_proj", cfg.q_size + cfg.kv_size, cfg.kv_size),
            "gate_proj": ("gate_up_proj", 0, cfg.intermediate_size),
            "up_proj": ("gate_up_proj", cfg.intermediate_size, cfg.intermediate_size),
        }
        parts = name.split(".")
        if len(parts) >= 5 and parts[0] == "layers" and parts[3] in fused:
            target, offset, rows = fused[parts[3]]
            return f"layers.{parts[1]}.{target}.{parts[4]}", offset, rows
        return ".".join(p for p in parts if p not in ("self_attn", "mlp")), None, 0

    def load_weights(self, weights: Iterable[tuple[str, Weight]], plan: WeightPlan, device: torch.device) -> None:
        """Fill the (meta-device) model from Hugging Face-named tensors, fusing q/k/v and gate/up.

        Each parameter is materialized only when all its pieces have arrived, in the form `plan`
        gives it (models/weight_plan.py): a linear's weight dense or a QuantLinear, so a dense copy
        of a quantized model never exists.
        """
        cfg, source = self.cfg, plan.source
        expected = {n: tuple(p.shape) for n, p in self.named_parameters()}
        pending: dict[str, dict[int, Weight]] = {}
        done: set[str] = set()
        for name, tensor in weights:
            if name.startswith("model."):
                name = name[len("model."):]
            if (name == "lm_head.weight" and cfg.tie_word_embeddings) or "rotary_emb" in name:
                continue
            pname, offset, rows = self.target(name)
            if pname not in expected or pname in done:
                raise CorruptModelError(f"{source}: unexpected tensor {name!r}")
            want = expected[pname] if offset is None else (rows, *expected[pname][1:])
            if tuple(tensor.shape) != want:
                raise CorruptModelError(
                    f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {want}")
            pieces = pending.setdefault(pname, {})
            pieces[offset or 0] = tensor
            if sum(p.shape[0] for p in pieces.values()) == expected[pname][0]:
                del pending[pname]
                done.add(pname)
                ordered = [pieces[k] for k in sorted(pieces)]
                self._install(pname, ordered, plan, device)
        self.invalidate_layer_loop()
        missing = [n for n in expected if n not in done]
        if missing:
            raise CorruptModelError(f"{source}: missing or incomplete tensors: {', '.join(missing[:5])}")
        if not hasattr(self, "lm_head"):
            self._install_tied_head(self.embed_tokens.weight.data, plan, device)
        if self.norm_offset:  # Hugging Face-named norm weights arrive as w
            with torch.no_grad():
                for name, p in self.named_parameters():
                    if name.endswith("norm.weight"):
                        p.add_(self.norm_offset)

    def _install_tied_head(self, embeddings: Weight, plan: WeightPlan, device: torch.device) -> None:
        """A tied LM head's packed copy of the embeddings, where the plan has one: from the file's own
        codes when they arrive packed (a GGUF's Q8_0 table read as it is), else from the dense table."""
        head = plan.weights.get("lm_head.weight")
        if self.cfg.tie_word_embeddings and head is not None:
            form = realize(plan.quant, "lm_head", embeddings, head.form, plan.dtype)
            self.lm_head = QuantLinear(form.to(device), int8_activations=plan.quant.method == "w8a8")

    def _install(self, pname: str, pieces: list[Weight], plan: WeightPlan, device: torch.device) -> None:
        module_name, attr = pname.rsplit(".", 1)
        module = self.get_submodule(module_name)
        weight = fuse_pieces(pieces)
        planned = plan.weights[pname]
        if stored_form(weight) != planned.stored:  # the headers said one thing, the loader did another
            raise RuntimeError(f"{plan.source}: {pname} arrived as {stored_form(weight) or 'float'}, "
                               f"but the weight plan expected {planned.stored or 'float'}")
        dtype = plan.dtype
        if planned.linear:
            weight = realize(plan.quant, module_name, weight, planned.form, dtype)
            if isinstance(weight, QuantizedWeight):
                parent_name, _, child = module_name.rpartition(".")
                layer = QuantLinear(weight.to(device), module.bias, int8_activations=plan.quant.method == "w8a8")
                self.get_submodule(parent_name).register_module(child, layer)
                return
        elif isinstance(weight, QuantizedWeight):
            if pname == "embed_tokens.weight":
                self._install_tied_head(weight, plan, device)
            weight = weight.dequantize()
        setattr(module, attr, nn.Parameter(weight.to(device=device, dtype=dtype), requires_grad=False))
