"""Download progress drawn with rich: the loader reports through a hook, the CLI draws.

`rich_progress(console)` is a `loader.hub.ProgressHook`: given a repository id, a context manager
that yields a tqdm look-alike class for huggingface_hub's `snapshot_download(tqdm_class=...)`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, ProgressColumn, Task, TextColumn, TimeRemainingColumn
from rich.text import Text


def rich_progress(console: Console):  # noqa: ANN201  # a ProgressHook
    @contextmanager
    def bars(repo_id: str) -> Iterator[type]:
        """rich allows one live display at a time, and snapshot_download opens several bars at once
        (files, bytes written, bytes received), so every bar becomes a task of a single Progress."""
        columns = (TextColumn("{task.description}"), BarColumn(), _AmountColumn(), TimeRemainingColumn())
        with Progress(*columns, console=console, transient=True) as prog:
            yield _bar_class(prog, repo_id)

    return bars


def _bar_class(prog: Progress, repo_id: str) -> type:
    class _Bar:
        """Just the parts of tqdm that huggingface_hub's snapshot_download calls."""

        def __init__(self, *_args: Any, total: float | None = None, initial: float = 0,
                     desc: str | None = None, unit: str = "it", **_ignored: Any) -> None:
            self.n = initial
            self._total = total
            self._lock = threading.Lock()
            self.format_dict: dict[str, Any] = {"rate": None}  # read for a speed postfix only
            # The "received bytes" bar repeats the "written bytes" one for plain HTTP; show one.
            hidden = (desc or "").startswith("Downloading bytes")
            label = repo_id if unit == "B" else "files"
            self._task = prog.add_task(label, total=total or None, completed=initial, visible=not hidden, unit=unit)

        @property
        def total(self) -> float | None:
            return self._total

        @total.setter
        def total(self, value: float | None) -> None:
            self._total = value
            prog.update(self._task, total=value or None)

        def update(self, n: float | None = 1) -> None:
            with self._lock:
                self.n += n or 0
            prog.update(self._task, advance=n or 0)

        def refresh(self, *_a: Any, **_k: Any) -> None: ...
        def close(self) -> None: ...
        def set_description(self, *_a: Any, **_k: Any) -> None: ...
        def set_description_str(self, *_a: Any, **_k: Any) -> None: ...
        def set_postfix_str(self, *_a: Any, **_k: Any) -> None: ...
        def set_postfix(self, *_a: Any, **_k: Any) -> None: ...

        def __enter__(self) -> _Bar:
            return self

        def __exit__(self, *_exc: Any) -> None:
            return None

    return _Bar


class _AmountColumn(ProgressColumn):
    """Bytes for byte bars ("12.3/40.0 MB"), a count for the files bar ("3/7")."""

    def render(self, task: Task) -> Text:
        if task.fields.get("unit") == "B":
            return DownloadColumn().render(task)
        total = int(task.total) if task.total is not None else "?"
        return Text(f"{int(task.completed)}/{total}")
