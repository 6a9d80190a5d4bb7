"""Runs one step: lays out all scheduled tokens as one flat batch, one forward pass, then samples."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from ruvllm.attention.backend import AttentionBackend
from ruvllm.attention.cpu_kernels import paged_attention
from ruvllm.attention.torch_paged import TorchPagedAttention
from ruvllm.config import DEFAULT_CPU_KV_CACHE_BYTES, CacheConfig, ModelConfig
from ruvllm.layers.sampler import sample, token_logprobs
from ruvllm.models.llama import LlamaForCausalLM
from ruvllm.outputs import ModelRunnerOutput, SchedulerOutput
from ruvllm.request import Request

if TYPE_CHECKING:
    from ruvllm.worker.cuda_graphs import DecodeGraphs

log = logging.getLogger(__name__)


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


def num_kv_blocks(cfg: ModelConfig, cache: CacheConfig, dtype: torch.dtype) -> int:
    """Blocks in the pool when its size is given (a block count, or bytes; default 1 GiB)."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    budget = cache.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES
    n = budget // kv_bytes_per_block(cfg, cache.block_size, dtype)
    if n < 1:
        raise ValueError(f"kv_cache_memory_bytes={budget} holds no block of "
                         f"{kv_bytes_per_block(cfg, cache.block_size, dtype)} bytes")
    return int(n)


def choose_attention(name: str, cfg: ModelConfig, device: torch.device) -> AttentionBackend:
    """"auto": the Triton kernel on CUDA, our compiled C++ kernel on CPU (PyTorch ops without a compiler)."""
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        from ruvllm.attention.triton_paged import TritonPagedAttention  # imports triton

        return TritonPagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    if device.type == "cuda":
        return TorchPagedAttention(None)
    return TorchPagedAttention(paged_attention() if name == "auto" else None)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, cfg: ModelConfig, block_size: int, num_blocks: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", seed: int = 0,
                 attention: str = "auto") -> None:
        self.model = model
        self.device = torch.device(device)
        # Unseeded requests sample from this, so a whole engine run reproduces from EngineConfig.seed.
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.cfg = cfg
        self.block_size = block_size
        self.dtype = dtype
        self.attn = choose_attention(attention, cfg, self.device)
        self.graphs: DecodeGraphs | None = None
        self.allocate_kv_cache(num_blocks)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """The pool's blocks, plus one scratch block the scheduler never hands out: padding rows of
        a CUDA-graph batch write their keys there."""
        cfg = self.cfg
        self.kv_cache = self.kv_views = None  # free the old pool before taking the new one
        self.num_blocks = num_blocks
        shape = (cfg.num_layers, 2, (num_blocks + 1) * self.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.kv_views = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(cfg.num_layers)]
        log.info("KV cache: %d blocks of %d tokens, %.1f MiB", num_blocks, self.block_size,
                 self.kv_cache.numel() * self.kv_cache.element_size() / 2**20)

    @property
    def scratch_block(self) -> int:
        return self.num_blocks

    def capture_cuda_graphs(self, max_batch: int, max_model_len: int) -> None:
        from ruvllm.worker.cuda_graphs import DecodeGraphs

        self.graphs = DecodeGraphs(self, max_batch, max_model_len)

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
        ids = torch.tensor(input_ids, dtype=torch.long).to(self.device, non_blocking=True)
        pos = torch.tensor(positions, dtype=torch.long).to(self.device, non_blocking=True)
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
        if len(rows) == hidden.shape[0]:  # every row samples (decodes): no gather
            return self.model.compute_logits(hidden).float()
        index = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
        return self.model.compute_logits(hidden.index_select(0, index)).float()

    @torch.inference_mode()
    def compute_logits(self, so: SchedulerOutput) -> tuple[torch.Tensor, list[str]]:
        """Logits (float32) of the rows that sample, and their request ids."""
        rows, ids = self._last_rows(so)
        return self._logits(self.forward(so), rows), ids

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput, requests: dict[str, Request]) -> ModelRunnerOutput:
        # A decode-only step runs as one CUDA graph (forward and LM head) where one was captured.
        logits = self.graphs.run(so) if self.graphs is not None else None
        if logits is not None:
            out = ModelRunnerOutput({}, {}, {})
            sample_ids = [seq.request_id for seq in so.seqs]
        else:
            hidden = self.forward(so)
            rows, sample_ids = self._last_rows(so)
            out = ModelRunnerOutput({}, {}, self._prompt_logprobs(so, hidden, requests))
            if not sample_ids:
                return out
            logits = self._logits(hidden, rows)
        reqs = [requests[rid] for rid in sample_ids]
        tokens, logprobs = sample(logits.float(), reqs, self.generator)
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
