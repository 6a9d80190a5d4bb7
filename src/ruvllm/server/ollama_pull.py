"""Ollama's /api/pull, its download side: the model fetched into the model cache through
loader/hub.py on a thread, as `ruvllm download` does, its byte bars turned into Ollama's progress
lines, and its failures into statuses. What it fetches is served by a server started on it
(`ruvllm serve NAME`), not by this one."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import Request

from ruvllm.errors import ModelLoadError
from ruvllm.loader.hub import TqdmBar
from ruvllm.server.errors import APIError, api_error

PROGRESS_EVERY_S = 0.25  # a pull's progress lines, at most this often per file bar
# What a download hands its reader, in order: progress lines, then None (done) or the exception it ended on
Line = dict[str, Any] | BaseException | None


class _PullProgress:
    """A loader.hub ProgressHook that turns huggingface_hub's byte bars into Ollama's progress lines,
    handed from the download's thread to the event loop (`emit`)."""

    def __init__(self, emit: Any) -> None:
        self.emit = emit

    def __call__(self, repo_id: str) -> Any:
        @contextmanager
        def bars() -> Iterator[type]:
            yield _bar_class(repo_id, self.emit)

        return bars()


def _bar_class(repo_id: str, emit: Any) -> type:
    class _Bar(TqdmBar):
        """Only byte bars report (the count of files says nothing Ollama's lines can carry), and the
        one repeating received bytes is quiet."""

        def started(self) -> None:
            self._sent = 0.0

        def advanced(self, n: float) -> None:
            now = time.monotonic()
            done = self.total is not None and self.n >= self.total
            if self.unit != "B" or self.repeats_bytes or (now - self._sent < PROGRESS_EVERY_S and not done):
                return
            self._sent = now
            line = {"status": f"pulling {repo_id}", "completed": int(self.n)}
            if self.total:
                line["total"] = int(self.total)
            emit(line)

    return _Bar


def pull_error(exc: BaseException) -> APIError:
    """A failed pull as its status: a name that is no model here or on the Hub is the request's
    fault; a Hub that cannot be reached is not (502)."""
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    from ruvllm.loader.hub import HubError

    if isinstance(exc, ValueError):
        return APIError(400, str(exc), "model")
    if isinstance(exc, HubError):
        # hub.py raises its one-line HubError `from None` inside the handler of huggingface_hub's
        # error, which stays its __context__: what the Hub said
        cause = exc.__context__
        if isinstance(cause, (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError)):
            return APIError(404, f"pull model manifest: {exc}", "model", "model_not_found")
        if isinstance(cause, GatedRepoError):
            return APIError(403, str(exc), "model")
        if cause is None:  # the repository is there but holds nothing ruvllm reads
            return APIError(400, str(exc), "model")
        return APIError(502, str(exc))
    if isinstance(exc, ModelLoadError):
        return APIError(400, str(exc), "model")
    return api_error(exc)


def _pull_lock(request: Request) -> asyncio.Lock:
    """One pull at a time per server: two of one model would share its download folder."""
    lock = getattr(request.app.state, "ollama_pull_lock", None)
    if lock is None:
        lock = request.app.state.ollama_pull_lock = asyncio.Lock()
    return lock


def start_download(request: Request, name: str) -> tuple[asyncio.Task[None], asyncio.Queue[Line]]:
    """`name` downloading on a thread (after any pull before it: one at a time per server), and the
    queue its lines come in. It runs to its end even if the client leaves: a half-pull resumes anyway."""
    from ruvllm.loader import hub

    loop = asyncio.get_running_loop()
    lines: asyncio.Queue[Line] = asyncio.Queue()
    progress = _PullProgress(lambda line: loop.call_soon_threadsafe(lines.put_nowait, line))

    async def download() -> None:
        async with _pull_lock(request):
            try:
                # a variant that must be converted (int4 of a safetensors model) needs the CLI's
                # converter, which runs for minutes: refused here (ValueError) rather than run in the server
                await asyncio.to_thread(hub.download, name, progress=progress)
            except BaseException as exc:  # told to the reader; the download thread has ended
                lines.put_nowait(exc)
                return
        lines.put_nowait(None)

    return asyncio.create_task(download()), lines
