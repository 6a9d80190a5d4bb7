"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) over a flat batch and a paged KV cache.

Tokens of all sequences in a step are one flat [T] batch; attention metadata tells each layer which
cache slots to write and which keys each query row may see.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ruvllm.attention.backend import AttentionBackend
from ruvllm.attention.metadata import AttentionMetadata
from ruvllm.config import ModelConfig
from ruvllm.errors import CorruptModelError
from ruvllm.layers.dense import DenseLinear, dense_linear
from ruvllm.layers.ops import LayerOps, torch_ops
from ruvllm.layers.rotary import RotaryEmbedding
from ruvllm.models.cpu_layer_loop import CpuLayerLoop
from ruvllm.quant.linear import QuantLinear
from ruvllm.quant.plan import Weight, fuse_pieces, realize, stored_form
from ruvllm.quant.weights import QuantizedWeight

if TYPE_CHECKING:
    from ruvllm.lora.batch import LoraBatch, XLoraBatch
    from ruvllm.models.weight_plan import WeightPlan

# A layer's adapters for one step: (fused projection name, its input, its base output) -> the output
# with each row's adapter delta added (ruvllm/lora/batch.py).
LayerLora = Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: LayerOps) -> None:
        super().__init__()
        self.cfg = cfg
        self.ops = ops
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

    def qkv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lora: LayerLora | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fused q/k/v projection of the normed input, (q/k norm,) RoPE: q [T, Hq, D], k and v [T, Hkv, D]."""
        cfg, ops = self.cfg, self.ops
        qkv = self.qkv_proj(h)
        if lora is not None:
            qkv = lora("qkv", h, qkv)
        if not cfg.qk_norm:
            return ops.qkv_rope(qkv, cos, sin, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = ops.rms_norm(q.view(-1, cfg.num_heads, cfg.head_dim), self.q_norm.weight, cfg.rms_norm_eps)
        k = ops.rms_norm(k.view(-1, cfg.num_kv_heads, cfg.head_dim), self.k_norm.weight, cfg.rms_norm_eps)
        q, k = ops.rope(q, k, cos, sin)
        return q, k, v.reshape(-1, cfg.num_kv_heads, cfg.head_dim).contiguous()

    def mlp(self, h: torch.Tensor, lora: LayerLora | None = None) -> torch.Tensor:
        if lora is None:
            return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(h)))
        a = self.ops.silu_and_mul(lora("gate_up", h, self.gate_up_proj(h)))
        return lora("down", a, self.down_proj(a))

    def o(self, o: torch.Tensor, lora: LayerLora | None = None) -> torch.Tensor:
        """The output projection of the attention output o [T, Hq, D]."""
        o = o.reshape(-1, self.cfg.q_size)
        return self.o_proj(o) if lora is None else lora("o", o, self.o_proj(o))

    def attention_inputs(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's first half from its input x: norm, then qkv()."""
        return self.qkv(self.ops.rms_norm(x, self.input_layernorm.weight, self.cfg.rms_norm_eps), cos, sin)

    def attention_output_and_mlp(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """The layer's second half: the layer's output from its input x and the attention output o."""
        h, x = self.ops.add_rms_norm(self.o_proj(o.reshape(-1, self.cfg.q_size)), x,
                                     self.post_attention_layernorm.weight, self.cfg.rms_norm_eps)
        return x + self.mlp(h)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, ops: LayerOps | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.ops = ops = ops or torch_ops()
        # A table given, so nn.Embedding skips its random init: loading fills it, and on the meta
        # device that init (normal_) imports torch._dynamo, seconds of every fresh process's start-up.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, ops) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.tie_word_embeddings:
            self.lm_head = DenseLinear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = rope

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple], meta: AttentionMetadata,
                attn: AttentionBackend, lora: LoraBatch | XLoraBatch | None = None) -> torch.Tensor:
        # The residual stream is carried beside each sublayer's output and added inside the next
        # norm (one fused kernel on GPU); in the torch ops this is the same arithmetic as
        # attention_inputs / attention_output_and_mlp.
        ops, eps = self.ops, self.cfg.rms_norm_eps
        x = self.embed_tokens(input_ids)
        residual = None
        cos, sin = self.rope.for_positions(positions)
        # A step with adapters takes the C++ loop only where their deltas run on our kernel too.
        loop = self._layer_loop() if lora is None or lora.in_layer_loop else None
        if loop is not None and loop.applies(x, kv_caches, meta, getattr(attn, "kernel", None)):
            return loop(x, cos, sin, kv_caches, meta, self, lora)  # the same kernels, called from C++
        scale = self.cfg.head_dim ** -0.5
        for i, (layer, (k_cache, v_cache, *cold)) in enumerate(zip(self.layers, kv_caches)):  # cold: a quantized tier's
            layer_lora = None if lora is None else functools.partial(lora.add, i)
            h, residual = ops.add_rms_norm(x, residual, layer.input_layernorm.weight, eps)
            q, k, v = layer.qkv(h, cos, sin, layer_lora)
            o = attn.forward(q, k, v, k_cache, v_cache, meta, scale, *cold)
            h, residual = ops.add_rms_norm(layer.o(o, layer_lora), residual, layer.post_attention_layernorm.weight, eps)
            x = layer.mlp(h, layer_lora)
        return ops.add_rms_norm(x, residual, self.norm.weight, eps)[0]

    def _layer_loop(self) -> CpuLayerLoop | None:
        """The C++ layer loop for this model's weights (models/cpu_layer_loop.py), built on first use;
        None where some piece has no C++ path here."""
        if "_loop" not in self.__dict__:
            self.__dict__["_loop"] = CpuLayerLoop.build(self) if torch.device(self.norm.weight.device).type == "cpu" else None
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
