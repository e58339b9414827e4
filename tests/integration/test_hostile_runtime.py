"""The hostile-agent suite (issue 10): what a process inside a sandbox, or a sandbox's death, may do to
the host and to other sandboxes. Each attack that once worked has a test here that failed before its
fix; the attacks that already failed are here too, so that they keep failing. A ``kill -9`` of the server
in the middle of an operation (item 6) is in ``test_hostile_restart.py``.

Pid reuse is simulated deterministically (a dead sandbox's record made to name another sandbox's
agent), a stopped agent with SIGSTOP from the host; deadlines are shortened so that the suite stays
fast, and nothing asserts on wall-clock time.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import tempfile
import time
from pathlib import Path

import pytest

import agentenv
from agentenv.config import paths
from agentenv.errors import (
    ConnectionLost,
    DiskLimitUnsupported,
    SandboxError,
    SandboxLost,
    SandboxStateError,
    StoreFullError,
)
from agentenv.host import volume
from agentenv.inside import keeper
from agentenv.sandbox import channel, expiry, snapshotting
from agentenv.snapshot import store

from .conftest import cleanup

pytestmark = pytest.mark.integration

TRACE_PID_1 = ("python3 -c 'import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
               "print(libc.syscall(101, 16, 1, 0, 0), ctypes.get_errno())'")  # PTRACE_ATTACH to PID 1


@pytest.fixture
def sb():
    with agentenv.Sandbox.create(memory="256m") as s:
        yield s


def agent_pid(s: agentenv.Sandbox) -> int:
    return int(json.loads((s.lifecycle.container.bundle / "sandbox.json").read_text())["init_pid"])


def agent_state(pid: int) -> str:
    data = Path(f"/proc/{pid}/stat").read_bytes()
    return data[data.rindex(b")") + 2:].split()[0].decode()


def wait_gone(pid: int) -> None:
    for _ in range(500):
        if not Path(f"/proc/{pid}").exists() or agent_state(pid) == "Z":
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not exit")


def fake_agent(s: agentenv.Sandbox, behaviour: str) -> None:
    """Replace the agent's socket with a server of the sandbox's own (started with spawn, so before the swap)."""
    code = f"""
import os, socket, struct, time
os.unlink('/dev/agentenv/agent.sock')
srv = socket.socket(socket.AF_UNIX)
srv.bind('/dev/agentenv/agent.sock')
srv.listen(64)
open('/tmp/fake-up', 'w').close()
while True:
    c, _ = srv.accept()
    try:  # a host that refused this peer may have closed already: the fake must serve the next one
        if {behaviour!r} == 'huge':
            head = b'{{"ok": true}}'
            c.sendall(struct.pack('>II', len(head), 0xFFFFFFFF) + head)
            time.sleep(0.5)
    except OSError:
        pass
    c.close()
"""
    s.write_file("/opt/fake.py", code)
    s.spawn("python3 /opt/fake.py")
    for _ in range(500):
        try:
            if s.exec("test -e /tmp/fake-up", timeout=10).exit_code == 0:
                return
        except ConnectionLost as e:
            if "not by its keeper" in str(e):
                return  # swapped between the test and the answer
            # else the socket was between the fake's unlink and its bind: not up yet
        time.sleep(0.01)
    raise AssertionError("the fake agent did not start")


# --- 1. a handle of a dead sandbox must never reach another sandbox -------------------------------


def test_a_dead_sandbox_whose_pid_went_to_another_agent_is_lost_not_redirected():
    """A's agent dies; the kernel hands its pid to C's agent. A's handles must fail, and C stay untouched."""
    a = agentenv.Sandbox.create()
    c = agentenv.Sandbox.create()
    try:
        c_host = c.exec("hostname").stdout
        assert a.exec("hostname").stdout != c_host  # (pins A's agent in this handle)
        os.kill(agent_pid(a), signal.SIGKILL)  # OOM, pids exhaustion ...: the agent is gone
        wait_gone(a.record.init_pid)
        # the pid reuse, made deterministic: A's record now names C's agent (A's start time kept, then C's too)
        record = a.lifecycle.container.bundle / "sandbox.json"
        rec = json.loads(record.read_text())
        for start in (rec.get("init_start"), c.record.init_start):
            rec.update(init_pid=agent_pid(c), init_start=start)
            record.write_text(json.dumps(rec))
            for handle in (a, agentenv.Sandbox.get(a.id)):  # the old handle and a fresh one
                with pytest.raises(SandboxLost):
                    handle.exec("hostname")
                with pytest.raises(SandboxLost):
                    handle.write_file("/tmp/x", b"hi")
        assert a.state == "lost"
        assert c.exec("hostname").stdout == c_host
        assert c.exec("test -e /tmp/x").exit_code == 1  # nothing landed in C
    finally:
        a.close()
        c.close()


def test_a_handle_left_stale_by_another_handles_pause_and_resume_follows_the_sandbox():
    with agentenv.Sandbox.create() as a:
        stale = agentenv.Sandbox.get(a.id)
        host = stale.exec("hostname").stdout  # pins the first agent
        old_pid = agent_pid(a)
        a.pause()
        with pytest.raises(SandboxStateError):
            stale.exec("true")
        a.resume()
        assert agent_pid(a) != old_pid
        assert stale.exec("hostname").stdout == host
        stale.write_file("/tmp/from-stale", b"ok")
        assert a.read_file("/tmp/from-stale") == b"ok"


# --- 2. a process in the sandbox serving a fake agent on the socket ------------------------------


@pytest.mark.parametrize("behaviour", ["huge", "accept-and-close"])
def test_a_fake_agent_on_the_socket_is_refused(sb, behaviour):
    """A 4 GiB frame made one read_file grow the host by 1.4 GB; accept-and-close kept a call spinning."""
    fake_agent(sb, behaviour)
    before = peak_rss()
    with pytest.raises(ConnectionLost, match="not by its keeper"):
        sb.read_file("/etc/hostname")
    with pytest.raises(ConnectionLost, match="not by its keeper"):
        sb.exec("true")
    assert peak_rss() - before < 64 << 20


def peak_rss() -> int:
    return next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
                if line.startswith("VmHWM:"))


# --- 3. the disk: a sandbox fills its own limit, never the host's disk -----------------------------


def volume_used() -> int:
    st = os.statvfs(paths().volume)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def test_writing_past_the_disk_limit_fails_for_the_writer_only():
    """`dd` of 4 GiB once went to the host's disk at 2.4 GB/s; now the kernel stops it at the sandbox's limit."""
    with agentenv.Sandbox.create(memory="256m", disk="64m") as s:
        assert s.limits.disk == 64 << 20
        before = volume_used()
        r = s.exec("dd if=/dev/zero of=/big bs=1M count=512; echo rc=$?", timeout=120)
        assert "rc=0" not in r.stdout
        assert "Disk quota exceeded" in r.stderr or "No space left" in r.stderr, r.stderr
        assert int(s.exec("stat -c %s /big").stdout) <= 64 << 20
        assert volume_used() - before < 128 << 20  # nothing past the limit reached the disk (metadata aside)
        assert s.exec("echo alive").stdout == "alive\n"  # the keeper answers: its socket and logs are not there
        with pytest.raises(OSError, match="quota|space") as full:  # as a write to a full local disk fails
            s.write_file("/more", b"x" * (32 << 20))
        assert full.value.errno in (errno.EDQUOT, errno.ENOSPC) and "[Errno" not in full.value.strerror
        s.exec("rm /big")
        assert s.exec("head -c 32M /dev/zero > /again && echo ok", timeout=120).stdout == "ok\n"  # room again


def test_a_fork_keeps_the_disk_limit_and_counts_what_it_inherited():
    with agentenv.Sandbox.create(memory="256m", disk="64m") as s:
        s.exec("head -c 48M /dev/urandom > /testbed/f")
        for memory in (False, True):
            [kid] = s.fork(1, memory=memory)
            try:
                assert kid.limits.disk == 64 << 20
                kid.exec("dd if=/dev/zero of=/x bs=1M count=64", timeout=120)
                assert int(kid.exec("stat -c %s /x").stdout) <= 20 << 20  # 64 MiB less the 48 it started with
                assert kid.exec("echo alive").stdout == "alive\n"
            finally:
                kid.close()


def test_a_snapshot_past_the_stores_limit_is_refused_and_leaves_nothing():
    """A filesystem snapshot of 4 GiB froze the sandbox 15 s and took 4.3 GB more; now its files are reflinks,
    and the store has a limit of its own."""
    with agentenv.Sandbox.create(memory="256m", disk="512m") as s:
        s.exec("head -c 300M /dev/urandom > /testbed/big", timeout=120)
        store.set_limit("256m")
        try:
            with pytest.raises(StoreFullError):
                s.snapshot()
            with pytest.raises(StoreFullError):
                s.fork(1)
            assert agentenv.Snapshot.list() == []
            assert [p.name for p in paths().snapshots.iterdir() if p.name != ".lock"] == []
            assert list(paths().snapshot_files.iterdir()) == []
            assert [sb.id for sb in agentenv.Sandbox.list()] == [s.id]
            assert s.exec("echo alive").stdout == "alive\n"
            store.set_limit("1g")
            before = volume_used()
            snap = s.snapshot()  # the files are shared with the sandbox: the disk barely notices
            assert snap.size_bytes >= 300 << 20 and volume_used() - before < 64 << 20
            snap.delete()
        finally:
            store.set_limit(None)


def test_without_a_volume_disk_limits_are_a_typed_error_and_disk_none_runs_unlimited(request, monkeypatch):
    with agentenv.Sandbox.create(memory="256m", disk=None) as s:
        assert s.limits.disk is None and s.exec("echo ok").stdout == "ok\n"
    home = Path(tempfile.mkdtemp(dir="/var/tmp"))  # one the sandbox's root can pass through (pytest's is closed)
    request.addfinalizer(lambda: cleanup(home))  # its mounts too (the uid ranges' namespaces)
    monkeypatch.setenv("AGENTENV_HOME", str(home))
    monkeypatch.setenv(volume.VOLUME_ENV, "off")  # as on a host without btrfs-progs or loop devices
    with pytest.raises(DiskLimitUnsupported, match="AGENTENV_VOLUME") as e:
        agentenv.Sandbox.create(memory="256m")
    assert "disk=None" in str(e.value) and "bootstrap.sh" in str(e.value)
    assert agentenv.Sandbox.list() == []
    with agentenv.Sandbox.create(memory="256m", disk=None) as s:
        assert s.exec("echo unlimited").stdout == "unlimited\n"
    assert agentenv.Sandbox.list() == []


# --- 4. the agent cannot be stopped from inside; a stopped agent is a deadline, not a hang ---------


def test_ptrace_of_the_agent_from_inside_fails(sb):
    r = sb.exec(TRACE_PID_1)
    assert r.stdout.split()[0] == "-1", f"PTRACE_ATTACH to the agent succeeded: {r.stdout}"
    assert agent_state(agent_pid(sb)) != "t"
    assert sb.exec("echo alive").stdout == "alive\n"
    assert sb.exec("cat /proc/1/environ").exit_code != 0  # not dumpable: its /proc files are closed to the sandbox


def test_the_seccomp_profile_refuses_what_a_sandbox_needs_not(sb):
    assert "Seccomp:\t2" in sb.exec("cat /proc/self/status").stdout
    probes = {"io_uring_setup": "libc.syscall(425, 1, 0)", "keyctl": "libc.syscall(250, 0, 0, 0, 0, 0)",
              "unshare(NEWUSER)": "libc.unshare(0x10000000)", "process_vm_readv": "libc.syscall(310, 1, 0, 0, 0, 0, 0)",
              "socket(AF_VSOCK)": "libc.socket(40, 1, 0)"}
    code = "import ctypes; libc = ctypes.CDLL(None, use_errno=True)\n" + "\n".join(
        f"r = {call}; print({name!r}, r, ctypes.get_errno())" for name, call in probes.items())
    sb.write_file("/tmp/probe.py", code)
    out = sb.exec("python3 /tmp/probe.py").stdout.splitlines()
    assert len(out) == len(probes)
    for line in out:
        assert line.endswith(" -1 1"), f"not refused with EPERM: {line}"
    # what ordinary programs do still works: threads (clone3 -> ENOSYS -> clone), fork, chroot's capability
    assert sb.exec("python3 -c 'import threading; t = threading.Thread(target=print, args=(1,)); t.start()'").stdout == "1\n"


def test_seccomp_and_the_agents_protection_survive_a_memory_snapshot(sb):
    snap = sb.snapshot(memory=True)  # CRIU dumps the seccomp filter with the processes
    try:
        with agentenv.Sandbox.restore(snap) as r:
            assert "Seccomp:\t2" in r.exec("cat /proc/self/status").stdout
            assert r.exec(TRACE_PID_1).stdout.split()[0] == "-1"
            assert r.exec("cat /proc/1/environ").exit_code != 0
            assert r.exec("cat /proc/self/oom_score_adj").stdout == "1000\n"
    finally:
        snap.delete()


def test_a_snapshot_of_a_stopped_agent_fails_within_its_deadline_and_leaves_the_sandbox_running(sb, monkeypatch):
    monkeypatch.setattr(snapshotting, "QUIESCE_TIMEOUT", 2.0)
    monkeypatch.setattr(channel, "CALL_TIMEOUT", 2.0)
    pid = agent_pid(sb)
    os.kill(pid, signal.SIGSTOP)  # what PTRACE_ATTACH from inside did
    try:
        with pytest.raises(ConnectionLost, match="did not get ready") as e:
            sb.snapshot(memory=True)
        assert re.search(r"keeper threads: \d+ T ", str(e.value)), e.value  # the error says it is stopped
        assert not sb.lifecycle.container.frozen()
        with pytest.raises(ConnectionLost, match="did not answer"):
            sb.exec("true", timeout=1)
        with pytest.raises(ConnectionLost):
            sb.pause()
        assert sb.state == "running"
        assert agentenv.Snapshot.list() == []
    finally:
        os.kill(pid, signal.SIGCONT)
    assert sb.exec("echo alive").stdout == "alive\n"


def test_one_stopped_sandbox_does_not_stall_the_ttl_reaper(monkeypatch):
    monkeypatch.setattr(snapshotting, "QUIESCE_TIMEOUT", 2.0)
    keep = {expiry.ON_EXPIRY: "pause"}  # a pause is what a stopped keeper can stall (a close never waits on it)
    stuck = agentenv.Sandbox.create(ttl=600, labels=keep)
    fine = agentenv.Sandbox.create(ttl=600, labels=keep)
    pid = agent_pid(stuck)
    try:
        for s in (stuck, fine):
            s.set_ttl(0.001)
        os.kill(pid, signal.SIGSTOP)
        time.sleep(0.01)
        assert agentenv.Sandbox.reap_expired() == [fine.id]
        assert fine.state == "paused" and stuck.state == "running"
    finally:
        os.kill(pid, signal.SIGCONT)
        stuck.close()
        fine.close()


def test_the_reaper_spares_a_sandbox_whose_ttl_was_extended_after_it_looked():
    """The reaper lists the sandboxes, then a connect extends one's TTL, then the reaper reaches it: it checks
    again under the sandbox's lock, and the sandbox keeps running."""
    sb = agentenv.Sandbox.create(ttl=600)
    try:
        sb.set_ttl(0.001)
        time.sleep(0.01)  # past the TTL by the clock (not a wait for any state)
        stale = [s for s in agentenv.Sandbox.list() if s.id == sb.id]  # what the reaper read: due
        assert stale and stale[0].expires_at is not None and stale[0].expires_at < time.time()
        sb.set_ttl(600)  # the connect, between the reaper's look and its pause
        assert expiry.reap(stale) == []
        assert sb.state == "running" and sb.exec("echo alive").stdout == "alive\n"
        sb.set_ttl(0.001)
        time.sleep(0.01)
        assert expiry.reap(agentenv.Sandbox.list()) == [sb.id] and sb.state == "closed"  # due still means reaped (closed)
    finally:
        sb.close()


# --- 5. the agent survives what its sandbox throws at it -----------------------------------------


def test_out_of_pids_the_next_exec_is_an_error_not_the_agents_death():
    with agentenv.Sandbox.create(pids=24) as s:
        filler = s.spawn("python3 -c 'import os, time\n"
                         "n = 0\n"
                         "while True:\n"
                         "    try:\n"
                         "        pid = os.fork()\n"
                         "    except OSError:\n"
                         "        break\n"
                         "    if pid == 0:\n"
                         "        time.sleep(1000); os._exit(0)\n"
                         "    n += 1\n"
                         "print(\"full\", n, flush=True); time.sleep(1000)'")
        for _ in range(1000):
            if "full" in filler.output():  # a read: served on the accept loop when no thread can start
                break
            time.sleep(0.01)
        else:
            raise AssertionError("the pids did not fill up")
        with pytest.raises(SandboxError, match="out of processes"):
            s.exec("echo hi")
        s.ping()
        filler.kill()  # the kill needs no process either: its whole group goes
        for _ in range(500):
            try:
                if s.exec("echo alive").stdout == "alive\n":
                    break
            except SandboxError:
                time.sleep(0.01)
        assert s.exec("echo alive").stdout == "alive\n"


def test_filling_dev_shm_leaves_the_agent_alive(sb):
    r = sb.exec("head -c 300M /dev/zero > /dev/shm/fill; echo rc=$?", timeout=60)
    assert "No space left" in r.stderr or "rc=0" not in r.stdout
    assert sb.exec("echo alive").stdout == "alive\n"
    assert int(sb.exec("stat -c %s /dev/shm/fill").stdout) <= 128 << 20  # half the memory at most
    sb.exec("rm /dev/shm/fill")


def test_every_process_of_the_sandbox_is_a_likelier_oom_victim_than_the_agent(sb):
    assert sb.exec("cat /proc/self/oom_score_adj").stdout == "1000\n"
    p = sb.spawn("sleep 100")
    assert sb.exec(f"cat /proc/{p.pid}/oom_score_adj").stdout == "1000\n"
    assert int(Path(f"/proc/{agent_pid(sb)}/oom_score_adj").read_text()) <= 0


def test_a_big_upload_near_the_memory_limit_streams_through(sb):
    """200 MB into a 256 MB sandbox: held twice, it got the agent OOM-killed."""
    blob = os.urandom(1 << 20) * 200
    sb.write_file("/testbed/big.bin", blob)
    assert sb.exec("stat -c %s /testbed/big.bin").stdout == f"{len(blob)}\n"
    assert sb.read_file("/testbed/big.bin") == blob
    hwm = next(int(line.split()[1]) for line in Path(f"/proc/{agent_pid(sb)}/status").read_text().splitlines()
               if line.startswith("VmHWM:"))
    assert hwm < 100 << 10, f"the agent's peak memory was {hwm} kB"
    assert sb.exec("echo alive").stdout == "alive\n"


def test_endless_files_and_floods_of_output_do_not_starve_a_small_sandboxs_agent():
    """read_file('/dev/zero') and 150 MB of output each got the agent of a 64 MB sandbox OOM-killed."""
    with agentenv.Sandbox.create(memory="64m") as s:
        s.exec("mkfifo /tmp/fifo")
        for path in ("/dev/zero", "/tmp/fifo", "/proc/self/pagemap"):  # endless, blocking, unsized and huge
            with pytest.raises(ValueError):
                s.read_file(path)
        assert s.read_file("/proc/self/status").startswith(b"Name:")
        r = s.exec("yes | head -c 150M")
        assert r.exit_code == 0 and "more bytes of output were dropped" in r.stdout
        assert len(r.stdout) < 8 << 20  # kept: a sixteenth of the memory
        assert s.exec("echo alive").stdout == "alive\n"


@pytest.mark.parametrize("sig", ["TERM", "INT", "HUP", "KILL", "STOP"])
def test_signals_to_pid_1_from_inside_do_not_end_the_agent(sb, sig):
    sb.exec(f"kill -{sig} 1; sleep 0.1")
    assert agent_state(agent_pid(sb)) not in ("T", "t", "Z")
    assert sb.exec("echo alive").stdout == "alive\n"


# --- 9 and the socket: the file API and symlinks cannot break the agent ---------------------------


@pytest.mark.parametrize("path", ["/dev/agentenv/agent.sock", "/dev/agentenv/x", "/.agentenv/keeper.py",
                                  "//dev/agentenv/../agentenv/agent.sock", "../../dev/agentenv/agent.sock"])
def test_the_file_api_refuses_the_agents_own_files(sb, path):
    with pytest.raises(PermissionError):
        sb.write_file(path, b"x")
    with pytest.raises(PermissionError):
        sb.read_file(path)
    assert sb.exec("echo alive").stdout == "alive\n"


def test_the_file_api_refuses_the_agents_folder_through_a_symlink(sb):
    sb.exec("ln -s /dev/agentenv /tmp/ae")
    with pytest.raises(PermissionError):
        sb.write_file("/tmp/ae/agent.sock", b"x")
    assert sb.exec("echo alive").stdout == "alive\n"
    p = sb.spawn("echo logged")  # the process logs under the agent's folder stay readable
    p.wait(10)
    assert p.output() == "logged\n"


def test_a_symlinked_socket_folder_cannot_send_the_host_elsewhere(sb):
    sb.exec(f"mv {keeper.SOCKET_DIR} /dev/real && ln -s /run {keeper.SOCKET_DIR}")
    with pytest.raises(ConnectionLost):
        sb.exec("true")
