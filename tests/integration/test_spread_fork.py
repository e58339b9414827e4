"""A pool's fork spread over two real servers (separate homes): the source's server, with room for fewer than
``n``, gets what fits, the other restores the rest from a snapshot it pulls; every child has the parent's
processes (their memory) and files, they diverge, and nothing the fork made stays (nor after a failed one)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import agentenv
from agentenv.errors import QuotaExceeded, SandboxStateError, TransferError

from .server_fixtures import TOKEN, separate_servers
from .test_transfer import Proxy, has_memory, holder


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[list[str], list[Path]]]:
    with separate_servers(("3", "4", "4"), "agentenv-spread-") as found:  # A: the parent and 2 children
        yield found


@pytest.fixture
def parent(servers) -> Iterator[tuple[agentenv.Pool, agentenv.remote.client.RemoteSandbox, bytes]]:
    urls, homes = servers
    with agentenv.Pool(urls, TOKEN) as pool:
        sb = pool.clients[0].Sandbox.create(memory="256m", labels={"run": "spread"})
        sb.write_file("/srv/data.bin", os.urandom(300_000))
        holder(sb, "s3cret")
        try:
            yield pool, sb, sb.read_file("/srv/data.bin")
        finally:
            sb.close()
            for c in pool.clients:  # what the fork made and left: a failure below
                left = [s.id for s in c.Sandbox.list()] + [s.id for s in c.Snapshot.list()]
                for s in c.Sandbox.list():
                    s.close()
                assert not left, f"{c.url} kept {left}"
            for home in homes:
                assert not list((home / "exports").glob("*")), "a packed archive stayed on the source"


def test_fork_spreads_children_over_servers_with_memory_and_files(parent):
    pool, sb, data = parent
    kids = sb.fork(4)
    try:
        assert [k.client.url for k in kids].count(pool.clients[0].url) == 2  # what fits beside the parent
        assert [k.client.url for k in kids].count(pool.clients[1].url) == 2  # the roomiest other (tied: the first)
        for i, k in enumerate(kids):
            assert k.labels == {"run": "spread"}
            assert k.read_file("/srv/data.bin") == data
            has_memory(k, "s3cret")  # the holder process and its memory came along, on either server
            k.write_file("/srv/mine", str(i))
        for i, k in enumerate(kids):  # they diverged: each sees its own write only
            assert k.read_file("/srv/mine") == str(i).encode()
        assert sb.exec("test -e /srv/mine || echo none").stdout == "none\n"
        for c in pool.clients:  # the fork's snapshot and the imported copy are gone
            assert c.Snapshot.list() == []
    finally:
        for k in kids:
            k.close()


def test_files_only_fork_spreads_and_a_paused_one_is_refused(parent):
    pool, sb, data = parent
    kids = sb.fork(3, memory=False)
    try:
        assert {k.client.url for k in kids} == {pool.clients[0].url, pool.clients[1].url}
        for k in kids:
            assert k.read_file("/srv/data.bin") == data
            assert k.exec("pgrep -f '[h]older.py' || echo fresh").stdout == "fresh\n"  # its processes: new ones
    finally:
        for k in kids:
            k.close()
    sb.pause()  # its slot is free now: A has room for 3
    with pytest.raises(SandboxStateError, match="room for 3 of the 4 children"):
        sb.fork(4)
    sb.resume()
    assert {s.id for c in pool.clients for s in c.Sandbox.list()} == {sb.id}


def test_fork_that_fits_nowhere_makes_nothing(parent):
    pool, sb, _ = parent
    with pytest.raises(QuotaExceeded, match="room for 10 of the 11 children"):
        sb.fork(11)
    assert {s.id for c in pool.clients for s in c.Sandbox.list()} == {sb.id}


def test_failed_pull_closes_the_children_already_made(servers, parent):
    homes = servers[1]
    pool, sb, _ = parent
    # both others pull from A through the proxy, which damages one chunk: one pull fails, the other's server
    # restores its share, which the failure then closes (A's share waits for every pull: it is never made)
    proxy = Proxy(pool.clients[0].url, 200_000, "flip")
    try:
        with agentenv.Pool([proxy.url, *(c.url for c in pool.clients[1:])], TOKEN) as through, \
                pytest.raises(TransferError, match="damaged"):
            through.Sandbox.get(sb.id).fork(7)  # 2 on A, 4 on B, 1 on C
    finally:
        proxy.close()
    assert proxy.done.is_set()
    assert {s.id for c in pool.clients for s in c.Sandbox.list()} == {sb.id}
    assert all(c.Snapshot.list() == [] for c in pool.clients)
    assert not [p.name for h in homes for p in (h / "imports").glob(".part-*")]  # a one-shot pull keeps no part
