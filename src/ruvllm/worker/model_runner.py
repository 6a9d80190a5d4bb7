"""Runs one step: lays out all scheduled tokens as one flat batch, one forward pass, then samples."""

from __future__ import annotations

import logging

import torch

from ruvllm.attention.cpu_kernels import paged_attention
from ruvllm.attention.torch_paged import TorchPagedAttention
from ruvllm.config import CacheConfig, ModelConfig
from ruvllm.layers.sampler import sample, token_logprobs
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
                 dtype: torch.dtype, device: torch.device | str = "cpu", seed: int = 0,
                 attention: str = "auto") -> None:
        self.model = model
        # Unseeded requests sample from this, so a whole engine run reproduces from EngineConfig.seed.
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.cfg = cfg
        self.block_size = block_size
        self.device = torch.device(device)
        kernel = paged_attention() if attention == "auto" and self.device.type == "cpu" else None
        self.attn = TorchPagedAttention(kernel)
        shape = (cfg.num_layers, 2, num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.kv_views = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(cfg.num_layers)]
        log.info("KV cache: %d blocks of %d tokens, %.1f MiB", num_blocks, block_size,
                 self.kv_cache.numel() * self.kv_cache.element_size() / 2**20)

    @torch.inference_mode()
    def forward(self, so: SchedulerOutput) -> torch.Tensor:
        """One forward pass over every scheduled token of every request: final hidden states [T, H]."""
        input_ids: list[int] = []
        positions: list[int] = []
        seqs = []
        for seq in so.seqs:
            n = len(seq.token_ids)
            input_ids.extend(seq.token_ids)
            positions.extend(range(seq.start_position, seq.start_position + n))
            seqs.append((n, seq.start_position + n, seq.block_table))
        meta = self.attn.build_metadata(seqs, self.block_size, self.device)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        return self.model(ids, pos, self.kv_views, meta, self.attn)

    @staticmethod
    def _last_rows(so: SchedulerOutput) -> tuple[list[int], list[str]]:
        rows, ids, end = [], [], 0
        for seq in so.seqs:
            end += len(seq.token_ids)
            if seq.sample:
                rows.append(end - 1)
                ids.append(seq.request_id)
        return rows, ids

    def _logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, index)).float()

    @torch.inference_mode()
    def compute_logits(self, so: SchedulerOutput) -> tuple[torch.Tensor, list[str]]:
        """Logits (float32) of the rows that sample, and their request ids."""
        rows, ids = self._last_rows(so)
        return self._logits(self.forward(so), rows), ids

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput, requests: dict[str, Request]) -> ModelRunnerOutput:
        hidden = self.forward(so)
        rows, sample_ids = self._last_rows(so)
        out = ModelRunnerOutput({}, {}, self._prompt_logprobs(so, hidden, requests))
        if not sample_ids:
            return out
        reqs = [requests[rid] for rid in sample_ids]
        tokens, logprobs = sample(self._logits(hidden, rows), reqs, self.generator)
        out.sampled = {r.request_id: t for r, t in zip(reqs, tokens)}
        out.logprobs = {r.request_id: lp for r, lp in zip(reqs, logprobs) if lp is not None}
        return out

    def _prompt_logprobs(self, so: SchedulerOutput, hidden: torch.Tensor,
                         requests: dict[str, Request]) -> dict[str, list]:
        result = {}
        start = 0
        for seq in so.seqs:
            if seq.prompt_logprob_targets is not None:
                first, targets = seq.prompt_logprob_targets
                rows = list(range(start + first, start + first + len(targets)))
                lps = self._logits(hidden, rows).log_softmax(dim=-1)
                n = requests[seq.request_id].params.prompt_logprobs or 0
                result[seq.request_id] = token_logprobs(lps, targets, [n] * len(targets))
            start += len(seq.token_ids)
        return result
