"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) over a flat batch and a paged KV cache.

Tokens of all sequences in a step are one flat [T] batch; attention metadata tells each layer which
cache slots to write and which keys each query row may see.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ruvllm.attention.backend import AttentionBackend
from ruvllm.attention.metadata import AttentionMetadata
from ruvllm.config import ModelConfig
from ruvllm.errors import CorruptModelError
from ruvllm.layers.rotary import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # q, k and v (and gate and up) fused: one matmul instead of three (two) per layer.
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                attn: AttentionBackend) -> torch.Tensor:
        cfg = self.cfg
        h = self.input_layernorm(x)
        q, k, v = self.qkv_proj(h).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(-1, cfg.num_heads, cfg.head_dim)
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = RotaryEmbedding.apply(q, k, cos_sin)
        o = attn.forward(q, k, v.contiguous(), kv_cache[0], kv_cache[1], meta, cfg.head_dim ** -0.5)
        x = x + self.o_proj(o.reshape(-1, cfg.q_size))
        h = self.post_attention_layernorm(x)
        gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = rope

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                attn: AttentionBackend) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos_sin = self.rope.for_positions(positions)
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(x, cos_sin, kv, meta, attn)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight
        return F.linear(hidden, weight)

    # --- weights -------------------------------------------------------------------------------
    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
        """Copy Hugging Face-named tensors into our (fused) parameters; every parameter must be set."""
        cfg = self.cfg
        fused = {  # HF projection -> (our parameter, row offset)
            "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", cfg.q_size),
            "v_proj": ("qkv_proj", cfg.q_size + cfg.kv_size),
            "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", cfg.intermediate_size),
        }
        params = dict(self.named_parameters())
        filled: dict[str, int] = {}
        for name, tensor in weights:
            if name.startswith("model."):
                name = name[len("model."):]
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            if "rotary_emb" in name:
                continue
            parts = name.split(".")
            if len(parts) >= 5 and parts[0] == "layers" and parts[3] in fused:
                target, offset = fused[parts[3]]
                pname = f"layers.{parts[1]}.{target}.{parts[4]}"
            else:
                pname = ".".join(p for p in parts if p not in ("self_attn", "mlp"))
                offset = None
            param = params.get(pname)
            if param is None:
                raise CorruptModelError(f"{source}: unexpected tensor {name!r}")
            dest = param.data if offset is None else param.data[offset:offset + tensor.shape[0]]
            if dest.shape != tensor.shape:
                raise CorruptModelError(
                    f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
            dest.copy_(tensor)
            filled[pname] = filled.get(pname, 0) + tensor.numel()
        missing = [n for n, p in params.items() if filled.get(n, 0) != p.numel()]
        if missing:
            raise CorruptModelError(f"{source}: missing or incomplete tensors: {', '.join(missing[:5])}")
