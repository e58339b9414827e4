"""bench.burst's modes: every iteration is counted once, a failure is no sample, a burst releases all at once."""

from __future__ import annotations

import threading

import pytest

from bench.burst import run_mode
from bench.harness import Result


def _iterations(fail_every: int = 0):
    lock = threading.Lock()
    state = {"calls": 0, "closed": 0, "live": 0, "peak": 0}
    gate = threading.Barrier(4, timeout=30)

    def it():
        with lock:
            state["calls"] += 1
            n = state["calls"]
            state["live"] += 1
            state["peak"] = max(state["peak"], state["live"])
        if state.get("barrier"):
            gate.wait()  # four at once only if the burst released them together
        with lock:
            state["live"] -= 1
        if fail_every and n % fail_every == 0:
            raise RuntimeError("no room")

        def close():
            with lock:
                state["closed"] += 1
        return 0.01 * n, close
    return it, state


@pytest.mark.parametrize("mode", ["sequential", "staggered", "burst"])
def test_each_iteration_counts_once_and_failures_are_not_samples(mode):
    it, state = _iterations(fail_every=3)
    r = Result()
    run_mode(r, it, mode, 9, stagger=0.0)
    assert state["calls"] == 9 and state["closed"] == 6 and len(r.samples) == 6
    assert r.fields["success_rate"] == round(6 / 9, 4) and r.fields["failures"] == 3
    assert r.note is not None and "3 of 9 failed" in r.note and "no room" in r.note
    assert r.fields["p95_ms"] is not None


def test_a_burst_releases_its_iterations_together():
    it, state = _iterations()
    state["barrier"] = 1
    r = Result()
    run_mode(r, it, "burst", 4, stagger=0.0)  # a barrier of 4 would time out if they ran one by one
    assert len(r.samples) == 4 and state["peak"] == 4 and r.fields["success_rate"] == 1.0
