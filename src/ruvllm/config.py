"""Frozen configuration records, one per concern."""

from __future__ import annotations

import dataclasses
import functools
import numbers
import types
import typing
from dataclasses import dataclass, field, replace
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder (the Llama family, Gemma 3), independent of the file format it came from."""

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
    # Gemma 3: which layers attend through a sliding window of `sliding_window` keys (a query at p
    # sees keys p - sliding_window + 1 .. p), and their own RoPE base; empty: every layer is global.
    sliding_layers: tuple[int, ...] = ()
    sliding_window: int | None = None
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (None: head_dim's)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class Setting:
    """A user-facing field, declared once: its help, its CLI flag and the values it takes. The config
    dataclass checks every value against it when it is made (Checked), and the CLI flags of serve,
    chat, benchmark and ray-serve, LLM(...)'s keywords and Ray's `serve run` arguments are generated
    from it (cli/engine_options.py), so all of them take the same values."""

    help: str
    flag: str | None = None  # the CLI name when it is not --field-name
    aliases: tuple[str, ...] = ()
    choices: tuple[Any, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None
    unit: int | None = None  # the flag takes a number of these (--kv-cache-gib: GiB of a field in bytes)
    metavar: str | None = None
    envvar: str | None = None
    cli: bool = True  # False: set through the dataclass only, no flag

    def check(self, label: str, value: Any, kind: type, optional: bool, unit: float = 1) -> None:
        """A ValueError naming `label` (the field, or its flag, whose values are in `unit`s) when
        `value` is not one this setting takes."""
        if value is None and optional:
            return
        what, fits = _KINDS.get(kind, (kind.__name__, lambda v: isinstance(v, kind)))
        lo, hi = (b if b is None else b / unit for b in (self.minimum, self.maximum))
        if self.choices is not None:
            what = "one of " + ", ".join(map(str, self.choices))
        if (fits(value) and (self.choices is None or value in self.choices) and (lo is None or value >= lo)
                and (hi is None or value <= hi)):
            return
        bounds = (f" from {lo:g} to {hi:g}" if lo is not None and hi is not None else f" >= {lo:g}" if lo is not None
                  else f" <= {hi:g}" if hi is not None else "")
        raise ValueError(f"{label} must be {what}{bounds}, got {value!r}")


_KINDS: dict[type, tuple[str, Any]] = {
    int: ("a whole number", lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool)),
    float: ("a number", lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool)),
    bool: ("true or false", lambda v: isinstance(v, bool)),
    str: ("a string", lambda v: isinstance(v, str))}


def setting(default: Any, help: str, **declaration: Any) -> Any:
    """A dataclass field declared as a Setting (its keywords)."""
    if isinstance(default, (list, dict, set)):
        raise TypeError("mutable defaults need a default_factory")
    return field(default=default, metadata={"setting": Setting(help, **declaration)})


@dataclass(frozen=True)
class Declared:
    """One setting(...) field of a config class, with what its annotation says."""

    owner: type
    name: str
    setting: Setting
    kind: type  # the annotation without None (tuple for tuple[str, ...])
    optional: bool  # None is a value: "not set"
    default: Any


@functools.cache
def declared(cls: type) -> tuple[Declared, ...]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if "setting" in f.metadata:
            hint = hints[f.name]
            args = typing.get_args(hint) if typing.get_origin(hint) in (types.UnionType, typing.Union) else (hint,)
            first = next(a for a in args if a is not type(None))
            out.append(Declared(cls, f.name, f.metadata["setting"], typing.get_origin(first) or first,
                                type(None) in args, f.default))
    return tuple(out)


class Checked:
    """Base of the config dataclasses: making one (replace() too) checks each setting(...) field's
    type, bounds and choices against its declaration, then the class's own rules across fields; a
    bad value is a ValueError naming the field."""

    def __post_init__(self) -> None:
        for d in declared(type(self)):
            d.setting.check(d.name, getattr(self, d.name), d.kind, d.optional)
        self.check_across()

    def check_across(self) -> None:
        """Rules that tie fields together (a subclass's own)."""


DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
DEFAULT_KV_DISK_BYTES = 8 << 30  # the disk tier's budget when only its folder is given

# "auto": the compute dtype. bf16/fp16: the same, named (it must be the compute dtype). int8/int4: a
# two-tier cache, recent tokens in the compute dtype and older blocks quantized (docs/quantization.md).
KV_CACHE_DTYPES = ("auto", "bf16", "fp16", "int8", "int4")


@dataclass(frozen=True)
class CacheConfig(Checked):
    block_size: int = setting(16, "Tokens per KV-cache block.", minimum=1)
    # Memory budget for the KV pool. Ignored when num_blocks is given. None: 1 GiB on CPU; on CUDA
    # what a profiled warm-up leaves of gpu_memory_utilization x the GPU's memory.
    kv_cache_memory_bytes: int | None = setting(
        None, "KV-cache memory budget in GiB (default: 1 GiB on CPU; on CUDA what --gpu-memory-utilization "
              "leaves after a profiled warm-up).", flag="--kv-cache-gib", unit=2**30, minimum=1)
    num_blocks: int | None = setting(None, "KV blocks (overrides --kv-cache-gib).", minimum=1)
    enable_prefix_caching: bool = setting(True, "Reuse the KV blocks of prompt prefixes seen before.",
                                          flag="--prefix-caching/--no-prefix-caching")
    gpu_memory_utilization: float = setting(0.9, "Share of the GPU's memory the engine may use (CUDA).",
                                            minimum=0.01, maximum=1.0)
    kv_cache_dtype: str = setting(
        "auto", "auto, bf16, fp16: the KV cache in the compute dtype; int8, int4: a two-tier cache, the newest "
                "--kv-hot-tokens of each sequence in the compute dtype and older blocks quantized (CPU only; "
                "1.8-3.2x the tokens in the same memory).", choices=KV_CACHE_DTYPES)
    # int8/int4: a query reads a block exactly while any of its tokens is within this many positions
    # of the query (the hot window); older blocks are read dequantized and move to the cold tier.
    kv_hot_tokens: int = setting(64, "With --kv-cache-dtype int8/int4: tokens per sequence read exactly "
                                     "(the hot window).", minimum=0)
    # The disk tier (docs/architecture.md, KV cache manager): prefix-cache blocks about to be evicted
    # are written to this folder, and a later prompt whose prefix they hold loads them instead of
    # recomputing, in this process or after a restart. None: nothing is written.
    kv_disk_path: str | None = setting(
        None, "A folder for a disk tier of the prefix cache: evicted prefix blocks are written there and loaded "
              "back by later prompts, also after a restart (default: no disk tier).", metavar="DIR")
    kv_disk_bytes: int | None = setting(
        None, "With --kv-disk-path: the disk tier's budget in GiB; its least recently used blocks are "
              f"deleted past it (default: {DEFAULT_KV_DISK_BYTES >> 30} GiB).", flag="--kv-disk-gib", unit=2**30,
        minimum=1)

    @property
    def quantized_kv(self) -> bool:
        return self.kv_cache_dtype in ("int8", "int4")

    @property
    def kv_disk_budget(self) -> int:
        """The disk tier's byte budget (0: no disk tier)."""
        if self.kv_disk_path is None:
            return 0
        return self.kv_disk_bytes if self.kv_disk_bytes is not None else DEFAULT_KV_DISK_BYTES

    def check_across(self) -> None:
        if self.kv_disk_bytes is not None and self.kv_disk_path is None:
            raise ValueError("kv_disk_bytes (--kv-disk-gib) needs a folder for the disk tier (kv_disk_path / "
                             "--kv-disk-path)")


# The token budget of one step when none is given: on a CPU a step's time grows with its tokens, so
# a small budget keeps decodes flowing while prompts are chunked in; a GPU runs 2048 tokens in about
# the time of 512, so there a larger budget admits prompts faster at little cost to the decodes.
DEFAULT_BATCHED_TOKENS = {"cpu": 512, "cuda": 2048}


@dataclass(frozen=True)
class SchedulerConfig(Checked):
    max_num_batched_tokens: int | None = setting(
        None, "Token budget of one engine step (default: 512 on CPU, 2048 on CUDA).", minimum=1)
    max_num_seqs: int = setting(64, "Sequences running at once (the server admits --max-queue more, then 429).",
                                flag="--max-num-seqs", aliases=("--max-concurrent",), minimum=1)
    enable_chunked_prefill: bool = setting(True, "Split long prompts into chunks that share steps with decodes.",
                                           flag="--chunked-prefill/--no-chunked-prefill")
    # Longest prompt chunk one request may take in a step (None: the whole budget).
    long_prefill_token_threshold: int | None = setting(
        None, "Longest prompt chunk one request may take in a step (default: the whole budget).", minimum=1)

    def resolved(self, device_type: str) -> SchedulerConfig:
        """The same settings with the device's defaults filled in."""
        if self.max_num_batched_tokens is not None:
            return self
        return replace(self, max_num_batched_tokens=DEFAULT_BATCHED_TOKENS.get(device_type, 512))

    @property
    def token_budget(self) -> int:
        if self.max_num_batched_tokens is None:
            raise ValueError("the token budget is resolved for a device first (SchedulerConfig.resolved)")
        return self.max_num_batched_tokens


QUANTIZATION_METHODS = ("auto", "none", "bf16", "f16", "int8", "int4", "w8a8", "q8", "q4k")


@dataclass(frozen=True)
class QuantConfig(Checked):
    """How linear weights are held.

    auto: as stored, where a packed kernel can run it. On the CPU (our kernels, any compute dtype) GGUF
          4-bit types (Q4_0, Q4_1, Q4_K) stay int4 and Q8_0 stays Q8_0, and a tied LM head reads
          the embedding table in the form the file stores it (SmolLM2's Q8_0: an 8-bit head). On
          CUDA: dense, as `none` (quant/plan.py says why). Float weights stay dense in the engine's dtype.
    none: every weight dense in the engine's dtype (GGUF dequantized exactly): the reference.
    bf16 / f16: every weight dense in that dtype.
    w8a8: int8 weights as int8, and each activation row quantized to int8 on the fly: an int8 x int8
          matmul (`torch._int_mm`, CPU and CUDA) in any compute dtype.
    int8: per-output-channel round-to-nearest int8.  int4: group-wise int4 (`group_size` inputs per
          group); GGUF 4-bit weights whose groups match keep their own codes.
    q8 / q4k: llama.cpp's Q8_0 / Q4_K quantizers applied at load (fixed blocks of 32 / 256 inputs;
          `group_size` does not apply).
    Modules named in `keep_16bit` stay dense. Its default (None) is the embeddings, and the LM head
    too except under auto (a runtime int4 head costs +6% perplexity; under auto the head keeps the
    file's own form, measured in docs/quantization.md).
    """

    method: str = setting(
        "auto", "auto: keep GGUF 4/8-bit and GPTQ/AWQ weights packed, a tied LM head as the file stores its "
                "table (CPU; dense on CUDA); none: dequantize everything; "
                "bf16, f16: dense 16-bit; int8: per-channel int8; int4: group-wise int4 (--group-size); "
                "w8a8: int8 weights and int8 activations (int8 x int8 matmuls); q8, q4k: llama.cpp's Q8_0 and Q4_K "
                "quantizers applied at load.", flag="--quantization", aliases=("-q",),
        choices=QUANTIZATION_METHODS)
    group_size: int = setting(32, "Inputs per int4 quantization group (32, 64, 128, 256).", choices=(32, 64, 128, 256))
    keep_16bit: tuple[str, ...] | None = setting(None, "Modules that stay dense (default: see above).", cli=False)

    @property
    def dense_modules(self) -> tuple[str, ...]:
        """keep_16bit, or the method's default when it is None."""
        if self.keep_16bit is not None:
            return self.keep_16bit
        return ("embed_tokens",) if self.method == "auto" else ("embed_tokens", "lm_head")


@dataclass(frozen=True)
class LoraConfig(Checked):
    """LoRA adapters served beside the base model (docs/adapters.md)."""

    enable_lora: bool = setting(False, "Serve LoRA adapters (reserves --max-loras slots of --max-lora-rank).",
                                flag="--enable-lora/--no-enable-lora")
    max_loras: int = setting(8, "LoRA adapters resident at once, in preallocated slots: the most one step "
                                "mixes; requests for more take turns.", minimum=1)
    max_lora_rank: int = setting(64, "Largest LoRA rank an adapter may have.", minimum=1, maximum=1024)
    max_cpu_loras: int | None = setting(None, "LoRA adapters loaded in CPU memory, ready to be served "
                                              "(default: --max-loras).", minimum=1)

    @property
    def cpu_capacity(self) -> int:
        return max(self.max_cpu_loras or 0, self.max_loras)


SPECULATIVE_METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig(Checked):
    """Speculative decoding (docs/speculative.md): a proposer guesses up to K next tokens of a
    decoding sequence, the target model scores them in one pass as a prompt chunk, and exact
    rejection sampling keeps a prefix of them plus one token of its own."""

    speculative: str | None = setting(
        None, "Speculative decoding: ngram (prompt lookup) or draft (a smaller model, --speculative-model; "
              "giving that flag alone implies it).", choices=SPECULATIVE_METHODS)
    num_speculative_tokens: int = setting(4, "Tokens a proposer guesses per step (K).", minimum=1, maximum=16)
    ngram_max: int = setting(4, "Longest n-gram the prompt-lookup proposer matches.", minimum=1)
    ngram_min: int = setting(1, "Shortest n-gram the prompt-lookup proposer matches.", minimum=1)
    speculative_model: str | None = setting(None, "The draft model (a path or name; it must share the target's "
                                                  "tokenizer).")
    adaptive_speculation: bool = setting(
        True, "Choose each sequence's proposal count per step from its acceptance so far and the measured "
              "costs (off: always K).", flag="--adaptive-speculation/--no-adaptive-speculation")
    speculative_quantization: str = setting(
        "auto", "The draft model's weights (as --quantization).", choices=QUANTIZATION_METHODS)

    @property
    def method(self) -> str | None:
        if self.speculative is None and self.speculative_model is not None:
            return "draft"
        return self.speculative

    @property
    def num_lookahead(self) -> int:
        """Tokens a speculating sequence may propose per step (0: speculation is off)."""
        return self.num_speculative_tokens if self.method is not None else 0

    def check_across(self) -> None:
        if self.method == "draft" and self.speculative_model is None:
            raise ValueError("speculative decoding with a draft model needs the model (speculative_model / "
                             "--speculative-model)")
        if self.method == "ngram" and self.speculative_model is not None:
            raise ValueError("ngram speculation takes no draft model; drop --speculative-model or use "
                             "--speculative draft")
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must not exceed ngram_max ({self.ngram_max})")


ATTENTION_BACKENDS = ("auto", "torch", "triton")
POOLING_METHODS = ("last", "mean")


@dataclass(frozen=True)
class EngineConfig(Checked):
    model: str | None = None  # path to a HF folder or GGUF file; None: the embedded default
    device: str = setting("auto", "auto (CUDA when PyTorch sees a GPU, else the CPU), cpu, cuda or cuda:N.")
    dtype: str = setting("auto", "auto (bf16 on CUDA, float32 on the CPU), float32, "
                                 "bfloat16, float16.")
    max_model_len: int | None = setting(None, "Context length cap in tokens (default: the model's).",
                                        flag="--max-context", minimum=2)
    num_threads: int | None = setting(None, "CPU threads (default: $OMP_NUM_THREADS, else every core this "
                                            "process may use).", flag="--threads", minimum=1)
    seed: int = setting(0, "Seeds the sampling of requests that bring no seed of their own.")
    grammar_compile_timeout: float = setting(
        10.0, "Seconds a structured-output constraint may take to compile; past it the compile is stopped and the "
             "request gets a 400 (docs/structured.md).", minimum=0.01)
    grammar_idle_exit: float = setting(
        120.0, "Seconds without a new structured-output constraint after which the grammar-compile process "
               "(about 290 MB) leaves; the next new constraint starts it again (seconds). 0 keeps it.", minimum=0.0)
    quantization: QuantConfig = field(default_factory=QuantConfig)
    # Attention: "auto" is the Triton kernel on CUDA and our compiled C++ kernel on CPU (when it
    # builds); "torch" plain PyTorch ops; "triton" forces the Triton kernel (on CPU: interpreted, tests only).
    attention: str = setting("auto", "Attention kernel: auto (Triton on CUDA, our C++ kernel on CPU), torch, triton.",
                             choices=ATTENTION_BACKENDS)
    # CUDA graphs for decode-only steps at bucketed batch sizes (CUDA only).
    cuda_graphs: bool = setting(True, "Replay decode steps as CUDA graphs (CUDA only).",
                                flag="--cuda-graphs/--no-cuda-graphs")
    # A decode step's graph launched before the previous step's tokens reach the host, its input ids
    # copied on the device from the sampler's output (worker/cuda_graphs.py, "Launched ahead"): the
    # host's work between steps (outputs, scheduling, the next inputs) overlaps the GPU's.
    async_scheduling: bool = setting(True, "Launch each decode step's CUDA graph before the previous step's "
                                           "tokens reach the host (CUDA graphs only).",
                                     flag="--async-scheduling/--no-async-scheduling")
    # Embeddings (LLM.embed, /v1/embeddings): how the final hidden states (after the final norm) of
    # an input become one vector, before it is L2-normalized. "last": the last token's state, the
    # only one of a causal decoder that has seen the whole input (what decoder embedders such as
    # e5-mistral and gte-Qwen are trained with); it needs no state across chunks and lets the
    # prefix cache serve shared prefixes. "mean": the average over every token's state (models
    # trained with mean pooling); every row must be computed, so it takes no prefix-cache hits.
    pooling: str = setting("last", "How an embedding pools the final hidden states: last (the last token's) or "
                                   "mean (every token's average); docs/server.md, Embeddings.",
                           choices=POOLING_METHODS)
    # Tensor parallelism (docs/scaling.md): this many processes, each holding a slice of every layer
    # (its heads, MLP columns and vocabulary rows), over torch.distributed: gloo on the CPU, NCCL on
    # CUDA (one GPU per rank). Dense weights in the Python layer loop; other settings are refused by name.
    tensor_parallel_size: int = setting(
        1, "Processes (ranks) that each hold a slice of every layer: tensor parallelism over gloo on the CPU, "
           "NCCL on CUDA (one GPU per rank). Dense weights only (--quantization none, bf16, f16).", minimum=1)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    speculation: SpeculativeConfig = field(default_factory=SpeculativeConfig)
