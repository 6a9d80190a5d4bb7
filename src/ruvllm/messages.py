"""What crosses between the front (tokenizer, detokenizer, API) and the engine core.

Every message is self-contained and plain data (msgspec structs over lists and numbers), so the
same messages serve a core in this process and one in a child process behind sockets: a request
crosses once with everything the core needs, and each step sends back only what is new.
"""

from __future__ import annotations

from typing import Union

import msgspec

from ruvllm.request import Logprob
from ruvllm.sampling_params import SamplingParams


class CoreRequest(msgspec.Struct, tag=True, omit_defaults=True):
    """One sequence for the core (a request with n > 1 is n of these, one per completion)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # n == 1; a derived seed for each of n completions
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 1
    arrival_time: float = 0.0  # time.monotonic(): one clock for every process of a machine
    # The first completion of the same prompt (n > 1): this one waits until that prompt is cached.
    prompt_sibling: str | None = None
    adapter: str | None = None  # a loaded LoRA adapter's name (None: the base model)
    # Adapters stacked on `adapter` (its tenant's learned micro-LoRA): each row's deltas are added in
    # this order after the named adapter's (docs/adapters.md, "Stacking"). Empty without `adapter`.
    stacked: tuple[str, ...] = ()
    # Mixed into the prefix cache's keys (vLLM's cache_salt): requests with different salts share
    # no cached block, so one tenant cannot time another's prompts through cache hits.
    cache_salt: str | None = None
    # An embedding request (config.POOLING_METHODS): its prompt is computed and its final hidden
    # states pooled into one normalized vector (CoreOutput.embedding); nothing is sampled and no KV
    # is kept after it. None: a generation request.
    pooling: str | None = None


class CoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step added to one sequence."""

    request_id: str
    new_token_ids: list[int] = []
    new_logprobs: list[dict[int, Logprob]] | None = None
    new_prompt_logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" (EOS / stop token) or "length"; stop strings are the front's
    stop_reason: int | None = None  # the stop token id that ended it
    num_cached_tokens: int = 0
    queue_time: float | None = None  # seconds from arrival to first scheduled (sent once)
    error: str | None = None  # why the core refused it (its constraint did not compile): a RequestError at the front
    embedding: bytes | None = None  # a pooling request's vector: little-endian float32, L2-normalized


class EngineInfo(msgspec.Struct, frozen=True):
    """What the front needs to know about the engine it talks to, fixed once the model is loaded."""

    model: str  # the model's path (or a name for models built in memory)
    architecture: str
    vocab_size: int
    max_model_len: int  # the model's context, as configured
    max_seq_len: int  # prompt + output one sequence can hold (max_model_len, or less with a small pool)
    eos_token_ids: tuple[int, ...]
    block_size: int
    num_hot_blocks: int
    num_cold_blocks: int
    hot_block_bytes: int  # one block of every layer's K and V in the compute dtype
    cold_block_bytes: int  # the same in the cold tier's int8/int4 codes and scales (0 without one)
    kv_cache_bytes: int  # both tiers
    kv_cache_dtype: str
    weight_bytes: int
    device: str
    dtype: str
    quantization: str
    max_num_seqs: int
    max_num_batched_tokens: int
    max_loras: int = 0  # LoRA adapter slots (0: adapters are not enabled)
    # Per KV group (kv_groups.py), the keys its queries see (None: the whole context). One group
    # for most models; a block holds one block of tokens for every layer of one group.
    kv_windows: tuple[int | None, ...] = (None,)
    pooling: str = "last"  # how embeddings pool unless a request says otherwise (EngineConfig.pooling)
    hidden_size: int = 0  # an embedding's length

    @property
    def num_blocks(self) -> int:
        return self.num_hot_blocks + self.num_cold_blocks


class EngineStats(msgspec.Struct):
    """A snapshot of the core's load, taken after a step or a batch of commands."""

    running: int = 0
    waiting: int = 0
    free_blocks: int = 0  # both tiers
    total_blocks: int = 0
    free_cold_blocks: int = 0  # of the quantized tier (0 without one)
    cold_blocks: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0
    adapters: list[str] = []  # LoRA adapters loaded now (by name)
    # Speculative decoding: tokens proposed, accepted, and sequence-steps that verified proposals
    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_verifications: int = 0
    # Bytes each KV tier holds now (hot and cold blocks in use, the disk tier's files), and the
    # disk tier's prompt tokens looked up (past the memory hits) and loaded
    hot_bytes: int = 0
    cold_bytes: int = 0
    disk_bytes: int = 0
    disk_queries: int = 0
    disk_hits: int = 0

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.free_blocks / self.total_blocks if self.total_blocks else 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted / self.spec_proposed if self.spec_proposed else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a verification step yields on average: the accepted proposals plus the target's own."""
        return 1.0 + self.spec_accepted / self.spec_verifications if self.spec_verifications else 0.0

    @property
    def idle(self) -> bool:
        return self.running == 0 and self.waiting == 0


def sum_stats(stats: list[EngineStats]) -> EngineStats:
    """Several cores' stats as one engine's (data-parallel or Ray replicas): counts and blocks add up;
    the adapters are the first core's (every replica loads the same ones)."""
    total = EngineStats(adapters=list(stats[0].adapters) if stats else [])
    for s in stats:
        for f in ("running", "waiting", "free_blocks", "total_blocks", "free_cold_blocks", "cold_blocks",
                  "prefix_queries", "prefix_hits", "preemptions", "spec_proposed", "spec_accepted",
                  "spec_verifications"):
            setattr(total, f, getattr(total, f) + getattr(s, f))
        for f in ("hot_bytes", "cold_bytes", "disk_bytes", "disk_queries", "disk_hits"):  # the KV tiers
            setattr(total, f, getattr(total, f) + getattr(s, f))
    return total


# --- the wire between the front and a core process --------------------------------------------------
class AddRequests(msgspec.Struct, tag=True):
    requests: list[CoreRequest]


class AbortRequests(msgspec.Struct, tag=True):
    request_ids: list[str]


# The calls a front may make of the core: each answered (CallResult) in order with the other
# commands, so after an abort a GetStats sees the abort done. The core's loop dispatches on the type.
class GetStats(msgspec.Struct, tag=True):
    pass


class ResetPrefixCache(msgspec.Struct, tag=True):
    pass


class LoadAdapter(msgspec.Struct, tag=True):
    """Read a PEFT folder off the core's loop, then install it between two steps. `files`: what the
    server's path policy checked of each file the load reads (lora/checked_files.py), or None."""

    name: str
    path: str
    files: dict[str, tuple[str, int, int]] | None = None


class UnloadAdapter(msgspec.Struct, tag=True):
    name: str


class ListAdapters(msgspec.Struct, tag=True):
    """The adapter registry's entries (CallResult.adapters): what a restarted replica loads again."""


CoreCall = Union[GetStats, ResetPrefixCache, LoadAdapter, UnloadAdapter, ListAdapters]


class Call(msgspec.Struct, tag=True):
    call_id: int
    call: CoreCall


class Shutdown(msgspec.Struct, tag=True):
    pass


CoreInput = Union[AddRequests, AbortRequests, Call, Shutdown]


class Ready(msgspec.Struct, tag=True):
    info: EngineInfo
    stats: EngineStats


class StepOutputs(msgspec.Struct, tag=True):
    outputs: list[CoreOutput]
    stats: EngineStats


class AdapterEntry(msgspec.Struct, array_like=True):
    name: str
    path: str


class CallResult(msgspec.Struct, tag=True):
    call_id: int
    stats: EngineStats
    error: str | None = None
    error_type: str | None = None  # a ruvllm.errors class (or ValueError): the front raises the same
    adapters: list[AdapterEntry] = []  # ListAdapters' answer


class CoreFailed(msgspec.Struct, tag=True):
    """The core could not start (error_type names a ruvllm.errors class or ValueError) or stopped."""

    error_type: str
    message: str


CoreMessage = Union[Ready, StepOutputs, CallResult, CoreFailed]
