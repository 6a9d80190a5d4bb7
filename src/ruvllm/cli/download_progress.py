"""Download progress drawn with rich: the loader reports through a hook, the CLI draws.

`rich_progress(console)` is a `loader.hub.ProgressHook`: given a repository id, a context manager
that yields a tqdm look-alike class for huggingface_hub's `snapshot_download(tqdm_class=...)`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, ProgressColumn, Task, TextColumn, TimeRemainingColumn
from rich.text import Text

from ruvllm.loader.hub import TqdmBar


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
    class _Bar(TqdmBar):
        def started(self) -> None:
            label = repo_id if self.unit == "B" else "files"
            self._task = prog.add_task(label, total=self.total or None, completed=self.n,
                                       visible=not self.repeats_bytes, unit=self.unit)

        def total_changed(self, value: float | None) -> None:
            prog.update(self._task, total=value or None)

        def advanced(self, n: float) -> None:
            prog.update(self._task, advance=n)

    return _Bar


class _AmountColumn(ProgressColumn):
    """Bytes for byte bars ("12.3/40.0 MB"), a count for the files bar ("3/7")."""

    def render(self, task: Task) -> Text:
        if task.fields.get("unit") == "B":
            return DownloadColumn().render(task)
        total = int(task.total) if task.total is not None else "?"
        return Text(f"{int(task.completed)}/{total}")
