"""Progress bars on stderr: the one way long runs (capture, compare, matrix, merge, tasks) show progress."""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator


def say(line: str, enabled: bool = True) -> None:
    """One line on stderr before a long run starts (what it will write, how long it may take), beside its bars;
    stdout stays the command's result."""
    if enabled:
        print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def progress_bar(description: str, total: int | None, enabled: bool = True) -> Iterator:
    """Yield advance(n) for a rich progress bar on stderr (no-op when disabled)."""
    if not enabled:
        yield lambda n=1: None
        return
    from rich.console import Console  # noqa: PLC0415 - rich loads only when a bar is shown
    from rich.progress import (  # noqa: PLC0415
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("eta"), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n=1: bar.advance(task, n)


class PlannedProgress:
    """A bar whose total is known only once a run has planned its work (a resumed capture knows how much is
    already done): the run calls on_plan(total, done) once, then advance(n) per unit of work. `on_unit`, when
    given, receives the units instead of a bar (tests and notebooks count with it)."""

    def __init__(self, stack: contextlib.ExitStack, description: str, enabled: bool, on_unit=None):
        self._stack, self._description, self._enabled = stack, description, enabled
        self._advance = on_unit

    def on_plan(self, total: int, done: int) -> None:
        if self._advance is None:
            self._advance = self._stack.enter_context(progress_bar(self._description, total, self._enabled))
        self._advance(done)

    def advance(self, n: int = 1) -> None:
        self._advance(n)
