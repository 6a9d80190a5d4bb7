"""The feedback events waiting for the server's one update thread, learned a backlog at a time
(issue 37 item 3): each time the thread is free it takes every event waiting and hands them to the
learner together, which learns each tenant's in steps of several events (Learner.feedback_many), so
that when learning falls behind it catches up in fewer steps rather than staying behind. A single
waiting event is learned alone, as it always was. Each event's request waits on its own future and
gets its own answer (or its own error)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Generic, TypeVar

from ruvllm.learning.background import learning_thread

E = TypeVar("E")
R = TypeVar("R")


class Backlog(Generic[E, R]):
    """A thread (at `nice`) that runs `learn` over the events waiting, all of them each time it is
    free; `learn` yields (index, result or exception) as each event is done."""

    def __init__(self, learn: Callable[[list[E]], Iterable[tuple[int, R | Exception]]], nice: int) -> None:
        self._learn, self._nice = learn, nice
        self._waiting: list[tuple[E, Future[R]]] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ruvllm-learning", daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        """Events waiting for the thread to take them (those it is learning not counted)."""
        with self._cond:
            return len(self._waiting)

    def submit(self, event: E) -> Future[R]:
        future: Future[R] = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the update thread is closed")
            self._waiting.append((event, future))
            self._cond.notify()
        return future

    def close(self) -> None:
        """Learn what is waiting, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        learning_thread("ruvllm-learn", self._nice)
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if not self._waiting:
                    return
                taken, self._waiting = self._waiting, []
            # a request that went away before its turn (its future cancelled) is not learned, as a
            # cancelled executor job was not run
            taken = [(e, f) for e, f in taken if f.set_running_or_notify_cancel()]
            done = set()
            try:
                for i, result in self._learn([e for e, _ in taken]):
                    done.add(i)
                    future = taken[i][1]
                    if isinstance(result, Exception):
                        future.set_exception(result)
                    else:
                        future.set_result(result)
            except Exception as exc:  # noqa: BLE001  # whatever failed, no request waits forever
                failure: Exception = exc
            else:
                failure = RuntimeError("the update thread gave this feedback event no result")
            for i, (_, future) in enumerate(taken):
                if i not in done:
                    future.set_exception(failure)
