"""Runs one step: lays out all scheduled tokens as one flat batch, one forward pass, then samples."""

from __future__ import annotations

import logging

import torch

from ruvllm.attention.metadata import build_attention_metadata
from ruvllm.attention.torch_paged import TorchPagedAttention
from ruvllm.config import CacheConfig, ModelConfig
from ruvllm.layers.sampler import sample
from ruvllm.models.llama import LlamaForCausalLM
from ruvllm.outputs import ModelRunnerOutput, SchedulerOutput
from ruvllm.request import Request

log = logging.getLogger(__name__)


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


def num_kv_blocks(cfg: ModelConfig, cache: CacheConfig, dtype: torch.dtype) -> int:
    if cache.num_blocks is not None:
        return cache.num_blocks
    n = cache.kv_cache_memory_bytes // kv_bytes_per_block(cfg, cache.block_size, dtype)
    if n < 1:
        raise ValueError(f"kv_cache_memory_bytes={cache.kv_cache_memory_bytes} holds no block of "
                         f"{kv_bytes_per_block(cfg, cache.block_size, dtype)} bytes")
    return int(n)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, cfg: ModelConfig, block_size: int, num_blocks: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.model = model
        self.cfg = cfg
        self.block_size = block_size
        self.device = torch.device(device)
        self.attn = TorchPagedAttention()
        shape = (cfg.num_layers, 2, num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.kv_views = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(cfg.num_layers)]
        log.info("KV cache: %d blocks of %d tokens, %.1f MiB", num_blocks, block_size,
                 self.kv_cache.numel() * self.kv_cache.element_size() / 2**20)

    @torch.inference_mode()
    def compute_logits(self, so: SchedulerOutput) -> tuple[torch.Tensor, list[str]]:
        """One forward pass over every scheduled token; logits (float32) of the rows that sample."""
        input_ids: list[int] = []
        positions: list[int] = []
        seqs = []
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        for seq in so.seqs:
            n = len(seq.token_ids)
            input_ids.extend(seq.token_ids)
            positions.extend(range(seq.start_position, seq.start_position + n))
            seqs.append((n, seq.start_position + n, seq.block_table))
            if seq.sample:
                sample_rows.append(len(input_ids) - 1)
                sample_ids.append(seq.request_id)
        meta = build_attention_metadata(seqs, self.block_size, self.device)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.model(ids, pos, self.kv_views, meta, self.attn)
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, rows)).float(), sample_ids

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput, requests: dict[str, Request]) -> ModelRunnerOutput:
        logits, sample_ids = self.compute_logits(so)
        if not sample_ids:
            return ModelRunnerOutput({}, {})
        reqs = [requests[rid] for rid in sample_ids]
        tokens, logprobs = sample(logits, reqs)
        return ModelRunnerOutput(
            sampled={r.request_id: t for r, t in zip(reqs, tokens)},
            logprobs={r.request_id: lp for r, lp in zip(reqs, logprobs) if lp is not None},
        )
