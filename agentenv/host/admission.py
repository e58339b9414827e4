"""Admission control: a bound on the sandboxes of this process that are starting at once.

A start (create, restore, resume, a fork's child) is CPU work from end to end: the layer, the bundle, runc
and the kernel making the namespaces and cgroup, the keeper's interpreter coming up. A burst of 64 creates
on a machine of a few cores run all at once makes each of them wait behind all the others, so the first
command of every one is answered late, and some time out. With a bound the burst queues instead: the
first sandboxes start at full speed and the last ones are no later than they would have been.

The bound is ``$AGENTENV_MAX_STARTING`` (a positive integer), else twice the CPU count (at least 2);
``set_limit`` changes it for this process. It is per process (the env server is one); the wait shows as
the phase "admission" (``agentenv.phases``) and does not count against a start's timeout.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

from agentenv.phases import phase

LIMIT_ENV = "AGENTENV_MAX_STARTING"

P = ParamSpec("P")
R = TypeVar("R")


def default_limit() -> int:
    """``$AGENTENV_MAX_STARTING``, else twice the CPUs this process may use (at least 2)."""
    raw = os.environ.get(LIMIT_ENV, "").strip()
    if raw:
        n = int(raw) if raw.isdigit() else 0
        if n < 1:
            raise ValueError(f"${LIMIT_ENV} must be a positive integer, got {raw!r}")
        return n
    return max(2, 2 * len(os.sched_getaffinity(0)))


class _Admission:
    """A counting bound that can be changed while sandboxes wait on it (a semaphore cannot)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._limit: int | None = None  # read from the environment on first use
        self.starting = 0
        self.waiting = 0  # starts queued for a slot now
        self.peak = 0  # the most starting at once since the last ``set_limit`` (for tests and benchmarks)

    @property
    def limit(self) -> int:
        with self._cond:
            if self._limit is None:
                self._limit = default_limit()
            return self._limit

    def set_limit(self, n: int | None) -> None:
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"the bound on starting sandboxes must be a positive integer, got {n!r}")
        with self._cond:
            self._limit = n
            self.peak = self.starting
            self._cond.notify_all()

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        with phase("admission"), self._cond:  # the condition's lock is reentrant: ``limit`` may take it
            self.waiting += 1
            try:
                while self.starting >= self.limit:
                    self._cond.wait()
            finally:
                self.waiting -= 1
            self.starting += 1
            self.peak = max(self.peak, self.starting)
        try:
            yield
        finally:
            with self._cond:
                self.starting -= 1
                self._cond.notify()


_admission = _Admission()


def limit() -> int:
    """How many sandboxes of this process may be starting at once."""
    return _admission.limit


def set_limit(n: int | None) -> None:
    """Bound the sandboxes starting at once in this process to ``n`` (None: back to ``default_limit``)."""
    _admission.set_limit(n)


def queue() -> tuple[int, int]:
    """The sandboxes of this process starting now and those queued for a slot (the admission queue)."""
    with _admission._cond:
        return _admission.starting, _admission.waiting


def peak() -> int:
    """The most sandboxes of this process that were starting at once since the last ``set_limit``."""
    return _admission.peak


def admitted(start: Callable[P, R]) -> Callable[P, R]:
    """Run ``start`` (a sandbox's start path) only once a slot is free; the slot is held until it returns."""
    @functools.wraps(start)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with _admission.slot():
            return start(*args, **kwargs)
    return wrapper
