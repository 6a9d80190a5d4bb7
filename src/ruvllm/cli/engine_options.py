"""Engine settings shared by the commands that start an engine, turned into an EngineConfig."""

from __future__ import annotations

from dataclasses import dataclass

from ruvllm.config import CacheConfig, EngineConfig, QuantConfig, SchedulerConfig


DEVICE_HELP = "auto (CUDA when PyTorch sees a GPU, else the CPU), cpu, cuda or cuda:N."

QUANTIZATION_HELP = (
    "auto: keep GGUF 4/8-bit weights packed when computing in bf16; none: dequantize everything; "
    "bf16, f16: dense 16-bit; int8: per-channel int8; int4: group-wise int4 (--group-size); "
    "w8a8: int8 weights and int8 activations (int8 x int8 matmuls); q8, q4k: llama.cpp's Q8_0 and Q4_K "
    "quantizers applied at load.")

KV_CACHE_DTYPE_HELP = (
    "auto, bf16, fp16: the KV cache in the compute dtype; int8, int4: a two-tier cache, the newest "
    "--kv-hot-tokens of each sequence in the compute dtype and older blocks quantized (CPU only; "
    "1.8-3.2x the tokens in the same memory).")
KV_HOT_TOKENS_HELP = "With --kv-cache-dtype int8/int4: tokens per sequence read exactly (the hot window)."


@dataclass(frozen=True)
class EngineOptions:
    dtype: str = "auto"
    max_context: int | None = None
    block_size: int = 16
    kv_cache_gib: float | None = None  # None: 1 GiB on CPU, profiled on CUDA
    num_blocks: int | None = None
    max_num_batched_tokens: int = 512
    no_prefix_caching: bool = False
    threads: int | None = None
    quantization: str = "auto"
    group_size: int = 32
    device: str = "auto"
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"
    kv_hot_tokens: int = CacheConfig.kv_hot_tokens

    def to_config(self, model: str | None, max_num_seqs: int) -> EngineConfig:
        kv_bytes = None if self.kv_cache_gib is None else int(self.kv_cache_gib * 2**30)
        return EngineConfig(
            model=model, device=self.device, dtype=self.dtype, max_model_len=self.max_context, num_threads=self.threads,
            quantization=QuantConfig(self.quantization, self.group_size),
            cache=CacheConfig(block_size=self.block_size, kv_cache_memory_bytes=kv_bytes,
                              gpu_memory_utilization=self.gpu_memory_utilization,
                              num_blocks=self.num_blocks, enable_prefix_caching=not self.no_prefix_caching,
                              kv_cache_dtype=self.kv_cache_dtype, kv_hot_tokens=self.kv_hot_tokens),
            scheduler=SchedulerConfig(max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=max_num_seqs),
        )
