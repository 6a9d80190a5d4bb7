"""The learner's view of the model: the layers below the learned ones run as inference (our own
layer code, no KV cache, causal attention over the one sequence), the last `n` layers run again in
PyTorch autograd with a micro-LoRA on chosen projections, so a gradient step touches only them.

The learner holds its own float32 copy of the model (dequantized from whatever the file holds): the
served model's packed weights have no backward, and its KV cache belongs to the engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ruvllm.config import ModelConfig
from ruvllm.layers.rotary import _rotate
from ruvllm.lora.peft_adapter import SUBLAYER
from ruvllm.models.llama import LlamaForCausalLM

def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: tuple | None = None) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] of positions after `context` (k, v of earlier positions, or
    None): each query sees the context and the positions up to its own. Returns [T, Hq, D]."""
    if context is not None:
        k, v = torch.cat([context[0], k]), torch.cat([context[1], v])
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    T, S = q.shape[0], k.shape[0]
    mask = torch.ones(T, S, dtype=torch.bool).tril(S - T)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
    return out.transpose(0, 1)


@torch.inference_mode()
def hidden_before(model: LlamaForCausalLM, token_ids: list[int], layer: int) -> torch.Tensor:
    """The residual stream entering decoder layer `layer` for a whole sequence: [T, H] float32."""
    ids = torch.tensor(token_ids, dtype=torch.long)
    pos = torch.arange(len(token_ids))
    cos, sin = model.rope.for_positions(pos)
    x = model.embed_tokens(ids)
    for blk in model.layers[:layer]:
        q, k, v = blk.attention_inputs(x, cos, sin)
        x = blk.attention_output_and_mlp(x, causal_attention(q, k, v))
    return x.float().clone()


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
        from ruvllm.lora.peft_adapter import projection_shape

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

    def delta(self, layer: int, target: str, x: torch.Tensor) -> torch.Tensor | None:
        pair = self.weights.get((layer, target))
        if pair is None:
            return None
        a, b = pair
        return (x @ a.t()) @ b.t() * self.scaling

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
    """The last `n` decoder layers, the final norm and the output embedding, in float32, run with
    autograd over hidden states entering the first of them."""

    def __init__(self, model: LlamaForCausalLM, n: int) -> None:
        cfg = model.cfg
        self.cfg = cfg
        self.model = model
        self.first = cfg.num_layers - n
        self.layers = list(range(self.first, cfg.num_layers))
        self.head = (model.lm_head.weight if hasattr(model, "lm_head") else model.embed_tokens.weight).detach().float()

    def forward(self, h: torch.Tensor, positions: torch.Tensor, lora: MicroLora | None,
                context: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                keep_kv: list | None = None) -> torch.Tensor:
        """The final-normed hidden states [T, H] of rows entering the learned layers as h [T, H], at
        `positions`; `context`: each learned layer's K/V of earlier positions (not learned through).
        With `keep_kv` (a list), each layer's K/V of these rows is appended to it."""
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        cos, sin = self.model.rope.for_positions(positions)
        for i, li in enumerate(self.layers):
            blk = self.model.layers[li]
            x = F.rms_norm(h, (cfg.hidden_size,), blk.input_layernorm.weight, eps)
            qkv = x @ blk.qkv_proj.weight.t()
            if blk.qkv_proj.bias is not None:
                qkv = qkv + blk.qkv_proj.bias
            q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            if lora is not None:
                q, k, v = (_add(t, lora.delta(li, name, x)) for t, name in ((q, "q_proj"), (k, "k_proj"), (v, "v_proj")))
            q = q.reshape(-1, cfg.num_heads, cfg.head_dim)
            k = k.reshape(-1, cfg.num_kv_heads, cfg.head_dim)
            v = v.reshape(-1, cfg.num_kv_heads, cfg.head_dim)
            if cfg.qk_norm:
                q = F.rms_norm(q, (cfg.head_dim,), blk.q_norm.weight, eps)
                k = F.rms_norm(k, (cfg.head_dim,), blk.k_norm.weight, eps)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            if keep_kv is not None:
                keep_kv.append((k.detach(), v.detach()))
            o = causal_attention(q, k, v, None if context is None else context[i]).reshape(-1, cfg.q_size)
            attn = o @ blk.o_proj.weight.t()
            if lora is not None:
                attn = _add(attn, lora.delta(li, "o_proj", o))
            h = h + attn
            x = F.rms_norm(h, (cfg.hidden_size,), blk.post_attention_layernorm.weight, eps)
            gate_up = x @ blk.gate_up_proj.weight.t()
            gate, up = gate_up.split(cfg.intermediate_size, dim=-1)
            if lora is not None:
                gate, up = _add(gate, lora.delta(li, "gate_proj", x)), _add(up, lora.delta(li, "up_proj", x))
            a = F.silu(gate) * up
            down = a @ blk.down_proj.weight.t()
            if lora is not None:
                down = _add(down, lora.delta(li, "down_proj", a))
            h = h + down
        return F.rms_norm(h, (cfg.hidden_size,), self.model.norm.weight, eps)


def _add(t: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
    return t if delta is None else t + delta
