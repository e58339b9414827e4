"""Post-copy migration (agentenv.sandbox.migration): the sandbox runs on the receiver before its memory is in, and
keeps its processes' memory, its files and a TCP connection on its loopback; a migration nobody receives leaves it
running on the source."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import pytest

import agentenv
from agentenv.errors import CheckpointError, SandboxStateError, SnapshotNotFound
from agentenv.sandbox import expiry, migration, usage
from agentenv.snapshot import lazy_pages, page_channel

from .server_fixtures import TOKEN
from .test_transfer import servers  # noqa: F401 - the two servers (A holds one sandbox)

pytestmark = pytest.mark.integration

# 48 MiB of random bytes, and a TCP connection between two of its sockets on the sandbox's loopback; each query
# (a connection to port 7001) answers the sha256 of the bytes as they are in memory now and whether a message
# still goes through the old connection
HOLDER = """import hashlib, os, socket
data = bytearray(os.urandom(48 << 20))
pair = socket.create_server(("127.0.0.1", 7000))
a = socket.create_connection(("127.0.0.1", 7000)); b, _ = pair.accept()
srv = socket.create_server(("127.0.0.1", 7001))
open("/tmp/ready", "w").write("1")
while True:
    c, _ = srv.accept()
    a.sendall(b"ping"); got = b.recv(4)
    c.sendall(f"{hashlib.sha256(data).hexdigest()} {got.decode()}".encode()); c.close()
"""
QUERY = "python3 -c \"import socket; print(socket.create_connection(('127.0.0.1', 7001)).recv(100).decode())\""


def query(sb: agentenv.Sandbox) -> str:
    r = sb.exec(QUERY, timeout=60)
    assert r.exit_code == 0, r.stderr
    return r.stdout.strip()


@pytest.fixture
def holding():
    sb = agentenv.Sandbox.create(memory="512m")
    sb.write_file("/srv/state", "kept\n")
    sb.write_file("/tmp/holder.py", HOLDER)
    sb.spawn("python3 /tmp/holder.py")
    assert sb.exec("while [ ! -s /tmp/ready ]; do sleep 0.05; done", timeout=60).exit_code == 0
    yield sb
    sb.close()


def test_a_sandbox_moved_post_copy_keeps_its_memory_files_and_loopback_connection(holding):
    before = query(holding)
    assert before.endswith(" ping")
    out = migration.send(holding)
    assert migration.page_server_of(out.snapshot, out.key) == page_channel.Endpoint("127.0.0.1", out.server.port,
                                                                                     out.key)
    pages = sum(f.stat().st_size for f in out.snapshot.criu_dir.glob("pages-*.img"))
    assert pages < 16 << 20  # the 48 MiB are served, not in the images
    try:
        moved = agentenv.Sandbox.restore(out.snapshot, page_server_key=out.key)
    except BaseException:
        out.finish(False)
        raise
    try:
        assert query(moved) == before
        assert moved.read_file("/srv/state") == b"kept\n"
        assert migration.all_in(moved, 120)
        assert out.server.wait(60) == 0
        assert holding.lifecycle.container.frozen()  # CRIU let the source go, still frozen: never running twice
        assert out.finish(True)
        assert holding.state == "closed"
        assert query(moved) == before
        with moved.fork(1, memory=True)[0] as child:  # a later dump sees every page
            assert query(child) == before
    finally:
        moved.close()
        if out.server.proc.returncode is None:  # failed before finish: the source is kept
            out.finish(False)


def test_a_migration_nobody_receives_leaves_the_sandbox_running_on_the_source(holding):
    before = query(holding)
    out = migration.send(holding)
    with agentenv.Sandbox.create() as neighbour:  # the page server is on the host's loopback, not the sandboxes'
        r = neighbour.exec(f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {out.server.port}), "
                           "timeout=5)\"", timeout=60)
        assert r.exit_code != 0 and "refused" in r.stderr, r.stderr
    assert out.server.listening()
    assert not out.finish(False)
    assert holding.state == "running"
    assert query(holding) == before
    with pytest.raises(SnapshotNotFound):
        agentenv.Snapshot.get(out.snapshot.id)


@pytest.mark.parametrize("on_expiry", ["pause", "kill"])
def test_the_ttl_reaper_leaves_a_sandbox_alone_while_a_migration_holds_it(on_expiry, caplog):
    """Past its TTL while frozen by a migration: the reaper neither closes it under the move ("kill") nor waits
    out the quiesce deadline on an agent CRIU holds ("pause"); once the move failed, the next round reaps it."""
    sb = agentenv.Sandbox.create(labels={expiry.ON_EXPIRY: on_expiry})
    try:
        out = migration.send(sb)
        try:
            sb.set_ttl(0.001)
            while not expiry.due(sb.expires_at, sb.state):
                pass
            with caplog.at_level("WARNING", logger="agentenv"):
                assert sb.id not in agentenv.Sandbox.reap_expired()
            assert "could not reap" not in caplog.text
            other = subprocess.run(  # agentenv gc's reaper, in another process: it finds the move by its snapshot
                [sys.executable, "-c", "import agentenv; print(agentenv.Sandbox.reap_expired())"],
                capture_output=True, text=True, timeout=120, check=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
            assert sb.id not in other.stdout and "could not reap" not in other.stderr, other.stderr
            assert sb.state == "running"
            assert re.search(r"keeper threads: \d+ t\b", usage.stall_hint(sb))  # seized by CRIU: what an error says
        finally:
            assert not out.finish(False)
        agentenv.Sandbox.reap_expired()  # this round's, or the home's reaper's (agentenv.sandbox.watchdog)
        assert sb.state == ("paused" if on_expiry == "pause" else "closed")
    finally:
        sb.close()


def test_a_receiver_whose_page_server_is_gone_fails_and_leaves_nothing(holding):
    out = migration.send(holding)
    assert not out.finish(False)
    with pytest.raises(CheckpointError):
        lazy_pages.Restore(out.snapshot.criu_dir, holding.lifecycle.container.bundle,
                           page_server=page_channel.Endpoint("127.0.0.1", out.server.port, out.key)).run(
            lambda images, lazy: 0)
    assert list(holding.lifecycle.container.bundle.glob("criu-lazy-*")) == []


def test_only_a_loopback_page_server_is_taken(holding):
    with pytest.raises(CheckpointError, match="loopback"):
        migration.send(holding, address="0.0.0.0")
    assert holding.state == "running"


def test_the_page_server_nobody_connects_to_times_out_and_the_source_runs_on(holding, monkeypatch):
    monkeypatch.setattr(migration, "CONNECT_TIMEOUT", 0.5)
    before = query(holding)
    out = migration.send(holding)
    assert out.finished.wait(60)  # the watchdog ended it
    assert out.moved is False
    assert query(holding) == before
    assert out.snapshot.id not in migration.outgoing


def remote_query(sb) -> str:
    r = sb.exec(QUERY, timeout=60)
    assert r.exit_code == 0, r.stderr
    return r.stdout.strip()


def remote_holding(client):
    sb = client.Sandbox.create(memory="512m")
    sb.write_file("/srv/state", "kept\n")
    sb.write_file("/tmp/holder.py", HOLDER)
    sb.spawn("python3 /tmp/holder.py")
    assert sb.exec("while [ ! -s /tmp/ready ]; do sleep 0.05; done", timeout=60).exit_code == 0
    return sb


def test_a_post_copy_move_between_servers_and_one_that_fails_on_the_receiver(servers):  # noqa: F811
    urls, _ = servers
    with agentenv.Pool(urls, TOKEN, timeout=120) as pool:
        a, b = pool.clients
        sb = remote_holding(a)
        try:
            before = remote_query(sb)
            started = a.request("POST", f"/v1/sandboxes/{sb.id}/migrate", {})  # nobody receives it
            with pytest.raises(SandboxStateError, match="migrated"):  # frozen meanwhile: refused, not stalled
                sb.exec("true")
            done = a.request("POST", f"/v1/sandboxes/{sb.id}/migrate/finish",
                             {"snapshot": started["snapshot"]["id"], "delivered": False})
            assert done == {"id": sb.id, "moved": False}
            assert remote_query(sb) == before
            seen: list[str] = []
            sb.set_ttl(3000)
            moved = pool.Sandbox.move(sb, b.url, post_copy=True, on_running=lambda m: seen.append(remote_query(m)))
            try:
                assert moved.expires_at is not None and moved.expires_at > time.time() + 2000  # its deadline kept
                assert seen == [before]  # it answered on B before its memory was all in
                assert moved.client is b and remote_query(moved) == before
                assert moved.read_file("/srv/state") == b"kept\n"
                assert [s.id for s in a.Sandbox.list()] == []
                assert a.Snapshot.list() == [] and b.Snapshot.list() == []

                def fail(m):
                    raise RuntimeError("the receiver's first answer was wrong")

                with pytest.raises(RuntimeError):  # back to A, failing once it runs there: it runs on at B, A closes its copy
                    pool.Sandbox.move(moved, a.url, post_copy=True, on_running=fail)
                assert remote_query(b.Sandbox.get(moved.id)) == before
                assert [s.id for s in a.Sandbox.list()] == []
                assert a.Snapshot.list() == [] and b.Snapshot.list() == []
            finally:
                moved.close()
        finally:
            sb.close()


def test_a_migration_whose_server_died_is_ended_and_the_source_runs_on():
    """kill -9 of the sending process while its page server waits: its listener goes with it (nobody can take the
    pages the snapshot names), the CRIU it left ends (or recovery ends it) and the sandbox, left frozen, runs on
    where it was once recovered; the migration's snapshot goes too."""
    import signal

    from agentenv.sandbox.recovery import host_processes, lazy_dump

    script = f"""
import os, signal, sys
sys.path.insert(0, {os.getcwd()!r})
import agentenv
from agentenv.sandbox import expiry, migration, usage
from tests.integration.test_postcopy import HOLDER, query
sb = agentenv.Sandbox.create(memory="512m")
sb.write_file("/tmp/holder.py", HOLDER)
sb.spawn("python3 /tmp/holder.py")
assert sb.exec("while [ ! -s /tmp/ready ]; do sleep 0.05; done", timeout=60).exit_code == 0
print(sb.id, query(sb), flush=True)
print(migration.send(sb).server.port, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    assert p.returncode == -signal.SIGKILL, p.stderr
    first, port = p.stdout.splitlines()
    sb_id, before = first.split(maxsplit=1)
    with pytest.raises(ConnectionRefusedError):  # its listener went with it
        socket.create_connection(("127.0.0.1", int(port)), timeout=5)
    orphan = agentenv.Sandbox.get(sb_id)
    try:
        assert orphan.recover() == "running"
        assert query(orphan) == before.strip()
        assert not any(lazy_dump(h.cmdline) for h in host_processes())
        assert not [s for s in agentenv.Snapshot.list() if s.sandbox_id == sb_id]
    finally:
        orphan.close()
