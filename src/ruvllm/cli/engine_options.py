"""Engine settings shared by the commands that start an engine, turned into an EngineConfig."""

from __future__ import annotations

from dataclasses import dataclass

from ruvllm.config import CacheConfig, EngineConfig, QuantConfig, SchedulerConfig


QUANTIZATION_HELP = (
    "auto: keep GGUF 4/8-bit weights packed when computing in bf16; none: dequantize everything; "
    "bf16, f16: dense 16-bit; int8: per-channel int8; int4: group-wise int4 (--group-size).")


@dataclass(frozen=True)
class EngineOptions:
    dtype: str = "auto"
    max_context: int | None = None
    block_size: int = 16
    kv_cache_gib: float = 1.0
    num_blocks: int | None = None
    max_num_batched_tokens: int = 512
    no_prefix_caching: bool = False
    threads: int | None = None
    quantization: str = "auto"
    group_size: int = 32

    def to_config(self, model: str | None, max_num_seqs: int) -> EngineConfig:
        return EngineConfig(
            model=model, dtype=self.dtype, max_model_len=self.max_context, num_threads=self.threads,
            quantization=QuantConfig(self.quantization, self.group_size),
            cache=CacheConfig(block_size=self.block_size, kv_cache_memory_bytes=int(self.kv_cache_gib * 2**30),
                              num_blocks=self.num_blocks, enable_prefix_caching=not self.no_prefix_caching),
            scheduler=SchedulerConfig(max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=max_num_seqs),
        )
