"""Gemma 3 (text): the Llama family's layer and model with Gemma's differences, over the same flat
batch and paged KV cache.

What differs from Llama (docs/gemma3.md): embeddings scaled by sqrt(hidden); a norm before *and*
after attention and the MLP ("sandwich" norms), a sublayer's output joining the residual only after
its post-norm; RMSNorm weights used as (1 + w); q/k RMSNorm (the config's qk_norm); a GeGLU MLP
(tanh GELU on the gate); attention scaled by query_pre_attn_scalar**-0.5 (cfg.attention_scale);
most layers attend through a sliding window with their own RoPE base (the model's local_rope),
every sixth globally; a final logit soft-cap. The window is the attention's business: each layer
reads its KV group's metadata (kv_groups.py), routed by the Llama model as for any layout. The C++
layer loop (models/cpu_layer_loop.py) runs these layers too, bitwise as this Python loop does.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ruvllm.attention.backend import AttentionBackend
from ruvllm.attention.metadata import AttentionMetadata
from ruvllm.config import ModelConfig
from ruvllm.errors import AdapterError
from ruvllm.models.cpu_layer_loop import LoopForm
from ruvllm.models.llama import DecoderLayer, LayerRun, LlamaForCausalLM, RMSNorm


class Gemma3DecoderLayer(DecoderLayer):
    MLP_NORM = "pre_feedforward_layernorm"
    LOOP_FORM = LoopForm(gelu_tanh=True, post_norms=True)  # the C++ loop runs it (cpu_layer_loop.py)

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__(cfg, index)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def joining(self, y: torch.Tensor, post_norm: str, run: LayerRun) -> torch.Tensor:
        return run.ops.rms_norm(y, getattr(self, post_norm).weight, self.cfg.rms_norm_eps)

    def act_and_mul(self, gate_up: torch.Tensor, run: LayerRun) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Norm weights are held as the multiplier (1 + w): Hugging Face-named weights arrive as w
    (a GGUF's, which llama.cpp stores as 1 + w, are turned back by the loader, as transformers does)."""

    layer_class = Gemma3DecoderLayer
    norm_offset = 1.0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple],
                meta: AttentionMetadata, attn: AttentionBackend, lora: object = None) -> torch.Tensor:
        if lora is not None:
            raise AdapterError("LoRA adapters are not supported on Gemma 3 models")
        return super().forward(input_ids, positions, kv_caches, meta, attn)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # transformers casts the scale to the weights' dtype first (25.25 in bf16, not 25.298)
        return x * torch.tensor(math.sqrt(self.cfg.hidden_size), dtype=x.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.cfg.final_logit_softcapping
        if cap is None:
            return logits
        if logits.requires_grad:  # autograd needs tanh's output kept: no in-place ops
            return torch.tanh(logits / cap) * cap
        # In place on the head's fresh output: the same three operations and roundings (tokens
        # checked equal), without two vocabulary-wide temporaries a step (at 32 rows of 262,144
        # words, 2 x 32 MiB; ~1% of a 32-row decode step, 307.6 against 310.2 ms on the AVX2 EPYC).
        return logits.div_(cap).tanh_().mul_(cap)
