"""agentenv.server.streaming: a blocking iterator served to an async consumer from a thread of its own."""

from __future__ import annotations

import asyncio
import threading

import pytest

from agentenv.server.streaming import iterate


class Source:
    """Items one at a time, each after ``release`` is set; ``interrupt`` as a job's output has it."""

    def __init__(self, n: int, fail: bool = False) -> None:
        self.n, self.fail = n, fail
        self.release = threading.Event()
        self.interrupted = threading.Event()
        self.closed = threading.Event()
        self.taken = 0

    def __iter__(self) -> Source:
        return self

    def __next__(self) -> int:
        if self.taken == 1:  # the second item waits, as a job's output waits for the next frame
            self.release.wait(10)
            if self.interrupted.is_set():
                raise StopIteration
        if self.taken >= self.n:
            if self.fail:
                raise ProcessLookupError("no job 7")
            raise StopIteration
        self.taken += 1
        return self.taken

    def interrupt(self) -> None:
        self.interrupted.set()
        self.release.set()

    def close(self) -> None:
        self.closed.set()


def test_items_then_the_end_or_the_error_as_raised():
    async def collect(src: Source, error=None) -> list[int]:
        src.release.set()
        return [i async for i in iterate(lambda: src, error)]

    assert asyncio.run(collect(Source(3))) == [1, 2, 3]
    with pytest.raises(ProcessLookupError):
        asyncio.run(collect(Source(2, fail=True)))
    with pytest.raises(ValueError, match="mapped"):
        asyncio.run(collect(Source(0, fail=True), lambda e: ValueError(f"mapped {e}")))


def test_a_consumer_that_stops_interrupts_the_iterator_at_once():
    src = Source(5)

    async def first() -> int:
        async for i in iterate(lambda: src):
            return i
        raise AssertionError("nothing")

    assert asyncio.run(first()) == 1
    assert src.interrupted.wait(5) and src.closed.wait(5)
    assert src.taken == 1  # nothing more was taken from the source
