"""A burst of concurrent creates: every sandbox starts, each is independent of the others, the admission
bound (``agentenv.host.admission``) is honoured, and a warm pool (``agentenv.sandbox.warm``) hands out started sandboxes
that are independent too and leaves nothing behind once drained."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import agentenv
from agentenv.api import DEFAULT_TTL
from agentenv.host import admission
from agentenv.sandbox import warm

pytestmark = pytest.mark.integration

N = 12


def _burst(n: int) -> list[agentenv.Sandbox]:
    with ThreadPoolExecutor(n) as ex:
        futures = [ex.submit(agentenv.Sandbox.create, memory="256m", labels={"burst": str(i)}) for i in range(n)]
        return [f.result() for f in futures]


def _independent(sbs: list[agentenv.Sandbox]) -> None:
    for i, sb in enumerate(sbs):
        sb.write_file("/testbed/who", str(i))
    for i, sb in enumerate(sbs):
        assert sb.read_file("/testbed/who") == str(i).encode()
    assert len({sb.id for sb in sbs}) == len(sbs)


def test_a_burst_of_creates_all_start_independent_within_the_bound():
    admission.set_limit(3)
    sbs: list[agentenv.Sandbox] = []
    try:
        sbs = _burst(N)
        assert admission.peak() <= 3
        assert all(sb.exec("true").ok for sb in sbs)
        _independent(sbs)
        assert sorted(sb.labels["burst"] for sb in sbs) == sorted(str(i) for i in range(N))
    finally:
        admission.set_limit(None)
        for sb in sbs:
            sb.close()
    assert agentenv.Sandbox.list() == []


def test_a_warm_pool_hands_out_started_independent_sandboxes_and_drains_clean():
    warm.configure("agentenv/base", 4, memory="256m")
    sbs: list[agentenv.Sandbox] = []
    try:
        assert warm.wait_full(120)
        pooled = {sb.id for sb in agentenv.Sandbox.list()}
        other = agentenv.Sandbox.create(memory="512m")  # other limits: not from the pool
        sbs.append(other)
        assert other.id not in pooled
        before = time.time()
        sbs += _burst(4)
        after = time.time()
        assert {sb.id for sb in sbs[1:]} <= pooled  # all four from the pool
        assert all(sb.labels.get("agentenv.kind") != warm.KIND and "burst" in sb.labels for sb in sbs[1:])
        # the caller's deadline (the default), set when taken: not the pool's idle one
        assert all(before + DEFAULT_TTL <= (sb.expires_at or 0) <= after + DEFAULT_TTL for sb in sbs[1:])
        _independent(sbs)
    finally:
        warm.drain()
        for sb in sbs:
            sb.close()
    assert agentenv.Sandbox.list() == []
