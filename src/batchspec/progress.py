"""One progress bar for every long job (generation, audits, benchmarks, load tests): a rich bar with a description,
a count and the time elapsed, removed when done; a no-op object when disabled, so callers never branch on it. It is
drawn on stderr, so that stdout carries only results (``batchspec generate`` without ``--out`` writes JSON lines
there)."""

from __future__ import annotations


class Progress:
    """``with Progress(enabled, total, "what") as bar: bar.advance(); bar.describe("now this")``."""

    def __init__(self, enabled: bool, total: int, description: str = ""):
        self._p = self._task = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as Bar

            self._p = Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          transient=True, console=Console(stderr=True))
            self._task = self._p.add_task(description, total=total)

    def __enter__(self) -> "Progress":
        if self._p is not None:
            self._p.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._p is not None:
            self._p.stop()

    def advance(self, n: int = 1) -> None:
        if self._p is not None:
            self._p.advance(self._task, n)

    def describe(self, text: str) -> None:
        if self._p is not None:
            self._p.update(self._task, description=text)

    def update(self, completed: int, description: str | None = None) -> None:
        """Set the count (and the description) outright."""
        if self._p is not None:
            self._p.update(self._task, completed=completed,
                           **({"description": description} if description is not None else {}))
