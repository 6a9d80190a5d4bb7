"""Runs one step: lays out all scheduled tokens as one flat batch, one forward pass, then samples."""

from __future__ import annotations

import logging
import math
import mmap
from typing import TYPE_CHECKING

import torch

from ruvllm.attention.backend import AttentionBackend
from ruvllm.attention.cpu_kernels import cold_tier_kernels, paged_attention
from ruvllm.attention.kv_quant import KV_BITS, ColdLayer, KVTier, code_dtype, code_width, meta_width
from ruvllm.attention.torch_paged import TorchPagedAttention
from ruvllm.config import ModelConfig
from ruvllm.kv_groups import kv_layout
from ruvllm.layers.sampler import SamplingState, token_logprobs
from ruvllm.models.llama import LlamaForCausalLM
from ruvllm.outputs import ModelRunnerOutput, ScheduledSeq, SchedulerOutput
from ruvllm.speculative.verify import Proposal, sample_rows
from ruvllm.worker.kv_sizing import kv_capacity_ratio

if TYPE_CHECKING:
    from ruvllm.lora.batch import LoraBatch, XLoraBatch
    from ruvllm.lora.manager import LoraManager
    from ruvllm.worker.cuda_graphs import DecodeGraphs
    from ruvllm.worker.pooling import Pooler

log = logging.getLogger(__name__)


def choose_attention(name: str, cfg: ModelConfig, device: torch.device, quantized_kv: bool = False) -> AttentionBackend:
    """"auto": the Triton kernel on CUDA, our compiled C++ kernel on CPU (PyTorch ops without a compiler).
    A quantized (two-tier) KV cache on CUDA takes PyTorch's ops: the only path there that reads cold blocks."""
    if name == "triton" or (name == "auto" and device.type == "cuda" and not quantized_kv):
        from ruvllm.attention.triton_paged import TritonPagedAttention  # imports triton

        return TritonPagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    if device.type == "cuda":
        return TorchPagedAttention(None)
    if name != "auto":
        return TorchPagedAttention(None)
    return TorchPagedAttention(paged_attention(), cold_tier_kernels())


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled KV pool. On the CPU its memory is an anonymous mapping, which the kernel fills
    with zeros a page at a time when it is first touched: `torch.zeros` wrote every page at start-up
    instead (the default 1 GiB pool: 0.9 s of CPU per engine, measured session 22, and all of it
    resident at once), and a pool is mostly untouched until long contexts or many sequences fill
    it. The contents are zeros either way. The tensor keeps the mapping alive; freeing it unmaps."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, cfg: ModelConfig, block_size: int, num_blocks: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", seed: int = 0,
                 attention: str = "auto", num_cold_blocks: int = 0, kv_cache_dtype: str = "auto",
                 kv_hot_tokens: int = 0) -> None:
        self.model = model
        self.device = torch.device(device)
        # Unseeded requests sample from this, so a whole engine run reproduces from EngineConfig.seed.
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.cfg = cfg
        self.block_size = block_size
        self.dtype = dtype
        self.attn = choose_attention(attention, cfg, self.device, kv_cache_dtype in KV_BITS)
        self.graphs: DecodeGraphs | None = None
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_hot_tokens = kv_hot_tokens
        self.lora: LoraManager | None = None  # set by the worker when adapters are enabled
        self.layout = kv_layout(cfg)
        self.allocate_kv_cache(num_blocks, num_cold_blocks)

    def allocate_kv_cache(self, num_blocks: int, num_cold_blocks: int = 0) -> None:
        """The pool's blocks, plus one scratch block the scheduler never hands out: padding rows of
        a CUDA-graph batch write their keys there. With `num_cold_blocks` (an int8/int4 KV cache),
        also the cold tier: codes and fp16 scales per (token, KV head), block ids after the hot ones.

        One tensor per position in a KV group (kv_groups.py): layer l writes the tensor of its slot
        at the block ids of its group's tables. Without sliding-window layers that is one tensor per
        layer; Gemma 3's groups of 3 layers share 3 (block ids are never in two groups at once)."""
        cfg = self.cfg
        slots = self.layout.group_size
        slot_of = [self.layout.place(i)[1] for i in range(cfg.num_layers)]
        self.kv_cache = self.kv_views = None  # free the old pool before taking the new one
        self.cold_codes = self.cold_meta = self.tier = None
        self.num_blocks = num_blocks
        self.num_cold_blocks = num_cold_blocks
        shape = (slots, 2, (num_blocks + 1) * self.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_cache = zeroed_pool(shape, self.dtype, self.device)
        self.kv_views = [(self.kv_cache[s, 0], self.kv_cache[s, 1]) for s in slot_of]
        hot_mib = self.kv_cache.numel() * self.kv_cache.element_size() / 2**20
        if not num_cold_blocks:
            log.info("KV cache: %d blocks of %d tokens, %.1f MiB", num_blocks, self.block_size, hot_mib)
            return
        bits = KV_BITS[self.kv_cache_dtype]
        cold_slots = num_cold_blocks * self.block_size
        self.cold_codes = zeroed_pool((slots, 2, cold_slots, cfg.num_kv_heads, code_width(cfg.head_dim, bits)),
                                      code_dtype(bits), self.device)
        self.cold_meta = zeroed_pool((slots, 2, cold_slots, cfg.num_kv_heads, meta_width(bits)), torch.float16,
                                     self.device)
        self.tier = KVTier(num_blocks, self.kv_hot_tokens, bits)
        self.kv_views = [(self.kv_cache[i, 0], self.kv_cache[i, 1],
                          ColdLayer(self.cold_codes[i, 0], self.cold_codes[i, 1], self.cold_meta[i, 0], self.cold_meta[i, 1]))
                         for i in slot_of]
        cold_mib = (self.cold_codes.numel() + 2 * self.cold_meta.numel()) / 2**20
        ratio = kv_capacity_ratio(cfg, self.block_size, self.dtype, self.kv_cache_dtype, num_blocks, num_cold_blocks)
        log.info("KV cache: %d hot blocks (%s, %.1f MiB) + %d cold blocks (%s, %.1f MiB) of %d tokens: %d tokens, "
                 "%.2fx a %s cache in the same memory; hot window %d tokens", num_blocks,
                 str(self.dtype).removeprefix("torch."), hot_mib, num_cold_blocks, self.kv_cache_dtype, cold_mib,
                 self.block_size, (num_blocks + num_cold_blocks) * self.block_size, ratio,
                 str(self.dtype).removeprefix("torch."), self.kv_hot_tokens)

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the KV pool, both tiers (the hot tier's scratch block included)."""
        total = self.kv_cache.numel() * self.kv_cache.element_size()
        if self.cold_codes is not None:
            total += self.cold_codes.numel() + self.cold_meta.numel() * self.cold_meta.element_size()
        return total

    @torch.inference_mode()
    def migrate_blocks(self, moves: list[tuple[int, int]]) -> None:
        """Quantize-copy hot blocks into cold ones, every layer's K and V in one batched op.
        moves: (hot block id, cold block id) pairs from KVCacheManager.migrate_cold."""
        if not moves:
            return
        bs = self.block_size
        offsets = torch.arange(bs)
        src = torch.tensor([h for h, _ in moves], dtype=torch.long)
        dst = torch.tensor([c - self.num_blocks for _, c in moves], dtype=torch.long)
        src_slots = (src.unsqueeze(1) * bs + offsets).flatten().to(self.device)
        dst_slots = (dst.unsqueeze(1) * bs + offsets).flatten().to(self.device)
        self.attn.quantize_blocks(self.kv_cache, src_slots, self.cold_codes, self.cold_meta, dst_slots,
                                  self.tier.bits)

    @property
    def scratch_block(self) -> int:
        return self.num_blocks

    def capture_cuda_graphs(self, max_batch: int, max_model_len: int, ahead: bool = True) -> None:
        from ruvllm.worker.cuda_graphs import DecodeGraphs

        self.graphs = DecodeGraphs(self, max_batch, max_model_len, ahead)

    @torch.inference_mode()
    def forward(self, so: SchedulerOutput) -> torch.Tensor:
        """One forward pass over every scheduled token of every request: final hidden states [T, H].

        X-LoRA sequences run it as their scaling pass (the base model, over their scaling block
        tables); a second pass over those sequences alone, mixing their adapters by the scalings
        their classifier reads off the first pass, gives their rows' hidden states."""
        lora = self.lora.batch(so) if self.lora is not None else None
        hidden = self._forward(so.seqs, lora, scaling_tables=True)
        mixed = [i for i, seq in enumerate(so.seqs) if seq.scaling_block_table is not None]
        if mixed:
            assert self.lora is not None
            starts = [0]
            for seq in so.seqs:
                starts.append(starts[-1] + len(seq.token_ids))
            rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in mixed]).to(self.device)
            seqs = [so.seqs[i] for i in mixed]
            xlora = self.lora.xlora_batch(seqs, hidden.index_select(0, rows))
            hidden.index_copy_(0, rows, self._forward(seqs, xlora, scaling_tables=False))
        return hidden

    def _forward(self, scheduled: list[ScheduledSeq], lora: LoraBatch | XLoraBatch | None,
                 scaling_tables: bool) -> torch.Tensor:
        input_ids: list[int] = []
        positions: list[int] = []
        seqs = []
        for seq in scheduled:
            n = len(seq.token_ids)
            input_ids.extend(seq.token_ids)
            positions.extend(range(seq.start_position, seq.start_position + n))
            table = seq.scaling_block_table if scaling_tables and seq.scaling_block_table is not None \
                else seq.block_table
            seqs.append((n, seq.start_position + n, table))
        return self.run_tokens(input_ids, positions, seqs, lora, scheduled)

    def run_tokens(self, input_ids: list[int], positions: list[int], seqs: list[tuple[int, int, list[int]]],
                   lora: LoraBatch | XLoraBatch | None = None, scheduled: list[ScheduledSeq] | None = None
                   ) -> torch.Tensor:
        """The forward pass over a flat batch: token ids, their positions, and per sequence (tokens
        in this step, context length, block table); `scheduled` gives a model with several KV groups
        each group's tables. (Tensor parallelism's ranks other than 0 are handed these alone.)"""
        groups = self.layout.groups
        meta = self.attn.build_metadata(seqs, self.block_size, self.device, tier=self.tier,
                                        window=groups[0].window or 0)
        if len(groups) > 1:  # each KV group's own tables (and window)
            assert scheduled is not None
            meta.by_group = [meta] + [
                self.attn.build_metadata([(n, ctx, seq.group_block_tables[g - 1]) for (n, ctx, _), seq
                                          in zip(seqs, scheduled)], self.block_size, self.device,
                                         tier=self.tier, window=groups[g].window or 0)
                for g in range(1, len(groups))]
        ids = torch.tensor(input_ids, dtype=torch.long).to(self.device, non_blocking=True)
        pos = torch.tensor(positions, dtype=torch.long).to(self.device, non_blocking=True)
        return self.model(ids, pos, self.kv_views, meta, self.attn, lora)

    @staticmethod
    def _last_rows(so: SchedulerOutput, proposals: dict[str, Proposal] | None = None
                   ) -> tuple[list[int], list[str], list[int]]:
        """The rows that sample, their request ids, and the rows per id: a sequence's last row, or
        with proposals its last 1 + len(proposal) rows (its token's and each proposal's)."""
        rows, ids, counts, end = [], [], [], 0
        for seq in so.seqs:
            end += len(seq.token_ids)
            if seq.sample and not seq.pool:
                prop = proposals.get(seq.request_id) if proposals else None
                n = 1 + (len(prop.tokens) if prop is not None else 0)
                rows.extend(range(end - n, end))
                ids.append(seq.request_id)
                counts.append(n)
        return rows, ids, counts

    @torch.inference_mode()
    def logits_at(self, seqs: list[ScheduledSeq], rows: list[int]) -> torch.Tensor:
        """Float32 logits of the given rows of one plain forward pass over `seqs` (no adapters): the
        draft model's passes, and the cost measurement of verification rows."""
        return self._logits(self._forward(seqs, None, scaling_tables=False), rows)

    def _logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        if len(rows) == hidden.shape[0]:  # every row samples (decodes): no gather
            return self.model.compute_logits(hidden).float()
        index = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
        return self.model.compute_logits(hidden.index_select(0, index)).float()

    @torch.inference_mode()
    def compute_logits(self, so: SchedulerOutput) -> tuple[torch.Tensor, list[str]]:
        """Logits (float32) of the rows that sample, and their request ids."""
        rows, ids, _ = self._last_rows(so)
        return self._logits(self.forward(so), rows), ids

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput, states: dict[str, SamplingState],
                proposals: dict[str, Proposal] | None = None, pooler: Pooler | None = None) -> ModelRunnerOutput:
        """Forward and sample. With proposals (speculative decoding), each proposing sequence's
        token_ids end with its proposal's tokens, and its rows are verified (speculative/verify.py).
        The sampled tokens are appended to the states. Embedding requests' rows (ScheduledSeq.pool)
        go to `pooler` instead, from the same forward pass."""
        proposals = proposals or {}
        # A decode-only step runs as one CUDA graph (forward and LM head) where one was captured
        # (the graphs hold no adapters, one row per sequence, and give logits, not hidden states).
        use_graphs = self.graphs is not None and not proposals and not any(seq.adapter or seq.pool for seq in so.seqs)
        logits = self.graphs.run(so) if use_graphs else None
        graphed = logits is not None
        if not use_graphs and self.graphs is not None:  # (run forgets them itself)
            self.graphs.discard_ahead()
        if graphed:
            out = ModelRunnerOutput({}, {}, {})
            sample_ids = [seq.request_id for seq in so.seqs]
            counts = [1] * len(sample_ids)
        else:
            hidden = self.forward(so)
            rows, sample_ids, counts = self._last_rows(so, proposals)
            out = ModelRunnerOutput({}, {}, self._prompt_logprobs(so, hidden, states))
            if pooler is not None:
                out.pooled = self._pool(so, hidden, pooler)
            if not sample_ids:
                return out
            logits = self._logits(hidden, rows)
        # A graph step's tokens go to the host with the next step launched ahead (cuda_graphs.py).
        to_host = self.graphs.tokens_then_ahead if graphed and self.graphs.ahead else None
        tokens, logprobs = sample_rows(logits.float(), counts, [states[rid] for rid in sample_ids],
                                       [proposals.get(rid) for rid in sample_ids], self.generator, to_host)
        out.sampled = dict(zip(sample_ids, tokens))
        out.logprobs = {rid: lps for rid, lps in zip(sample_ids, logprobs) if lps[0] is not None}
        out.num_proposed = {rid: len(p.tokens) for rid, p in proposals.items()}
        return out

    @staticmethod
    def _pool(so: SchedulerOutput, hidden: torch.Tensor, pooler: Pooler) -> dict[str, bytes]:
        """Each embedding chunk's rows handed to the pooler; the vectors of those that ended."""
        pooled, start = {}, 0
        for seq in so.seqs:
            n = len(seq.token_ids)
            if seq.pool:
                vector = pooler.add(seq.request_id, seq.start_position, hidden[start:start + n], seq.sample)
                if vector is not None:
                    pooled[seq.request_id] = vector
            start += n
        return pooled

    def _prompt_logprobs(self, so: SchedulerOutput, hidden: torch.Tensor,
                         states: dict[str, SamplingState]) -> dict[str, list]:
        result = {}
        start = 0
        for seq in so.seqs:
            if seq.prompt_logprob_targets is not None:
                first, targets = seq.prompt_logprob_targets
                rows = list(range(start + first, start + first + len(targets)))
                lps = self._logits(hidden, rows).log_softmax(dim=-1)
                n = states[seq.request_id].params.prompt_logprobs or 0
                result[seq.request_id] = token_logprobs(lps, targets, [n] * len(targets))
            start += len(seq.token_ids)
        return result
