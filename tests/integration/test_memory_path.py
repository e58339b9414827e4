"""The memory path: CRIU dumps run directly (agentenv.snapshot.criu) and restores bring memory in lazily.

Every byte of a process's memory must come back, whether the snapshot and its source still exist or not, and a
snapshot of a sandbox whose memory is still coming in must not miss the pages not in yet.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

import agentenv
from agentenv.config import paths
from agentenv.host.hostcalls import proc_start_time
from agentenv.snapshot import criu, lazy_pages

from .test_snapshots import ask, start_counter

# Lazy restores need userfaultfd for non-cooperative processes (kernel and CRIU): without it the tests of this
# path cannot run here, and say so; with it, a restore without its daemon is a failure.
LAZY = subprocess.run(["criu", "check", "--feature", "uffd-noncoop"], capture_output=True).returncode == 0
pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not LAZY, reason="no lazy restores here: 'criu check --feature uffd-noncoop' fails")]

# A process holding 64 MB of distinct pages; SIGUSR1 makes it write the digest of all of them to /tmp/sum.
HOLDER = b"""
import hashlib, os, signal, time
b = bytearray(64 << 20)
for i in range(0, len(b), 4096):
    b[i:i + 8] = (i * 2654435761 % (1 << 64)).to_bytes(8, "little")
def digest(*_):
    with open("/tmp/sum.tmp", "w") as f:
        f.write(hashlib.sha256(b).hexdigest())
    os.rename("/tmp/sum.tmp", "/tmp/sum")
signal.signal(signal.SIGUSR1, digest)
digest()
while True:
    time.sleep(1)
"""


def start_holder(sb: agentenv.Sandbox) -> tuple[int, str]:
    sb.write_file("/opt/holder.py", HOLDER)
    proc = sb.spawn("exec python3 /opt/holder.py")
    for _ in range(400):
        if sb.exec("test -f /tmp/sum").exit_code == 0:
            return proc.pid, sb.read_file("/tmp/sum").decode()
        time.sleep(0.05)
    raise AssertionError("the memory holder did not start")


def digest_now(sb: agentenv.Sandbox, pid: int) -> str:
    """Have the holder hash every page it holds now (touching all its memory) and return the digest."""
    r = sb.exec(f"rm -f /tmp/sum; kill -USR1 {pid}; for i in $(seq 200); do test -f /tmp/sum && break; sleep 0.05; "
                "done; cat /tmp/sum")
    assert r.exit_code == 0, r.stderr
    return r.stdout.strip()


def lazy_daemon(sb: agentenv.Sandbox) -> list[int] | None:
    rec = json.loads((paths().sandboxes / sb.id / "sandbox.json").read_text())
    return rec.get("lazy_pages")


def wait_daemon_gone(daemon: list[int]) -> None:
    assert lazy_pages.wait_lazy_pages(daemon[0], daemon[1], 60), "the lazy-pages daemon never finished"


def test_a_lazily_restored_child_keeps_all_its_memory_when_source_and_images_are_gone():
    src = agentenv.Sandbox.create()
    kid = None
    try:
        pid, want = start_holder(src)
        snap = src.snapshot(memory=True)
        kid = agentenv.Sandbox.restore(snap)
        daemon = lazy_daemon(kid)
        assert daemon is not None, "a 64 MB dump was restored without a lazy-pages daemon"
        snap.delete()  # the images leave the store at once (the daemon serves the sandbox's own links)
        assert not snap.path.exists()
        src.close()
        assert digest_now(kid, pid) == want  # every page, touched after its source and images went
        wait_daemon_gone(daemon)
        bundle = paths().sandboxes / kid.id
        for _ in range(100):  # the links to the images go once the daemon is done
            if not list(bundle.glob("criu-lazy-*")):
                break
            time.sleep(0.05)
        assert not list(bundle.glob("criu-lazy-*"))
        assert digest_now(kid, pid) == want
    finally:
        src.close()
        if kid is not None:
            kid.close()


def test_a_snapshot_taken_while_memory_comes_in_has_every_page():
    src = agentenv.Sandbox.create()
    made: list[agentenv.Sandbox] = []
    try:
        pid, want = start_holder(src)
        snap = src.snapshot(memory=True)
        kid = agentenv.Sandbox.restore(snap)
        made.append(kid)
        snap.delete()
        src.close()
        again = kid.snapshot(memory=True)  # at once: waits for the memory to be all in
        assert lazy_daemon(kid) is None
        grandkid = agentenv.Sandbox.restore(again)
        made.append(grandkid)
        again.delete()
        assert digest_now(grandkid, pid) == want
        assert digest_now(kid, pid) == want
        forks = kid.fork(2)  # a fork of a sandbox restored a moment ago: the same rule
        made += forks
        assert [digest_now(f, pid) for f in forks] == [want, want]
    finally:
        src.close()
        for k in made:
            k.close()


def test_pause_and_resume_twice_keep_every_page():
    sb = agentenv.Sandbox.create()
    try:
        pid, want = start_holder(sb)
        for _ in range(2):
            sb.pause()
            sb.resume()
            assert digest_now(sb, pid) == want
    finally:
        sb.close()


def test_without_lazy_restore_every_page_is_in_before_the_processes_run(monkeypatch):
    monkeypatch.setenv(lazy_pages.LAZY_ENV, "0")
    sb = agentenv.Sandbox.create()
    kid = None
    try:
        pid, want = start_holder(sb)
        snap = sb.snapshot(memory=True)
        kid = agentenv.Sandbox.restore(snap)
        snap.delete()
        assert lazy_daemon(kid) is None
        assert digest_now(kid, pid) == want
    finally:
        sb.close()
        if kid is not None:
            kid.close()


def test_a_dump_leaves_runc_in_charge_of_the_source():
    sb = agentenv.Sandbox.create()
    kid = None
    try:
        start_counter(sb)
        snap = sb.snapshot(memory=True)
        assert sb.state == "running"  # runc still knows it, running, after CRIU dumped it
        assert (snap.criu_dir / "descriptors.json").exists()  # what runc restore reads for the init's stdio
        assert ask(sb) == 2
        kid = agentenv.Sandbox.restore(snap)
        assert kid.state == "running"
        assert ask(kid) == 2
        snap.delete()
    finally:
        sb.close()
        if kid is not None:
            kid.close()
    assert sb.state == "closed"


def test_the_dump_options_follow_runcs_record(tmp_path: Path):
    """The arguments come from runc's state.json: the init, its root, bind mounts, masked files, the external
    network namespace (whose lock is skipped) and the freezer cgroup."""
    netns = tmp_path / "netns"
    netns.touch()
    state = {
        "init_process_pid": 1,
        "cgroup_paths": {"freezer": "/sys/fs/cgroup/freezer/agentenv/ae-x"},
        "config": {
            "rootfs": "/b/rootfs",
            "namespaces": [{"type": "NEWPID", "path": ""}, {"type": "NEWNET", "path": str(netns)}],
            "mounts": [{"device": "bind", "destination": "/.agentenv//agent.py", "source": "/a.py"},
                       {"device": "tmpfs", "destination": "/dev", "source": "tmpfs"}],
            "mask_paths": ["/proc/kcore", "/proc/acpi"],
            "devices": [{"path": "/dev/null"}],
        },
    }
    args = criu.dump_args(state, tmp_path / "img", tmp_path / "work", leave_running=True)
    joined = " ".join(args)
    assert args[:3] == ["dump", "--tree", "1"]
    assert "--leave-running" in args and "--tcp-established" in args and "--file-locks" in args
    assert f"--external net[{netns.stat().st_ino}]:extRootNetNS" in joined
    assert "--network-lock skip --empty-ns net" in joined
    assert "--external mnt[/.agentenv/agent.py]:/.agentenv/agent.py" in joined
    assert "--external mnt[/dev/null]:/dev/null" in joined
    assert "--freeze-cgroup /sys/fs/cgroup/freezer/agentenv/ae-x" in joined
    assert "ae-x" in joined  # recovery finds a CRIU left working on a sandbox by its container id
    state["config"]["namespaces"] = [{"type": "NEWPID", "path": ""}]  # the host's network: CRIU's own lock
    host_net = criu.dump_args(state, tmp_path, tmp_path, leave_running=False)
    assert "--network-lock" not in host_net and "--empty-ns" not in host_net


def test_closing_a_sandbox_ends_a_lazy_pages_daemon_whose_restore_never_came():
    """A maker killed between starting the daemon and restoring would leave it waiting forever: closing (or
    recovering) the sandbox ends it."""
    sb = agentenv.Sandbox.create()
    try:
        snap = sb.snapshot(memory=True)
        bundle = paths().sandboxes / sb.id
        daemon = lazy_pages.start_lazy_pages(snap.criu_dir, bundle / "criu-lazy-test", bundle / "criu-test")
        snap.delete()
        assert daemon is not None, "the lazy-pages daemon did not start"
        start = proc_start_time(daemon)
        assert not lazy_pages.wait_lazy_pages(daemon, start, 0.5)  # waiting for a restore that never comes
    finally:
        sb.close()
    assert lazy_pages.wait_lazy_pages(daemon, start, 10)


def _daemons_under(folder: Path) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if b"lazy-pages" in cmd and str(folder).encode() in cmd:
                found.append(int(entry.name))
    return found


def test_a_failed_lazy_restore_leaves_no_daemon_and_no_sandbox(monkeypatch):
    monkeypatch.setenv(lazy_pages.LAZY_ENV, "all")
    sb = agentenv.Sandbox.create()
    try:
        snap = sb.snapshot(memory=True)
    finally:
        sb.close()
    before = {s.id for s in agentenv.Sandbox.list()}

    def refuse(self, images, work, spec, criu=None, lazy=False, address=None):
        assert lazy  # the daemon was up, waiting for this restore
        raise agentenv.errors.CheckpointError("refused for the test")

    monkeypatch.setattr("agentenv.snapshot.container.Container.restore", refuse)
    with pytest.raises(agentenv.errors.CheckpointError):
        agentenv.Sandbox.restore(snap)
    snap.delete()
    assert {s.id for s in agentenv.Sandbox.list()} == before
    assert _daemons_under(paths().sandboxes) == []
