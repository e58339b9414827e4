"""The grading worker threads, and the phase timer every grading records (``GradeResult.timings``).

A grading overlaps its slow steps: the grading sandbox is restored (or set up) while the patch is being
extracted, a 4.x eval script is built by the official process meanwhile, a task's hidden files are packed from
its image, and grading sandboxes are closed after the result is returned (``SWEEnv`` waits for them at close).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from agentenv.api import SandboxLike

_T = TypeVar("_T")
_POOL = ThreadPoolExecutor(max_workers=16, thread_name_prefix="agentenv-grade")


class Timer:
    """Seconds per phase of one grading, in the order they ran (a phase may be lapped more than once)."""

    def __init__(self) -> None:
        self.t = time.monotonic()
        self.phases: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.phases[name] = self.phases.get(name, 0.0) + now - self.t
        self.t = now


def run_in_background(fn: Callable[..., _T], *args: Any) -> Future[_T]:
    """``fn(*args)`` on the grading worker threads."""
    return _POOL.submit(fn, *args)


def close_later(sandbox: SandboxLike) -> Future[None]:
    """Close ``sandbox`` on a worker thread (the caller waits for the future when it must, e.g. at env close)."""
    return _POOL.submit(sandbox.close)


def close_started(f: Future[tuple[SandboxLike, Any]]) -> None:
    """Close the sandbox a start future (``(sandbox, ...)``) made, once it is made; nothing when the start failed."""
    if f.exception() is None:  # waits for it
        f.result()[0].close()
