"""The admission bound on starting sandboxes (``agentenv.host.admission``): honoured under a burst, sized from the
environment or the CPU count, and changeable while starts wait."""

from __future__ import annotations

import threading
import time

import pytest

from agentenv.host import admission


@pytest.fixture(autouse=True)
def default_bound():
    yield
    admission.set_limit(None)


def _burst(n: int, hold: float) -> int:
    """``n`` admitted starts at once, each holding its slot ``hold`` seconds; the most that ran together."""
    inside, most, lock = [0], [0], threading.Lock()

    @admission.admitted
    def start() -> None:
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(hold)
        with lock:
            inside[0] -= 1

    threads = [threading.Thread(target=start) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    return most[0]


def test_a_burst_queues_behind_the_bound_and_every_start_runs():
    admission.set_limit(3)
    assert _burst(12, 0.02) == 3 and admission.peak() == 3


def test_raising_the_bound_lets_waiting_starts_in():
    admission.set_limit(1)
    done = threading.Event()

    @admission.admitted
    def slow() -> None:
        done.wait(5)

    first = threading.Thread(target=slow)
    first.start()
    time.sleep(0.05)
    second = threading.Thread(target=admission.admitted(lambda: None))
    second.start()
    time.sleep(0.05)
    assert second.is_alive()  # queued behind the one slot
    admission.set_limit(2)
    second.join(2)
    assert not second.is_alive()
    done.set()
    first.join(2)


def test_the_bound_comes_from_the_environment_or_the_cpus(monkeypatch):
    monkeypatch.setenv(admission.LIMIT_ENV, "5")
    assert admission.default_limit() == 5
    monkeypatch.setenv(admission.LIMIT_ENV, "zero")
    with pytest.raises(ValueError, match=admission.LIMIT_ENV):
        admission.default_limit()
    monkeypatch.delenv(admission.LIMIT_ENV)
    assert admission.default_limit() >= 2
    with pytest.raises(ValueError):
        admission.set_limit(0)


def test_the_queue_counts_starts_running_and_waiting():
    admission.set_limit(1)
    release = threading.Event()
    entered = threading.Event()

    @admission.admitted
    def held() -> None:
        entered.set()
        release.wait(10)

    threads = [threading.Thread(target=held) for _ in range(3)]
    for t in threads:
        t.start()
    assert entered.wait(5)
    deadline = time.monotonic() + 5
    while admission.queue() != (1, 2):  # wait on state: the two others queued behind the one slot
        assert time.monotonic() < deadline, f"the queue says {admission.queue()}"
        time.sleep(0.01)
    release.set()
    for t in threads:
        t.join(5)
    assert admission.queue() == (0, 0)
