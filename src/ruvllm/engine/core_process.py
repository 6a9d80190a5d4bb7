"""The engine core's own process: load the model, then loop over commands and steps.

Started by ProcessCoreClient as `python -m ruvllm.engine.core_process IN OUT PARENT_PID` with the
pickled EngineConfig on stdin (a fresh interpreter: no forked CUDA or thread state). It connects to the front's two sockets, says Ready with the EngineInfo (or
CoreFailed with the load error), and then, until Shutdown: takes every queued command, runs one
step if anything is unfinished, and sends that step's deltas with the stats after it. It leaves on
its own when the front's process is gone, so a killed server leaves no orphan holding memory.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

import msgspec
import zmq

from ruvllm.config import EngineConfig
from ruvllm.errors import EngineDeadError, RuvllmError

log = logging.getLogger("ruvllm.core")

_IDLE_POLL_MS = 500  # how often an idle core checks that its front still lives


def run_core(config: EngineConfig, in_addr: str, out_addr: str, parent_pid: int) -> None:
    # Ctrl-C reaches the whole process group; the front decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    level = os.environ.get("RUVLLM_LOG", "WARNING").upper()
    logging.basicConfig(level=int(level) if level.isdigit() else level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from ruvllm.messages import CoreFailed, CoreInput, Ready

    ctx = zmq.Context()
    commands = ctx.socket(zmq.PULL)
    commands.connect(in_addr)
    results = ctx.socket(zmq.PUSH)
    results.setsockopt(zmq.LINGER, 5000)  # the last message (a failure) must get out before exit
    results.connect(out_addr)
    encoder = msgspec.msgpack.Encoder()
    try:
        from ruvllm.core.engine_core import EngineCore
        from ruvllm.worker.worker import Worker

        core = EngineCore(Worker(config), config)
    except Exception as exc:
        results.send(encoder.encode(CoreFailed(type(exc).__name__, str(exc))))
        _close(ctx, commands, results)
        sys.exit(1)
    results.send(encoder.encode(Ready(core.info, core.stats())))

    def send_from_thread(msg: object) -> None:
        """A message from a thread other than the loop's (a socket is one thread's): its own socket."""
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 5000)
        sock.connect(out_addr)
        sock.send(msgspec.msgpack.Encoder().encode(msg))
        sock.close()

    try:
        _serve(core, commands, results, encoder, msgspec.msgpack.Decoder(CoreInput), parent_pid, send_from_thread)
    except Exception as exc:
        log.exception("the engine core failed")
        error = exc if isinstance(exc, EngineDeadError) else f"{type(exc).__name__}: {exc}"
        results.send(encoder.encode(CoreFailed("EngineDeadError", str(error))))
        core.close()
        _close(ctx, commands, results)
        sys.exit(1)
    core.close()  # tensor-parallel ranks stop with the core
    _close(ctx, commands, results)


def _serve(core, commands, results, encoder, decoder, parent_pid: int, send_from_thread) -> None:  # noqa: ANN001
    from ruvllm.engine.core_client import add_requests, load_adapter_beside_the_loop, run_utility
    from ruvllm.messages import AbortRequests, AddRequests, Shutdown, StepOutputs, Utility, UtilityResult

    def result(call_id: int, error: BaseException | None) -> UtilityResult:
        return UtilityResult(call_id, core.stats(), None if error is None else str(error),
                             None if error is None else type(error).__name__)

    def answer(call_id: int, error: BaseException | None) -> None:
        results.send(encoder.encode(result(call_id, error)))

    def send_outputs(outputs: list) -> None:  # noqa: ANN001
        results.send(encoder.encode(StepOutputs(outputs, core.stats())))

    while True:
        timeout = 0 if core.has_unfinished else _IDLE_POLL_MS
        did_something = False
        while commands.poll(timeout):
            timeout = 0
            did_something = True
            msg = decoder.decode(commands.recv())
            if isinstance(msg, AddRequests):
                add_requests(core, msg.requests, send_outputs)
            elif isinstance(msg, AbortRequests):
                core.abort(msg.request_ids)
            elif isinstance(msg, Utility):
                if msg.method == "load_lora" and len(msg.args) == 2:
                    load_adapter_beside_the_loop(core, msg.args[0], msg.args[1], lambda exc, call_id=msg.call_id:
                                                 send_from_thread(result(call_id, exc)))
                    continue
                try:
                    run_utility(core, msg.method, msg.args)
                except (ValueError, RuvllmError) as exc:
                    answer(msg.call_id, exc)
                else:
                    answer(msg.call_id, None)
            elif isinstance(msg, Shutdown):
                return
        if os.getppid() != parent_pid:
            log.warning("the front process is gone; the engine core leaves")
            return
        if core.has_unfinished:
            outputs = core.step()
            results.send(encoder.encode(StepOutputs(outputs, core.stats())))
        elif did_something:
            results.send(encoder.encode(StepOutputs([], core.stats())))


def _close(ctx, *sockets) -> None:  # noqa: ANN001
    for s in sockets:
        s.close()
    ctx.term()


if __name__ == "__main__":
    import pickle

    _config = pickle.loads(sys.stdin.buffer.read())
    run_core(_config, sys.argv[1], sys.argv[2], int(sys.argv[3]))
