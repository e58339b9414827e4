"""A blocking iterator served as an async one, off the event loop's thread pool.

A stream (a job's output, a directory watch) can last as long as the command does, so it gets a thread of
its own rather than one of the event loop's few pool threads, and hands items over through a bounded queue:
a client that stops reading (a background command's handle never reads) stops the thread, the output stays
buffered in the sandbox's keeper, and nothing grows without bound on the server. The native routes
(``routes/jobs.py``) and E2B's services (``e2b/bridge.py``) both stream this way.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")
QUEUE = 64  # items a stream may run ahead of its client
_DONE = object()


async def iterate(make: Callable[[], Iterator[T]],
                  error: Callable[[BaseException], BaseException] | None = None) -> AsyncIterator[T]:
    """Run the iterator ``make()`` returns in a thread of its own; stop it when the consumer stops.

    What it raises is raised here (as ``error(exc)`` when given). When the consumer stops first, the iterator's
    ``interrupt()`` (where it has one, as a job's ``output`` does) is called at once, so that it takes nothing
    more from the sandbox (a job's end it read would be lost to the next reader); otherwise the thread notices
    at its next item (the sandbox's keeper sends a heartbeat every few seconds, so that is soon). The iterator
    is closed, which closes its keeper connection.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue(QUEUE)
    stop = threading.Event()
    made: list[Iterator[T]] = []  # what make() returned, once it did

    def put(item: Any) -> bool:
        while not stop.is_set():
            fut = asyncio.run_coroutine_threadsafe(queue.put(item), loop)
            try:
                fut.result(timeout=1.0)
                return True
            except TimeoutError:
                fut.cancel()
            except RuntimeError:  # the loop is gone: the server is stopping
                return False
        return False

    def run() -> None:
        it: Iterator[T] | None = None
        try:
            it = make()
            made.append(it)
            if stop.is_set():  # the consumer left while it was made (it reads made after setting stop)
                return
            for item in it:
                if not put(item) or stop.is_set():
                    break
            put(_DONE)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            put(e)
        finally:
            if it is not None and hasattr(it, "close"):
                with contextlib.suppress(Exception):
                    it.close()

    threading.Thread(target=run, name="agentenv-stream", daemon=True).start()
    try:
        while True:
            item = await queue.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                if error is None:
                    raise item
                raise error(item) from item
            yield item
    finally:
        stop.set()
        for it in made:
            interrupt = getattr(it, "interrupt", None)
            if interrupt is not None:
                interrupt()
        with contextlib.suppress(asyncio.QueueEmpty):
            while True:
                queue.get_nowait()  # unblock a put in flight
