"""Snapshots, forks, pause/resume and restore on real runc + CRIU: state continues, then diverges."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import agentenv
from agentenv import phases
from agentenv.errors import SandboxStateError

from .conftest import ask, restart_dockerd, start_counter

pytestmark = pytest.mark.integration

@pytest.fixture
def counting():
    sb = agentenv.Sandbox.create()
    start_counter(sb)  # the probe that found it up took value 1
    assert ask(sb, 2) == 3
    yield sb
    sb.close()


def test_forks_continue_from_snapshot_then_diverge(counting):
    kids = counting.fork(3)
    try:
        assert len({k.id for k in kids} | {counting.id}) == 4
        # each child's server kept its in-memory counter (3) and its listening socket
        assert [ask(k) for k in kids] == [4, 4, 4]
        assert ask(kids[0], 5) == 9
        assert ask(kids[1], 2) == 6
        assert ask(counting) == 4  # the parent kept running, untouched by its children
        assert ask(kids[2]) == 5
        kids[1].write_file("/testbed/only-in-1", "x")
        assert kids[0].exec("test -e /testbed/only-in-1").exit_code == 1
        assert counting.exec("test -e /testbed/only-in-1").exit_code == 1
    finally:
        for k in kids:
            k.close()


def test_a_process_whose_session_leader_is_gone_comes_back():
    """``cmd &`` from an exec: the shell that led the process's session has exited, so CRIU restores the session
    through a helper task. That helper once shared the agent's fs and files, and the agent could then not enter
    the mount namespace to restore its own bound socket (setns: EINVAL): every memory restore failed."""
    sb = agentenv.Sandbox.create()
    made: list[agentenv.Sandbox] = []
    try:
        start_counter(sb, detached=True)
        pid = sb.exec("pgrep -f counter.py").stdout.split()[0]
        ids = sb.exec(f"ps -o sid=,pgid= -p {pid}").stdout.split()
        assert ids[0] != "1" and ids[0] == ids[1]  # a session (and group) of its own, its leader gone
        assert sb.exec(f"ps -o pid= -p {ids[0]}").stdout.strip() == ""
        assert ask(sb, 2) == 3  # the probe that found it up took value 1
        sb.pause()
        sb.resume()
        assert ask(sb) == 4
        made += sb.fork(2)
        assert [ask(k) for k in made] == [5, 5]
        assert [k.exec(f"ps -o sid=,pgid= -p {pid}").stdout.split() for k in made] == [ids, ids]
    finally:
        sb.close()
        for k in made:
            k.close()


def test_tcp_server_answers_after_restore(counting):
    with phases.recording() as found:
        snap = counting.snapshot(memory=True)
    try:
        assert snap.has_memory and snap.size_bytes > 0
        assert snap.criu_stats["pages_written"] > 0 and snap.criu_stats["frozen_time"] > 0  # read with pycriu
        noted = phases.totals(found)  # CRIU's own account of the dump, as phases
        assert noted["criu: frozen"] == snap.criu_stats["frozen_time"] / 1e6 > 0
        assert noted["criu: memdump"] >= noted["criu: memwrite"] > 0
        assert ask(counting, 10) == 13
        restored = agentenv.Sandbox.restore(snap)
        try:
            assert ask(restored) == 4
            assert restored.exec("python3 -c 'import os; print(os.getpid())'").exit_code == 0
        finally:
            restored.close()
    finally:
        snap.delete()


@pytest.mark.parametrize("memory", [False, True])
def test_files_before_snapshot_are_kept_after_are_gone(memory):
    with agentenv.Sandbox.create() as sb:
        blob = os.urandom(200_000)
        sb.write_file("/testbed/keep.bin", blob, mode=0o640)
        sb.write_file("/testbed/run.sh", "#!/bin/sh\necho ran\n", mode=0o755)
        sb.exec("mkdir -p /testbed/d && ln -s keep.bin /testbed/link && rm -f /etc/motd")
        snap = sb.snapshot(memory=memory)
        sb.write_file("/testbed/after.txt", "later")
        sb.exec("rm /testbed/keep.bin && echo changed > /testbed/run.sh")
    try:
        with agentenv.Sandbox.restore(snap) as r:
            assert r.read_file("/testbed/keep.bin") == blob
            assert r.exec("stat -c %a /testbed/keep.bin /testbed/run.sh").stdout.split() == ["640", "755"]
            assert r.exec("/testbed/run.sh").stdout == "ran\n"
            assert r.exec("readlink /testbed/link").stdout == "keep.bin\n"
            assert r.exec("test -e /testbed/after.txt").exit_code == 1
            assert r.exec("test -e /etc/motd").exit_code == 1  # a deletion is part of the snapshot too
            assert snap.id in [s.id for s in agentenv.Snapshot.list()]
    finally:
        snap.delete()
    assert snap.id not in [s.id for s in agentenv.Snapshot.list()]


def test_pause_frees_the_sandbox_and_resume_continues(counting):
    snap = counting.pause()
    assert counting.state == "paused" and snap.has_memory
    with pytest.raises(SandboxStateError):
        counting.exec("true")
    assert ask_after_resume(counting) == 4


def test_a_paused_sandbox_forks_from_its_pause_snapshot_and_stays_paused(counting):
    # the one fork path (forking): the server's fork of a paused sandbox comes here too
    snap = counting.pause()
    kids = counting.fork(2)
    try:
        assert [ask(k) for k in kids] == [4, 4]  # each child continues from where the parent was paused
        assert counting.state == "paused" and counting.paused_snapshot == snap.id
        assert agentenv.Snapshot.get(snap.id).id == snap.id  # the pause snapshot is kept for the resume
        with pytest.raises(SandboxStateError):
            counting.fork(1, memory=False)  # its files alone: it must run
    finally:
        for k in kids:
            k.close()
    assert ask_after_resume(counting) == 4


def ask_after_resume(sb: agentenv.Sandbox) -> int:
    sb.resume()
    assert sb.state == "running"
    return ask(sb)


def test_restore_after_source_is_deleted(counting):
    snap = counting.snapshot(memory=True)
    counting.close()
    try:
        with agentenv.Sandbox.restore(snap.id) as r:
            assert ask(r) == 4
    finally:
        snap.delete()


def test_restore_in_a_new_process_after_kill_9(tmp_path):
    script = f"""
import os, signal, sys
sys.path.insert(0, {os.getcwd()!r})
import agentenv
from tests.integration.conftest import start_counter, ask
sb = agentenv.Sandbox.create()
start_counter(sb)
ask(sb, 4)
snap = sb.snapshot(memory=True)
print(sb.id, snap.id, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    assert p.returncode == -signal.SIGKILL, p.stderr
    sb_id, snap_id = p.stdout.split()
    orphan = agentenv.Sandbox.get(sb_id)  # the killed process's sandbox is still there, reattachable
    try:
        assert ask(orphan) == 6
        with agentenv.Sandbox.restore(snap_id) as r:
            assert ask(r) == 6
    finally:
        orphan.close()
        agentenv.Snapshot.get(snap_id).delete()


def test_restore_after_dockerd_restart(counting):
    snap = counting.snapshot(memory=True)
    fs_snap = counting.snapshot(memory=False)
    try:
        restart_dockerd()
        assert ask(counting) == 4  # sandboxes do not depend on dockerd staying up
        with agentenv.Sandbox.restore(snap) as r:
            assert ask(r) == 4
        with agentenv.Sandbox.restore(fs_snap) as r:
            assert r.exec("test -f /opt/counter.py").exit_code == 0
    finally:
        snap.delete()
        fs_snap.delete()


def test_snapshots_during_concurrent_commands_are_consistent():
    with agentenv.Sandbox.create() as sb:
        stop = threading.Event()
        errors: list[str] = []

        def writer() -> None:
            # each exec appends the next line; a snapshot must never see a torn line
            i = 0
            while not stop.is_set():
                i += 1
                try:
                    r = sb.exec(f"echo line-{i:06d} >> /testbed/log && echo ok")
                except Exception as e:  # noqa: BLE001 - any failure of a concurrent exec fails the test
                    errors.append(f"exec {i} raised {e!r}")
                    return
                if r.stdout != "ok\n":
                    errors.append(f"exec {i}: {r!r}")

        long_result: list[agentenv.ExecResult] = []
        threads = [threading.Thread(target=writer) for _ in range(2)]
        threads.append(threading.Thread(
            target=lambda: long_result.append(sb.exec("for i in $(seq 30); do echo $i; sleep 0.05; done"))))
        for t in threads:
            t.start()
        snaps = []
        for k in range(4):
            time.sleep(0.2)
            snaps.append(sb.snapshot(memory=k % 2 == 0))
        stop.set()
        for t in threads:
            t.join()
        assert not errors
        assert long_result[0].stdout.split() == [str(i) for i in range(1, 31)]  # whole, across snapshots
        try:
            for snap in snaps:
                with agentenv.Sandbox.restore(snap) as r:
                    lines = r.read_file("/testbed/log").decode().splitlines()
                    assert lines and all(len(x) == 11 and x.startswith("line-") for x in lines)
                    assert r.exec("echo alive").stdout == "alive\n"
        finally:
            for snap in snaps:
                snap.delete()


def test_memory_snapshot_without_criu_fails_clearly_and_fs_snapshots_still_work(monkeypatch):
    monkeypatch.setenv("AGENTENV_CRIU", "/nonexistent/criu")
    with agentenv.Sandbox.create() as sb:
        sb.write_file("/testbed/a", "a")
        before = {s.id for s in agentenv.Snapshot.list()}
        with pytest.raises(agentenv.errors.CheckpointError) as e:
            sb.snapshot(memory=True)
        assert "not installed" in str(e.value) and "bootstrap" in str(e.value)
        assert {s.id for s in agentenv.Snapshot.list()} == before  # nothing half-made is listed
        assert sb.exec("echo still running").stdout == "still running\n"
        snap = sb.snapshot(memory=False)
        try:
            with agentenv.Sandbox.restore(snap) as r:
                assert r.read_file("/testbed/a") == b"a"
        finally:
            snap.delete()


def test_store_out_of_space_is_a_clear_error(tmp_path, monkeypatch):
    from agentenv.config import paths

    small = paths().snapshots / "../small-store"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(small)], check=True)
    try:
        with agentenv.Sandbox.create() as sb:
            sb.exec("head -c 8000000 /dev/urandom > /testbed/big")
            monkeypatch.setattr("agentenv.config.Paths.snapshots", property(lambda self: small / "meta"))
            monkeypatch.setattr("agentenv.config.Paths.snapshot_files", property(lambda self: small / "files"))
            with pytest.raises(agentenv.errors.StoreFullError):
                sb.snapshot()
            assert agentenv.Snapshot.list() == []
            assert os.listdir(small / "meta") == os.listdir(small / "files") == []  # no partial folder left behind
            monkeypatch.undo()
            assert sb.exec("echo ok").stdout == "ok\n"
    finally:
        subprocess.run(["umount", str(small)], check=False)
        small.rmdir()


def test_a_sandbox_left_frozen_by_a_dead_snapshotter_is_thawed():
    """kill -9 between freeze and thaw must not leave the sandbox stopped for good."""
    with agentenv.Sandbox.create() as sb:
        freezer = sb.lifecycle.container.freezer()
        assert freezer is not None
        sb.lifecycle.container.freeze(True)  # what a snapshotting process leaves behind when it dies mid-way
        assert sb.lifecycle.container.frozen()
        snap = sb.snapshot()  # takes the lock, finds no one snapshotting, thaws first
        snap.delete()
        assert not sb.lifecycle.container.frozen()
        assert sb.exec("echo alive", timeout=10).stdout == "alive\n"


def test_a_process_waiting_on_its_vfork_child_is_not_dumped_mid_spawn():
    """A parent waiting for its vfork child to exec counts as frozen for the v1 freezer, yet CRIU cannot seize
    it ("Unseizable non-zombie state D", once a random failure of fork tests). The freeze thaws and retries while
    such a waiter exists; a child that never execs (here: blocked opening a FIFO from posix_spawn's file actions,
    which glibc runs between clone(CLONE_VFORK) and exec) makes the memory snapshot fail clearly (before CRIU tries), the sandbox runs
    on, and once the child execs the snapshot succeeds."""
    from agentenv.errors import CheckpointError
    from agentenv.host.cgroups import vfork_waiters

    spawn = ("import os\nos.mkfifo('/tmp/gate')\n"
             "pid = os.posix_spawn('/bin/true', ['true'], {}, file_actions=[(os.POSIX_SPAWN_OPEN, 3, '/tmp/gate', "
             "os.O_RDONLY, 0)])\nos.waitpid(pid, 0)\nopen('/tmp/spawned', 'w').close()\n")
    with agentenv.Sandbox.create(image="agentenv/base", network=False) as sb:
        sb.write_file("/tmp/spawn.py", spawn.encode())
        sb.spawn("python3 /tmp/spawn.py")
        tasks = sb.lifecycle.container.freezer().parent / "tasks"
        deadline = time.monotonic() + 30
        while not vfork_waiters(tasks):  # the parent sits in vfork until its child opens the FIFO
            assert time.monotonic() < deadline, "the spawning process never waited on its vfork child"
            time.sleep(0.01)
        with pytest.raises(CheckpointError, match="vfork"):
            sb.snapshot(memory=True)
        assert not sb.lifecycle.container.frozen()
        assert sb.exec(": > /tmp/gate && while [ ! -e /tmp/spawned ]; do sleep 0.01; done; echo ok",
                       timeout=30).stdout.strip() == "ok"
        assert not vfork_waiters(tasks)
        snap = sb.snapshot(memory=True)
        kid = agentenv.Sandbox.restore(snap)
        try:
            assert kid.exec("echo alive").stdout.strip() == "alive"
        finally:
            kid.close()
            snap.delete()
