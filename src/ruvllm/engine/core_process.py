"""The engine core's own process: load the model, then loop over commands and steps.

Started by ProcessCoreClient as `python -m ruvllm.engine.core_process IN OUT_FD BELL_FD PARENT_PID`
with the pickled EngineConfig on stdin (a fresh interpreter: no forked CUDA or thread state), or
forked from a CoreLauncher, which calls `run_core` itself (core_launcher.py: a process that has
imported the modules and holds no thread or CUDA state; PARENT_PID is then the launcher's). It
connects to the front's command socket (ZeroMQ, IN), writes its own messages as frames on the
inherited socket OUT_FD, ringing the doorbell BELL_FD after each (core_channel.py: no I/O thread
wakes per step), says Ready with the EngineInfo (or
CoreFailed with the load error), and then, until Shutdown: takes every queued command, runs one
step if anything is unfinished, and sends that step's deltas with the stats after it. It leaves on
its own when the front's process is gone (its socket's peer closed, or a new parent), so a killed
server leaves no orphan holding memory.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import sys

import msgspec
import zmq

from ruvllm.config import EngineConfig
from ruvllm.engine.core_channel import FrameWriter
from ruvllm.errors import EngineDeadError
from ruvllm.gc_settings import startup_done

log = logging.getLogger("ruvllm.core")

_IDLE_POLL_S = 0.5  # how often an idle core checks that its front still lives


def run_core(config: EngineConfig, in_addr: str, out_fd: int, bell: int, parent_pid: int) -> None:
    # Ctrl-C reaches the whole process group; the front decides when the core stops. So does a hang-up:
    # a closed terminal ends its front (`ruvllm chat`), and the core then sees its front gone and
    # leaves as that case does, removing the front's folder (killed by SIGHUP, it left the folder).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    level = os.environ.get("RUVLLM_LOG", "WARNING").upper()
    logging.basicConfig(level=int(level) if level.isdigit() else level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from ruvllm.messages import CoreFailed, Ready

    ctx = zmq.Context()
    commands = ctx.socket(zmq.PULL)
    commands.connect(in_addr)
    out = socket.socket(fileno=out_fd)
    out.set_inheritable(False)  # processes the core starts (tensor-parallel ranks) never hold it open
    os.set_inheritable(bell, False)
    results = FrameWriter(out, bell)  # a written frame is the kernel's: it outlives this process's exit
    encoder = msgspec.msgpack.Encoder()
    core = None
    failed = front_gone = False
    # Every way out passes the `finally`: a front killed at any point (even while the model loads,
    # before Ready) has its folder removed here, and the ranks and sockets are closed.
    try:
        try:
            from ruvllm.core.engine_core import EngineCore
            from ruvllm.worker.worker import Worker

            core = EngineCore(Worker.load(config), config)
        except Exception as exc:
            failed = True
            results.send(encoder.encode(CoreFailed(type(exc).__name__, str(exc))))
            return
        results.send(encoder.encode(Ready(core.info, core.stats())))
        startup_done()  # (gc_settings.py) after Ready: the front goes on meanwhile
        front_gone, failed = _serve(core, commands, results, encoder, parent_pid)
    except (BrokenPipeError, ConnectionResetError):
        log.warning("the front closed its end of the core's socket; the engine core leaves")
        front_gone = True
    finally:
        if front_gone:  # a killed front left the folder of its command socket (ProcessCoreClient's);
            # removed first, so that a failure in the closing below cannot leave it
            shutil.rmtree(os.path.dirname(in_addr.removeprefix("ipc://")), ignore_errors=True)
        if core is not None:
            core.close()  # tensor-parallel ranks stop with the core
        _close(ctx, commands, out)
        if failed:
            sys.exit(1)


def _serve(core, commands, results: FrameWriter, encoder: msgspec.msgpack.Encoder,  # noqa: ANN001
           parent_pid: int) -> tuple[bool, bool]:
    """The loop, until Shutdown, the front's end, or a failure: (front gone, failed)."""
    from ruvllm.engine.core_loop import CoreLoop
    from ruvllm.messages import CoreFailed, CoreInput

    def send_from_thread(msg: object) -> None:
        """A message from a thread other than the loop's: its own encoder (the writer's lock keeps
        the frames whole)."""
        results.send(msgspec.msgpack.Encoder().encode(msg))

    decoder = msgspec.msgpack.Decoder(CoreInput)

    def receive(timeout: float | None) -> CoreInput | None:
        if commands.poll(-1 if timeout is None else int(timeout * 1000)):
            return decoder.decode(commands.recv())
        return None

    loop = CoreLoop(core, lambda msg: results.send(encoder.encode(msg)), send_from_thread)
    try:
        while loop.run_once(receive, _IDLE_POLL_S):
            if os.getppid() != parent_pid:
                log.warning("the front process is gone; the engine core leaves")
                return True, False
    except (BrokenPipeError, ConnectionResetError):
        raise  # the caller's: the front is gone
    except Exception as exc:
        log.exception("the engine core failed")
        error = exc if isinstance(exc, EngineDeadError) else f"{type(exc).__name__}: {exc}"
        try:
            results.send(encoder.encode(CoreFailed("EngineDeadError", str(error))))
        except OSError:
            pass  # the front is gone too: nobody to tell
        return False, True
    return False, False


def _close(ctx, commands, out: socket.socket) -> None:  # noqa: ANN001
    commands.close()
    ctx.term()
    out.close()


if __name__ == "__main__":
    import pickle

    from ruvllm.gc_settings import defer_collection

    defer_collection()

    _config = pickle.loads(sys.stdin.buffer.read())
    run_core(_config, sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
