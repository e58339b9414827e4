"""The hostile-agent suite, item 6: ``kill -9`` of the environment server in the middle of an operation.

The server kills itself with SIGKILL at a named point of a fork or a pause (``$AGENTENV_CRASH_AT``, see
``agentenv.config.crash_point``), or, at ``<op>:criu``, while the CRIU dump it runs is running (a CRIU that kills
its caller). A new server then starts on the same home, and the test checks what recovery
promises: nothing stays frozen, no half-made child or fork snapshot stays behind, the quota counts what
is there, and a pause ends paused or running, never lost. Nothing asserts on wall-clock time.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

import agentenv
from agentenv.config import CRASH_ENV, paths
from agentenv.errors import ConnectionLost
from agentenv.remote.client import Client
from agentenv.sandbox import lifecycle, sweep
from agentenv.snapshot import store

from .server_fixtures import TOKEN, free_port, start_server_process

pytestmark = pytest.mark.integration


class Server:
    """One ``agentenv serve`` process at a time on a fixed port, restarted at will."""

    def __init__(self, token_file: Path) -> None:
        self.token_file, self.port = token_file, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, crash_at: str | None = None) -> Client:
        """A server that kills itself at the crash point ``crash_at``; at ``<op>:criu``, the CRIU it runs first (the
        dump of that operation) kills it once CRIU is running (``criu_killing_its_caller``): a kill in the middle of
        the dump as a state, where a delay after the dump began would miss a dump that ends sooner."""
        env = {CRASH_ENV: crash_at or ""}
        if crash_at is not None and crash_at.endswith(":criu"):
            env = {CRASH_ENV: "", "AGENTENV_CRIU": str(criu_killing_its_caller(self.token_file.parent))}
        self.proc = start_server_process(self.port, self.token_file, env=env)
        return agentenv.connect(self.url, TOKEN, retries=0)

    def died(self) -> bool:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=60) == -signal.SIGKILL
        except subprocess.TimeoutExpired:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=30)


def criu_killing_its_caller(folder: Path) -> Path:
    """A CRIU (``$AGENTENV_CRIU``) that starts the real one, then SIGKILLs the process that ran it (the server) while
    the real one runs."""
    script = folder / "criu-killing-its-caller"
    script.write_text(f'#!/bin/sh\n{shutil.which("criu")} "$@" &\nkill -9 "$PPID"\nwait "$!"\n')
    script.chmod(0o755)
    return script


@pytest.fixture
def server(token_file):
    s = Server(token_file)
    yield s
    s.stop()


def recovered(c: Client) -> dict[str, list[str]]:
    """What the restarted server recovered, once nothing is left recovering (a bound, not a timing check)."""
    for _ in range(1200):
        found = c.server_info()["recovered"]
        if not found.get("recovering"):
            return found
        time.sleep(0.1)
    raise AssertionError(f"recovery did not finish: {found}")


def settled_store() -> list[str]:
    """The store's hidden folders (writers' leftovers) and fork snapshots, once gc had its chance."""
    for _ in range(200):
        left = [p.name for root in (paths().snapshots, paths().snapshot_files) for p in root.iterdir()
                if p.name.startswith((".tmp-", ".del-"))]
        left += [p.name for p in paths().snapshot_files.iterdir() if not (paths().snapshots / p.name).exists()]
        left += [s.id for s in store.Snapshot.list() if s.labels.get("agentenv.kind") == store.FORK_KIND]
        if not left:
            return []
        time.sleep(0.05)
    return left


def start_work(sb) -> None:
    """A file and a background process: what a finished pause must keep, and a rolled-back one never lost."""
    sb.write_file("/testbed/kept", "kept")
    sb.spawn("sleep 1000")


def local(sandbox_id: str) -> agentenv.Sandbox:
    return agentenv.Sandbox.get(sandbox_id)


def fork_killed_at(server, point: str, n: int, network: bool = False):
    """A server killed at ``point`` of a fork of ``n`` (a working source sandbox), then started again: its client,
    the source's id and what recovery reported."""
    c = server.start(crash_at=point)
    src = c.Sandbox.create(memory="256m", network=network)
    start_work(src)
    with pytest.raises(ConnectionLost):
        src.fork(n)
    assert server.died()
    c = server.start()
    return c, src.id, recovered(c)


@pytest.mark.parametrize("point", ["fork:frozen", "fork:criu", "fork:dumped", "fork:started"])
def test_kill_9_mid_fork_thaws_the_source_and_leaves_no_child_or_snapshot(server, point):
    c, src_id, found = fork_killed_at(server, point, 3)
    assert src_id in found["running"]
    assert not local(src_id).lifecycle.container.frozen()
    src = c.Sandbox.get(src_id)
    assert src.exec("cat /testbed/kept", timeout=30).stdout == "kept"  # answers: nothing holds it frozen
    assert [s.id for s in c.Sandbox.list()] == [src_id]  # the half-made children are gone ...
    assert c.server_info()["capacity"]["live_sandboxes"] == 1  # ... and the quota counts what is there
    if point == "fork:started":
        assert found.get("discarded")
    assert settled_store() == []
    assert recovered(c) == found  # idempotent: a second look changes nothing
    src.close()


@pytest.mark.parametrize("point", ["fork:dumped", "fork:started"])
def test_kill_9_mid_fork_of_a_networked_sandbox_leaves_no_network_link(server, point):
    """The half-made children's veths go with them (and their namespaces): only the source's link is left."""
    from agentenv.host import network

    c, src_id, found = fork_killed_at(server, point, 3, network=True)
    assert src_id in found["running"]
    assert [s.id for s in c.Sandbox.list()] == [src_id]
    links = network.links(f"{paths().home}/")
    src = local(src_id)
    assert list(links) == [src.lifecycle.container.link()["veth"]], links
    assert c.Sandbox.get(src_id).network.address == src.network.address
    c.Sandbox.get(src_id).close()
    assert network.links(f"{paths().home}/") == {}


def test_kill_9_after_the_children_ran_keeps_them_and_collects_the_fork_snapshot(server):
    c, src_id, found = fork_killed_at(server, "fork:children", 2)
    kids = [s for s in c.Sandbox.list() if s.id != src_id]
    assert len(kids) == 2 and all(k.id in found["running"] for k in kids)  # whole: they run on
    assert all(k.exec("cat /testbed/kept").stdout == "kept" for k in kids)
    assert settled_store() == []
    for s in c.Sandbox.list():
        s.close()


@pytest.mark.parametrize(("point", "ends"), [("pause:frozen", {"running"}), ("pause:criu", {"running", "paused"}),
                                             ("pause:dumped", {"paused"}), ("pause:published", {"paused"})])
def test_kill_9_mid_pause_ends_paused_or_running_never_lost(server, point, ends):
    c = server.start(crash_at=point)
    sb = c.Sandbox.create(memory="256m")
    sid = sb.id
    start_work(sb)
    with pytest.raises(ConnectionLost):
        sb.pause()
    assert server.died()
    c = server.start()
    found = recovered(c)
    state = c.Sandbox.get(sid).state
    assert state in ends and sid in found[state], (state, found)
    sb = c.Sandbox.get(sid)
    if state == "paused":
        assert [s.labels.get("agentenv.kind") for s in c.Snapshot.list()] == ["pause"]
        sb.resume()
    assert sb.exec("cat /testbed/kept").stdout == "kept"
    assert [p.command for p in local(sid).processes()] == ["sleep 1000"]  # its processes too, whole
    assert settled_store() == []
    sb.close()
    assert c.Snapshot.list() == []


def test_kill_9_mid_resume_leaves_it_paused_with_nothing_running(server):
    c = server.start(crash_at="resume:started")
    sb = c.Sandbox.create(memory="256m")
    sid = sb.id
    start_work(sb)
    sb.pause()
    with pytest.raises(ConnectionLost):
        sb.resume()  # its processes are back in a container when the server dies
    assert server.died()
    c = server.start()
    assert sid in recovered(c)["paused"]
    assert local(sid).lifecycle.container.state() is None and not local(sid).lifecycle.container.layer.exists()
    sb = c.Sandbox.get(sid)
    sb.resume()
    assert sb.exec("cat /testbed/kept").stdout == "kept"
    assert [p.command for p in local(sid).processes()] == ["sleep 1000"]
    sb.close()
    assert c.Snapshot.list() == []


def test_one_stopped_sandbox_does_not_hold_up_the_restart(server):
    c = server.start()
    stuck = c.Sandbox.create(memory="256m")
    fine = c.Sandbox.create(memory="256m")
    pid = local(stuck.id).record.init_pid
    os.kill(server.proc.pid, signal.SIGKILL)
    assert server.died()
    os.kill(pid, signal.SIGSTOP)
    try:
        c = server.start()  # answers /health while the stopped one is still being asked
        assert c.Sandbox.get(fine.id).exec("echo alive").stdout == "alive\n"
        found = recovered(c)
        assert fine.id in found["running"] and stuck.id in found["lost"]
    finally:
        os.kill(pid, signal.SIGCONT)
    for s in c.Sandbox.list():
        s.close()


def test_recovery_in_process_is_idempotent_and_leaves_live_work_alone():
    """``recover_all`` (what ``agentenv gc`` runs) on a host where this live process is mid-creation."""
    with agentenv.Sandbox.create(memory="256m") as sb:
        making = lifecycle.make(agentenv.Sandbox, sb.container_spec(), image="agentenv/base", ttl=None, labels=None,
                                parent=None)
        try:
            first = sweep.recover_all()
            assert sb.id in first["running"] and making.id in first["busy"]
            assert sweep.recover_all() == first
        finally:
            making.lifecycle.destroy()
