"""Restores that run CRIU without runc (agentenv.snapshot.restore): runc's work done by agentenv, and nothing lost.

The restored sandbox must get the cgroups and limits that ``runc restore`` would have given it, runc must know
it afterwards (state, delete, later dumps), images without runc's record must still restore (through runc), and
a restore whose maker dies between CRIU and runc's record must leave no process behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import agentenv
from agentenv.host import cgroups, runtime
from agentenv.snapshot import criu, restore

from .test_snapshots import ask, start_counter

pytestmark = pytest.mark.integration


@pytest.fixture
def runc_restores(monkeypatch):
    """The number of ``runc restore`` runs made while the test runs (a list: one entry a run)."""
    calls: list[tuple[str, ...]] = []
    real = runtime.Container.runc

    def counting(self, *args, **kw):
        if "restore" in args:
            calls.append(args)
        return real(self, *args, **kw)

    monkeypatch.setattr(runtime.Container, "runc", counting)
    return calls


def cgroup_file(sb: agentenv.Sandbox, hierarchy: str, name: str) -> str:
    return (Path("/sys/fs/cgroup") / hierarchy / sb.lifecycle.container.cgroup.lstrip("/") / name).read_text()


def test_a_direct_restore_gives_the_limits_asked_for_and_runc_knows_the_sandbox(runc_restores):
    sb = agentenv.Sandbox.create(cpus=0.5, memory="512m", pids=100)
    try:
        start_counter(sb)
        assert ask(sb, 2) == 3
        snap = sb.pause()
        assert (snap.criu_dir / criu.RUNC_STATE).exists()
        sb.resume()
        assert runc_restores == []  # CRIU ran without runc
        assert ask(sb) == 4
        assert int(cgroup_file(sb, "memory", "memory.limit_in_bytes")) == 512 << 20
        assert cgroup_file(sb, "cpu", "cpu.cfs_quota_us").strip() == "50000"
        assert cgroup_file(sb, "pids", "pids.max").strip() == "100"
        devices = cgroup_file(sb, "devices", "devices.list").splitlines()
        assert "a *:* rwm" not in devices and "c 1:3 rwm" in devices and not any(d.startswith("b 8") for d in devices)
        pids = sb.lifecycle.container.pids()
        assert sb.record.init_pid in pids and len(pids) >= 2
        for pid in pids:  # every process in the sandbox's own cgroup, in every hierarchy
            for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
                assert line.endswith(sb.lifecycle.container.cgroup), line
        state = sb.lifecycle.container.state()
        assert state is not None and state["status"] == "running" and state["pid"] == sb.record.init_pid
        with sb.fork(1, memory=True)[0] as child:  # a later dump reads the record the restore wrote
            assert ask(child) == 5
    finally:
        sb.close()
    assert cgroups.existing(sb.lifecycle.container.cgroup) == []


@pytest.mark.parametrize("how", ["images without runc's record", "AGENTENV_DIRECT_RESTORE=0"])
def test_restores_fall_back_to_runc(how, runc_restores, monkeypatch):
    sb = agentenv.Sandbox.create()
    try:
        start_counter(sb)
        snap = sb.snapshot(memory=True)
        if how.startswith("images"):
            (snap.criu_dir / criu.RUNC_STATE).unlink()  # as a snapshot taken before direct restores
        else:
            monkeypatch.setenv(restore.DIRECT_RESTORE_ENV, "0")
        with agentenv.Sandbox.restore(snap) as r:
            assert len(runc_restores) == 1
            assert ask(r) == 2
        snap.delete()
    finally:
        sb.close()


def test_a_restore_whose_maker_dies_before_runcs_record_leaves_no_process():
    sb = agentenv.Sandbox.create()
    try:
        start_counter(sb)
        sb.pause()
        script = (f"import sys; sys.path.insert(0, {os.getcwd()!r}); import agentenv; "
                  f"agentenv.Sandbox.get({sb.id!r}).resume()")
        env = {**os.environ, "AGENTENV_CRASH_AT": "restore:criu-done"}
        p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=False)
        assert p.returncode == -signal.SIGKILL, p.stderr
        assert cgroups.existing(sb.lifecycle.container.cgroup), "CRIU had restored the processes into the cgroups"
        assert sb.recover() == "paused"
        assert cgroups.existing(sb.lifecycle.container.cgroup) == []
        sb.resume()
        assert ask(sb) == 2
    finally:
        sb.close()


def cgroup2_options() -> list[str] | None:
    for line in Path("/proc/self/mounts").read_text().splitlines():
        f = line.split()
        if f[2] == "cgroup2":
            return f[3].split(",")
    return None


@pytest.mark.skipif(cgroup2_options() is None, reason="no cgroup v2 hierarchy on this host")
def test_a_start_mounts_the_cgroup2_hierarchy_for_fast_moves(monkeypatch):
    # the kernel cannot turn favordynmods off again (until a reboot): on a fresh host this is the start's doing
    cgroups.favor_dynmods.cache_clear()
    with agentenv.Sandbox.create() as sb:
        assert sb.exec("true").ok
    assert "favordynmods" in (cgroup2_options() or [])
    cgroups.favor_dynmods.cache_clear()
    monkeypatch.setenv(cgroups.FAVOR_ENV, "0")
    assert cgroups.favor_dynmods() is False  # the host's options left alone when asked
    cgroups.favor_dynmods.cache_clear()


MASKS = ("grep -E ' /(proc/acpi|proc/scsi|sys/firmware) ' /proc/self/mountinfo | cut -d' ' -f5-7,9-; "
         "ls -A /sys/firmware; stat -c '%a %u' /sys/firmware")


def test_masked_directories_come_back_empty_and_read_only():
    # CRIU saves an empty read-only tmpfs (runc's mask over a directory) without tar (scripts/criu-patches/0004)
    with agentenv.Sandbox.create() as sb:
        before = sb.exec(MASKS).stdout
        assert "/sys/firmware ro" in before and " tmpfs " in before
        with sb.fork(1, memory=True)[0] as child:
            assert child.exec(MASKS).stdout == before
            assert child.exec("touch /sys/firmware/x").exit_code != 0
