"""share_memory (agentenv.host.ksm): off for a plain sandbox, on by default for an env's (so a rollout group
forked from it merges) with the env's opt-out, carried to forks, copy-on-write kept after KSM merged the children's
pages, and KSM back as it was found once no sharing sandbox runs."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import pytest

import agentenv
from agentenv.errors import MemorySharingUnsupported
from agentenv.host import images, ksm, volume
from envs import ShellEnv
from rollout.groups import branch, close_all

from .conftest import cleanup
from .server_fixtures import TOKEN, threaded_server

pytestmark = pytest.mark.integration

GET_MERGE = "python3 -c 'import ctypes; print(ctypes.CDLL(None).prctl(68, 0, 0, 0, 0))'"  # PR_GET_MEMORY_MERGE
# 16 MB of pages, distinct from each other (KSM merges across processes, not within one): SIGUSR1 writes the
# digest to /tmp/sum, SIGUSR2 writes into every page
HOLDER = b"""
import hashlib, os, signal, time
b = bytearray(os.urandom(16 << 20))
def digest(*_):
    with open("/tmp/sum.tmp", "w") as f:
        f.write(hashlib.sha256(b).hexdigest())
    os.rename("/tmp/sum.tmp", "/tmp/sum")
def scribble(*_):
    b[::4096] = bytes(len(b) // 4096)
    digest()
signal.signal(signal.SIGUSR1, digest)
signal.signal(signal.SIGUSR2, scribble)
digest()
while True:
    time.sleep(1)
"""


def another_home_shares() -> str | None:
    """The agentenv home whose sandboxes share this host's memory now, when it is not this session's (KSM merges one
    home's at a time: then this session's share_memory=True is refused, and its default gets none)."""
    holder = ksm.holder()
    return holder if holder not in (None, ksm.owner()) else None


@pytest.fixture()
def merging_here() -> None:
    """Skip a test that needs this session's sandboxes to share while another home's do (another run on the host):
    what cannot run here is said, not failed."""
    if (other := another_home_shares()) is not None:
        pytest.skip(f"the sandboxes of another agentenv home ({other}) share this host's memory now")


def flagged(sb: agentenv.Sandbox) -> bool:
    """The sandbox's agent has the flag (host view), and a command it starts inherits it (the sandbox's view)."""
    inside = sb.exec(GET_MERGE)
    assert inside.exit_code == 0, inside.stderr
    host = ksm.merge_any(sb.record.init_pid)
    assert host == (inside.stdout.strip() == "1")
    return host


def signal_digest(sb: agentenv.Sandbox, pid: int, sig: str) -> str:
    r = sb.exec(f"rm -f /tmp/sum; kill -{sig} {pid}; for i in $(seq 400); do test -f /tmp/sum && break; "
                "sleep 0.05; done; cat /tmp/sum")
    assert r.exit_code == 0 and r.stdout.strip(), r.stderr
    return r.stdout.strip()


def holder_host_pid(sb: agentenv.Sandbox) -> int:
    """The host pid of the holder (the sandbox's process with the most merged or resident pages)."""
    pids = [p for p in sb.lifecycle.container.pids() if p != sb.record.init_pid]
    return max(pids, key=lambda p: int(open(f"/proc/{p}/statm").read().split()[1]))


ASK_MERGE = ("python3 -c 'import ctypes, mmap; c = ctypes.CDLL(None, use_errno=True); m = mmap.mmap(-1, 1 << 16); "
             "a = ctypes.addressof(ctypes.c_char.from_buffer(m)); "
             "print(c.prctl(67, 1, 0, 0, 0), c.madvise(ctypes.c_void_p(a), 1 << 16, 12), ctypes.get_errno())'")


def test_a_sandbox_without_the_opt_in_has_no_mergeable_memory_and_cannot_ask_for_it():
    with agentenv.Sandbox.create() as sb:
        assert not flagged(sb)
        r = sb.exec(ASK_MERGE)  # its code asks itself (seccomp: EPERM), and still has no mergeable memory
        assert r.stdout.split() == ["-1", "-1", "1"], (r.stdout, r.stderr)
        assert not flagged(sb) and ksm.merging_pages(sb.record.init_pid) == 0


def start_holder(sb: agentenv.Sandbox) -> int:
    """The HOLDER running in ``sb`` with its handlers set (a signal no longer kills it); its pid in the sandbox."""
    sb.write_file("/opt/holder.py", HOLDER)
    proc = sb.spawn("exec python3 /opt/holder.py")
    up = sb.exec("for i in $(seq 400); do test -f /tmp/sum && break; sleep 0.05; done; cat /tmp/sum")
    assert up.exit_code == 0, "the holder did not start"
    return proc.pid


def wait_merged(kids: list[agentenv.Sandbox]) -> None:
    """KSM merges in its own time: wait on the state (the children's holders have merged pages), generously."""
    deadline = time.monotonic() + 120
    while not all(ksm.merging_pages(holder_host_pid(k)) > 1000 for k in kids):
        assert time.monotonic() < deadline, f"KSM merged nothing in 120 s: {ksm.stats()}"
        time.sleep(0.2)


@pytest.mark.parametrize(("kwargs", "shares"), [({}, True), ({"share_memory": False}, False)])
def test_a_rollout_group_shares_by_default_and_not_with_the_opt_out(kwargs, shares):
    """An env's sandbox is made at reset with share_memory where the host can (its record says what it got), and
    a group forked from it by the rollout path (rollout.groups.branch) keeps it: KSM merges the children's copies
    of the parent's memory. ``share_memory=False`` in the env's kwargs: none of that."""
    if shares and (other := another_home_shares()) is not None:
        pytest.skip(f"the sandboxes of another agentenv home ({other}) share this host's memory now")
    env = ShellEnv(memory="256m", **kwargs)
    kids = []
    try:
        env.reset()
        parent = agentenv.Sandbox.get(env.sandbox.id)
        assert parent.record.spec["share_memory"] is shares and flagged(parent) is shares
        start_holder(parent)
        kids = branch(env, 2, True, lambda: ShellEnv(memory="256m", **kwargs), None)
        boxes = [agentenv.Sandbox.get(k.unwrapped.sandbox.id) for k in kids]
        assert [b.record.spec["share_memory"] for b in boxes] == [shares, shares]
        assert [flagged(b) for b in boxes] == [shares, shares]
        if shares:
            assert ksm.holder() == ksm.owner() and ksm.stats().run
            wait_merged(boxes)
        else:
            assert all(ksm.merging_pages(p) == 0 for b in [parent, *boxes] for p in b.lifecycle.container.pids())
    finally:
        close_all(kids)
        env.close()


def test_forks_inherit_sharing_and_diverge_after_a_write_once_merged(merging_here):
    found = ksm._read("run")
    sb = agentenv.Sandbox.create(share_memory=True)
    kids: list[agentenv.Sandbox] = []
    try:
        assert flagged(sb)
        assert ksm.stats().run
        pid = start_holder(sb)
        first = signal_digest(sb, pid, "USR1")
        kids = sb.fork(2)
        assert all(flagged(k) for k in kids)  # the restored agent flagged again, and what it starts
        wait_merged(kids)
        scribbled = signal_digest(kids[0], pid, "USR2")
        assert scribbled != first
        assert signal_digest(kids[1], pid, "USR1") == first  # the other child and the parent kept theirs
        assert signal_digest(sb, pid, "USR1") == first
        assert signal_digest(kids[0], pid, "USR1") == scribbled
    finally:
        for k in [*kids, sb]:
            k.close()
    if not ksm.wanted():  # another sharing sandbox of this host (another test session) keeps it on
        assert ksm._read("run") == found


def test_a_memory_snapshot_of_a_sharing_sandbox_restores_sharing(merging_here):
    with agentenv.Sandbox.create(share_memory=True) as sb:
        snap = sb.snapshot(memory=True)
    try:
        with agentenv.Sandbox.restore(snap) as r:
            assert flagged(r)
            assert ksm.stats().run
    finally:
        snap.delete()


def test_the_remote_api_carries_the_opt_in_and_the_default(merging_here):
    with threaded_server() as url, agentenv.connect(url, TOKEN) as client:
        with client.Sandbox.create(memory="256m", share_memory=True) as sb:
            assert sb.exec(GET_MERGE).stdout.strip() == "1"
            assert ksm.merge_any(agentenv.Sandbox.get(sb.id).record.init_pid)
        with client.Sandbox.create(memory="256m") as sb:
            assert sb.exec(GET_MERGE).stdout.strip() == "0"
        free = ksm.holder() in (None, ksm.owner())  # the server is this home's: its default shares unless another's
        with client.Sandbox.create(memory="256m", share_memory=None) as sb:
            assert sb.exec(GET_MERGE).stdout.strip() == ("1" if free else "0")


def test_another_homes_sandboxes_never_merge_with_ours(request, monkeypatch, merging_here):
    """KSM merges every flagged process of the host alike, so the host's merging is one agentenv home's at a time:
    while this session's sharing sandbox runs, another home's default gets a plain sandbox (no flag, so never
    merged with ours), and its explicit share_memory=True is refused, naming the home that shares."""
    mine = ksm.owner()
    with agentenv.Sandbox.create(memory="256m", share_memory=True) as ours:
        assert flagged(ours) and ksm.holder() == mine
        home = Path(tempfile.mkdtemp(dir="/var/tmp"))  # another owner: one the sandbox's root can pass through
        request.addfinalizer(lambda: cleanup(home))
        monkeypatch.setenv("AGENTENV_HOME", str(home))
        monkeypatch.setenv(volume.VOLUME_ENV, "off")  # a light home: no volume of its own (disk=None)
        with agentenv.Sandbox.create(memory="256m", disk=None, share_memory=None) as theirs:
            assert theirs.record.spec["share_memory"] is False and not flagged(theirs)
            assert theirs.exec(ASK_MERGE).stdout.split() == ["-1", "-1", "1"]  # nor can its code ask (seccomp)
        with pytest.raises(MemorySharingUnsupported, match="another agentenv home") as e:
            agentenv.Sandbox.create(memory="256m", disk=None, share_memory=True)
        assert mine in str(e.value) and "without share_memory" in (e.value.fix or "")
        assert agentenv.Sandbox.list() == []



NO_CTYPES = "agentenv-test/no-ctypes:1"


@pytest.fixture(scope="module")
def no_ctypes_image(tmp_path_factory) -> str:
    """agentenv's base image without ctypes in its python3: its keeper cannot flag its own pages."""
    context = tmp_path_factory.mktemp("no-ctypes")
    (context / "Dockerfile").write_text("FROM agentenv/base\nRUN rm -rf /usr/lib/python3*/ctypes "
                                        "/usr/lib/python3*/lib-dynload/_ctypes*\n")
    images.build(str(context), NO_CTYPES)
    yield NO_CTYPES
    images.docker_client().images.remove(NO_CTYPES, force=True)


def test_the_default_falls_back_where_the_images_python3_cannot_flag_its_pages(no_ctypes_image, merging_here):
    """share_memory=None (the envs' default) on an image whose python3 lacks ctypes starts a sandbox that does not
    share (it used to fail to start); share_memory=True still refuses, naming the fix, and leaves nothing behind."""
    with agentenv.Sandbox.create(no_ctypes_image, share_memory=None) as sb:
        assert sb.record.spec["share_memory"] is False
        assert not ksm.merge_any(sb.record.init_pid)
        assert sb.exec("echo up").stdout == "up\n"
    with pytest.raises(MemorySharingUnsupported, match="could not mark its memory mergeable") as e:
        agentenv.Sandbox.create(no_ctypes_image, share_memory=True)
    assert "ctypes" in (e.value.fix or "")
    assert [s for s in agentenv.Sandbox.list() if s.image == no_ctypes_image] == []
