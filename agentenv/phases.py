"""Where the milliseconds of a sandbox operation go: named phases, timed only while someone records them.

A fork or a restore is a chain of steps (freeze, copying or cloning the files, the CRIU dump, runc, the
keeper's first answer); making them fast starts with knowing which one costs what on a given machine.
``phase("fs")`` marks a step; ``recording()`` collects every phase that any thread of this process runs
until it ends (a fork starts its children in threads), which ``bench.sandbox`` prints as a breakdown.
Nothing is timed and nothing is kept while no one records: a marked step then costs one global read.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Phase:
    """One timed step: its name, when it started (``time.perf_counter``) and how long it took, in seconds."""

    name: str
    start: float
    seconds: float


_lock = threading.Lock()
_recorders: list[list[Phase]] = []


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Time the block as the phase ``name`` for every recorder open now (none: nothing is timed)."""
    if not _recorders:
        yield
        return
    t0 = time.perf_counter()
    try:
        yield
    finally:
        done = Phase(name, t0, time.perf_counter() - t0)
        with _lock:
            for rec in _recorders:
                rec.append(done)


def note(name: str, seconds: float) -> None:
    """Record a step timed by someone else (CRIU's own account of a dump) as the phase ``name``, ending now."""
    if not _recorders:
        return
    done = Phase(name, time.perf_counter() - seconds, seconds)
    with _lock:
        for rec in _recorders:
            rec.append(done)


@contextlib.contextmanager
def recording() -> Iterator[list[Phase]]:
    """Collect the phases that run (in any thread) until the block ends, in the order they ended."""
    rec: list[Phase] = []
    with _lock:
        _recorders.append(rec)
    try:
        yield rec
    finally:
        with _lock:
            _recorders.remove(rec)


def totals(found: list[Phase]) -> dict[str, float]:
    """Seconds per phase name, summed over its occurrences (a fork of 8 starts 8 children)."""
    out: dict[str, float] = {}
    for p in found:
        out[p.name] = out.get(p.name, 0.0) + p.seconds
    return out


def spans(found: list[Phase]) -> dict[str, float]:
    """Seconds per phase name from its first start to its last end: the wall-clock time it covered (less than
    the sum where its occurrences ran in parallel threads)."""
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    for p in found:
        first[p.name] = min(first.get(p.name, p.start), p.start)
        last[p.name] = max(last.get(p.name, 0.0), p.start + p.seconds)
    return {name: last[name] - first[name] for name in first}
