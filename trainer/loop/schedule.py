"""When rollouts and training steps run, under bounded staleness ``k`` (``rl.max_staleness``).

``k = 0`` is synchronous and on-policy: a batch is played under the current weights, then trained on, strictly
alternating. With ``k >= 1`` a producer plays batches ahead of the trainer, at most ``k + 1`` beyond the last
step taken (the one being trained and the next ``k``), and queues them; the trainer takes them in order. Which
trajectories are then too stale to train on is ``trainer.algorithm.batch.filter_stale``'s call, not this module's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

B = TypeVar("B")


async def run(total: int, max_staleness: int, done: Callable[[], int], version: Callable[[], int],
              produce: Callable[[], Awaitable[B]], train: Callable[[B, int], Awaitable[object]]) -> None:
    """Play and train until ``done()`` (steps taken, which ``train`` advances) reaches ``total``.

    ``produce()`` plays one batch; ``train(batch, v)`` takes a step on it, ``v`` being ``version()`` (the
    weights' version) when its play began."""
    if max_staleness == 0:
        while done() < total:
            v = version()
            await train(await produce(), v)
        return
    queue: asyncio.Queue[tuple[B, int]] = asyncio.Queue()
    progressed = asyncio.Event()
    produced = done()

    async def producer() -> None:
        nonlocal produced
        while produced < total:
            if produced - done() >= max_staleness + 1:  # the batch being trained and the next k are out: wait
                progressed.clear()
                await progressed.wait()
                continue
            v = version()
            batch = await produce()
            produced += 1
            await queue.put((batch, v))

    task = asyncio.create_task(producer())
    try:
        while done() < total:
            getter = asyncio.ensure_future(queue.get())
            finished, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in finished:
                getter.cancel()
                task.result()  # the producer failed: raise its error
                raise RuntimeError("the rollout producer stopped early")
            batch, v = getter.result()
            await train(batch, v)
            progressed.set()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
