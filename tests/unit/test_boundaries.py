"""The engine core's boundary, checked from a fresh interpreter: the core (scheduler, KV cache
manager, EngineCore) imports nothing of the loader, the models, quantization, attention or the
front, and the messages that cross the process boundary survive msgpack unchanged."""

from __future__ import annotations

import subprocess
import sys

from ruvllm.messages import AbortRequests, AddRequests, CoreInput, CoreMessage, CoreOutput, CoreRequest, StepOutputs
from ruvllm.request import Logprob
from ruvllm.sampling_params import SamplingParams


def test_the_core_imports_nothing_of_the_worker_or_the_front() -> None:
    code = ("import sys, ruvllm.core.engine_core, ruvllm.core.scheduler, ruvllm.core.kv_cache_manager; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('ruvllm.'))))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    forbidden = ("ruvllm.loader", "ruvllm.models", "ruvllm.quant", "ruvllm.attention", "ruvllm.engine",
                 "ruvllm.worker", "ruvllm.server", "ruvllm.cli", "ruvllm.layers")
    assert loaded and not [m for m in loaded if m.startswith(forbidden)], loaded
    assert "torch" not in subprocess.run(
        [sys.executable, "-c", code.replace("'ruvllm.'", "'torch'")], capture_output=True, text=True,
        check=True).stdout.split(), "the core's bookkeeping needs no torch"


def test_messages_cross_the_wire_unchanged() -> None:
    import msgspec

    params = SamplingParams(n=1, temperature=0.7, seed=2**64 - 1, stop=["\n\n"], logit_bias={5: -3.5},
                            stop_token_ids=[2], logprobs=3, min_tokens=2, max_tokens=9)
    add = AddRequests([CoreRequest("r#1", [1, 2, 3], params, (2,), 3, 12.5, prompt_sibling="r#0")])
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(add), type=CoreInput)
    assert back == add and back.requests[0].params.stop_strings == ("\n\n",)
    abort = AbortRequests(["a", "b"])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(abort), type=CoreInput) == abort
    out = CoreOutput("r#1", [7], [{7: Logprob(7, -0.25, 1), 9: Logprob(9, -1.5, 2)}], None, "length", None, 16, 0.01)
    msg = StepOutputs([out], stats=__import__("ruvllm.messages", fromlist=["EngineStats"]).EngineStats(running=1))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=CoreMessage) == msg
