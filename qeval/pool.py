"""Ordered map over a thread pool with a bound on submitted tasks, so memory stays bounded."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def bounded_map(pool: ThreadPoolExecutor, fn: Callable[[T], R], items: Iterable[T], in_flight: int) -> Iterator[R]:
    """Like pool.map, in order, but with at most `in_flight` tasks submitted at any time."""
    pending = []
    for item in items:
        pending.append(pool.submit(fn, item))
        if len(pending) >= in_flight:
            yield pending.pop(0).result()
    for future in pending:
        yield future.result()
