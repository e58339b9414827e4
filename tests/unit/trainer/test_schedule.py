"""trainer.loop.schedule on its own: k = 0 alternates play and train; with k >= 1 play runs ahead, never more than
k + 1 batches past the last step taken; a failed producer's error reaches the caller."""

import asyncio

import pytest

from trainer.loop import schedule


def _run(total: int, k: int, fail_at: int | None = None) -> list[tuple[str, int, int]]:
    """Events (what, batch number, steps done) of a run whose play and train each yield to the loop."""
    events: list[tuple[str, int, int]] = []
    steps = {"done": 0, "played": 0}

    async def produce() -> int:
        n = steps["played"]
        if n == fail_at:
            raise ValueError("play failed")
        await asyncio.sleep(0.001)
        steps["played"] += 1
        events.append(("play", n, steps["done"]))
        return n

    async def train(batch: int, version: int) -> None:
        assert version <= steps["done"]  # the version the batch was played under is not from the future
        await asyncio.sleep(0.003)
        events.append(("train", batch, steps["done"]))
        steps["done"] += 1

    asyncio.run(schedule.run(total, k, lambda: steps["done"], lambda: steps["done"], produce, train))
    return events


def test_synchronous_play_and_train_alternate():
    events = _run(3, 0)
    assert [(e[0], e[1]) for e in events] == [("play", 0), ("train", 0), ("play", 1), ("train", 1),
                                               ("play", 2), ("train", 2)]


@pytest.mark.parametrize("k", [1, 2])
def test_play_runs_ahead_by_at_most_k_plus_one(k):
    events = _run(6, k)
    assert [e[1] for e in events if e[0] == "train"] == list(range(6))  # every batch trained once, in order
    assert sorted(e[1] for e in events if e[0] == "play") == list(range(6))
    assert 0 < max(n - done for what, n, done in events if what == "play") <= k  # ahead, and bounded


def test_a_failed_producer_fails_the_run():
    with pytest.raises(ValueError, match="play failed"):
        _run(5, 1, fail_at=2)
