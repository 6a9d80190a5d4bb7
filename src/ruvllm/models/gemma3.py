"""Gemma 3 (text): the Llama-shaped decoder with Gemma's differences, over the same flat batch and
paged KV cache.

What differs from Llama (docs/gemma3.md): embeddings scaled by sqrt(hidden); a norm before *and*
after attention and the MLP ("sandwich" norms), added to the residual only after the post-norm;
RMSNorm weights used as (1 + w); q/k RMSNorm; a GeGLU MLP (tanh GELU on the gate); attention scaled
by query_pre_attn_scalar**-0.5; most layers attend through a sliding window with their own RoPE
base, every sixth globally. The window is the attention backend's business (each layer reads its
KV group's metadata: kv_groups.py), so this file only routes each layer to its group.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ruvllm.attention.backend import AttentionBackend
from ruvllm.attention.metadata import AttentionMetadata
from ruvllm.config import ModelConfig
from ruvllm.errors import AdapterError
from ruvllm.kv_groups import kv_layout
from ruvllm.layers.ops import LayerOps
from ruvllm.layers.rotary import RotaryEmbedding
from ruvllm.models.llama import DecoderLayer, LlamaForCausalLM, RMSNorm
from ruvllm.quant.plan import Weight

if TYPE_CHECKING:
    from ruvllm.lora.batch import LoraBatch, XLoraBatch
    from ruvllm.models.weight_plan import WeightPlan


class Gemma3DecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, ops: LayerOps) -> None:
        super().__init__(cfg, ops)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def mlp(self, h: torch.Tensor, lora: object = None) -> torch.Tensor:
        gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Norm weights are held as the multiplier (1 + w): Hugging Face-named weights arrive as w
    (a GGUF's, which llama.cpp stores as 1 + w, are turned back by the loader, as transformers does)."""

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, ops: LayerOps | None = None,
                 local_rope: RotaryEmbedding | None = None) -> None:
        super().__init__(cfg, rope, ops)
        self.layers = torch.nn.ModuleList(Gemma3DecoderLayer(cfg, self.ops) for _ in range(cfg.num_layers))
        self.local_rope = local_rope or rope
        layout = kv_layout(cfg)
        self.kv_group = [layout.place(i)[0] for i in range(cfg.num_layers)]
        self.sliding = [i in cfg.sliding_layers and cfg.sliding_window is not None for i in range(cfg.num_layers)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple], meta: AttentionMetadata,
                attn: AttentionBackend, lora: LoraBatch | XLoraBatch | None = None) -> torch.Tensor:
        if lora is not None:
            raise AdapterError("LoRA adapters are not supported on Gemma 3 models")
        cfg, ops, eps = self.cfg, self.ops, self.cfg.rms_norm_eps
        x = self.embed_tokens(input_ids)
        # transformers casts the scale to the weights' dtype first (25.25 in bf16, not 25.298)
        x = x * torch.tensor(math.sqrt(cfg.hidden_size), dtype=x.dtype)
        ropes = (self.rope.for_positions(positions), self.local_rope.for_positions(positions))
        metas = meta.by_group or [meta]
        scale = cfg.attention_scale
        for i, (layer, (k_cache, v_cache, *cold)) in enumerate(zip(self.layers, kv_caches)):
            cos, sin = ropes[self.sliding[i]]
            q, k, v = layer.qkv(ops.rms_norm(x, layer.input_layernorm.weight, eps), cos, sin)
            o = attn.forward(q, k, v, k_cache, v_cache, metas[self.kv_group[i]], scale, *cold)
            x = x + ops.rms_norm(layer.o(o), layer.post_attention_layernorm.weight, eps)
            h = layer.mlp(ops.rms_norm(x, layer.pre_feedforward_layernorm.weight, eps))
            x = x + ops.rms_norm(h, layer.post_feedforward_layernorm.weight, eps)
        return ops.rms_norm(x, self.norm.weight, eps)

    def _layer_loop(self) -> None:
        return None  # the C++ layer loop is Llama's layer

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, Weight]], plan: WeightPlan, device: torch.device) -> None:
        super().load_weights(weights, plan, device)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.add_(1.0)
