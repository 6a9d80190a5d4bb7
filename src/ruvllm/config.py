"""Frozen configuration records, one per concern."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder, independent of the file format it came from."""

    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k before RoPE
    rope_scaling: dict[str, Any] | None = None  # Hugging Face style, e.g. {"rope_type": "llama3", ...}
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30

# "auto": the compute dtype. bf16/fp16: the same, named (it must be the compute dtype). int8/int4: a
# two-tier cache, recent tokens in the compute dtype and older blocks quantized (docs/quantization.md).
KV_CACHE_DTYPES = ("auto", "bf16", "fp16", "int8", "int4")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Memory budget for the KV pool. Ignored when num_blocks is given. None: 1 GiB on CPU; on CUDA
    # what a profiled warm-up leaves of gpu_memory_utilization x the GPU's memory.
    kv_cache_memory_bytes: int | None = None
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"
    # int8/int4: a query reads a block exactly while any of its tokens is within this many positions
    # of the query (the hot window); older blocks are read dequantized and move to the cold tier.
    kv_hot_tokens: int = 64

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; choose one of "
                             f"{', '.join(KV_CACHE_DTYPES)}")
        if isinstance(self.kv_hot_tokens, bool) or not isinstance(self.kv_hot_tokens, int) or self.kv_hot_tokens < 0:
            raise ValueError(f"kv_hot_tokens must be a whole number >= 0, got {self.kv_hot_tokens!r}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")

    @property
    def quantized_kv(self) -> bool:
        return self.kv_cache_dtype in ("int8", "int4")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512  # token budget of one step
    max_num_seqs: int = 64  # cap on running sequences
    enable_chunked_prefill: bool = True
    # Longest prompt chunk one request may take in a step (None: the whole budget).
    long_prefill_token_threshold: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.max_num_seqs <= 0:
            raise ValueError("max_num_seqs must be positive")


QUANTIZATION_METHODS = ("auto", "none", "bf16", "f16", "int8", "int4", "w8a8", "q8", "q4k")


@dataclass(frozen=True)
class QuantConfig:
    """How linear weights are held.

    auto: as stored, where a packed kernel can run it: when the engine computes in bf16, GGUF 4-bit
          types (Q4_0, Q4_1, Q4_K) stay int4 and Q8_0 becomes per-channel int8. Everything else,
          and everything when computing in fp32, is dense in the engine's dtype.
    none: every weight dense in the engine's dtype (GGUF dequantized exactly).
    bf16 / f16: every weight dense in that dtype.
    w8a8: int8 weights as int8, and each activation row quantized to int8 on the fly: an int8 x int8
          matmul (`torch._int_mm`, CPU and CUDA) in any compute dtype.
    int8: per-output-channel round-to-nearest int8.  int4: group-wise int4 (`group_size` inputs per
          group); GGUF 4-bit weights whose groups match keep their own codes.
    q8 / q4k: llama.cpp's Q8_0 / Q4_K quantizers applied at load (fixed blocks of 32 / 256 inputs;
          `group_size` does not apply), run on the int4 kernel (quant/llamacpp.py).
    Modules named in `keep_16bit` stay dense (by default the embeddings and the LM head).
    """

    method: str = "auto"
    group_size: int = 32
    keep_16bit: tuple[str, ...] = ("embed_tokens", "lm_head")

    def __post_init__(self) -> None:
        if self.method not in QUANTIZATION_METHODS:
            raise ValueError(f"unknown quantization {self.method!r}; choose one of {', '.join(QUANTIZATION_METHODS)}")
        if self.group_size not in (32, 64, 128, 256):
            raise ValueError(f"int4 group size must be 32, 64, 128 or 256, got {self.group_size}")


ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # path to a HF folder or GGUF file; None: the embedded default
    device: str = "auto"  # "auto" (CUDA when present), "cpu", "cuda" or "cuda:N"
    dtype: str = "auto"  # bf16 where the CPU computes it natively (AVX-512 BF16 / AMX) or on CUDA, else fp32
    max_model_len: int | None = None  # defaults to the model's context length
    num_threads: int | None = None  # torch intra-op threads; None: all cores
    seed: int = 0  # seeds the sampling of requests that bring no seed of their own
    quantization: QuantConfig = field(default_factory=QuantConfig)
    # Attention: "auto" is the Triton kernel on CUDA and our compiled C++ kernel on CPU (when it
    # builds); "torch" plain PyTorch ops; "triton" forces the Triton kernel (on CPU: interpreted, tests only).
    attention: str = "auto"
    # CUDA graphs for decode-only steps at bucketed batch sizes (CUDA only).
    cuda_graphs: bool = True
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention!r}")
