"""The pooled files-fork path (``agentenv.sandbox.forking``: a warm pool's sandbox given a clone of the parent's layer by
``hostcalls.swap_root``, its keeper re-executed by the op ``reroot``) against what a hostile sandbox or an ordinary
host can do to it: code inside a sandbox sending ``reroot`` itself, a host whose mounts propagate (systemd's
default), a pooled sandbox whose recorded agent pid now names another process, a fork of a sandbox that waits in
the pool itself, kill -9 mid-swap, and the pooled child's later life (pause and resume, a restore in another
process, forks from two threads at once)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import agentenv
from agentenv.config import CRASH_ENV, paths
from agentenv.errors import ConnectionLost
from agentenv.sandbox import sweep, warm

from .test_fork_files import settled

pytestmark = pytest.mark.integration

LIMITS = {"memory": "256m", "disk": "1g"}


def host_mounts_under(folder: Path) -> list[str]:
    """Mount points of this (the host's) mount namespace inside ``folder``."""
    return sorted(m.split()[4] for m in Path("/proc/self/mountinfo").read_text().splitlines()
                  if m.split()[4].startswith(str(folder) + "/"))


def kids_of_pool(kids: list[agentenv.Sandbox], pool: set[str]) -> None:
    assert {k.id for k in kids} <= pool, "the children were not taken from the pool"


@pytest.fixture
def pool():
    """Fill a warm pool of ``n`` sandboxes made like ``LIMITS`` and return their ids; drained after the test. Filled
    before a test's parents are made (a create takes from the pool: a parent then is of the pool's fork family,
    whose sandboxes alone can be its children, agentenv.host.userns), and again once they are."""

    def fill(n: int) -> set[str]:
        warm.configure("agentenv/base", n, **LIMITS)
        assert warm.wait_full(120)
        return {sb.id for sb in agentenv.Sandbox.list() if sb.labels.get("agentenv.kind") == warm.KIND}

    try:
        yield fill
    finally:
        warm.drain()


# --- the agent's reroot op is the host's alone ---------------------------------------------------------

ATTACK = r'''
import json, os, socket, struct, time
IMPOSTOR = ("src = open('/.agentenv/keeper.py').read().replace('_CHILD_PREFIX + str(header[\"cmd\"])', "
            "'\"echo impostor; \" + str(header[\"cmd\"])'); exec(compile(src, 'impostor', 'exec'))")
s = socket.socket(socket.AF_UNIX)
s.connect("/dev/agentenv/agent.sock")
head = json.dumps({"op": "reroot", "cwd": "/", "argv": ["python3", "-c", IMPOSTOR], "env": {}}).encode()
s.sendall(struct.pack(">II", len(head), 0) + head)
size = struct.unpack(">II", s.recv(8))[0]
reply = b""
while len(reply) < size:
    reply += s.recv(size - len(reply))
for _ in range(200):  # an agent that re-executed itself listens again
    if os.path.exists("/dev/agentenv/agent.sock"):
        break
    time.sleep(0.05)
open("/tmp/attack.out", "w").write(reply.decode())
'''


def test_code_in_a_sandbox_cannot_make_its_agent_reexecute_as_another_program():
    # reroot (a pooled fork child's agent starting again from its new root) replaces PID 1's program with the
    # argv of the request; sent from inside, the sandbox's own code would run as its keeper, whose pid is the
    # one the host pins and checks (SO_PEERCRED): an impostor the host could not tell from the agent
    with agentenv.Sandbox.create(**LIMITS) as sb:
        sb.write_file("/tmp/attack.py", ATTACK)
        sb.spawn("python3 /tmp/attack.py")
        def finished() -> bool:
            try:
                return "done" in sb.exec("test -e /tmp/attack.out && echo done").stdout
            except ConnectionLost:  # the agent re-executing itself: its socket is not there for a moment
                return False

        settled(finished, "the attack did not finish")
        reply = json.loads(sb.read_file("/tmp/attack.out"))
        assert reply.get("error") == "PermissionError", reply
        assert sb.exec("echo real").stdout == "real\n"
        assert "impostor" not in sb.exec("cat /proc/1/cmdline").stdout


# --- a host whose mounts are shared (systemd makes / shared) ---------------------------------------------

@pytest.fixture
def shared_sandboxes_folder():
    """The sandboxes' folder as on a systemd host: under a shared mount, so that each sandbox's root mounted
    there is shared too (propagation to and from its peers)."""
    folder = str(paths().sandboxes)
    subprocess.run(["mount", "--bind", folder, folder], check=True)
    try:
        subprocess.run(["mount", "--make-shared", folder], check=True)
        yield Path(folder)
    finally:
        subprocess.run(["umount", "-l", folder], check=True)


def test_on_a_host_with_shared_mounts_the_pooled_child_gets_its_root_swapped(shared_sandboxes_folder, caplog):
    # pivot_root refuses a new root that is shared, and every mount moved onto a shared one would be copied into
    # the host's mount namespace (under the sandbox's rootfs): the new root must be private in the sandbox
    warm.configure("agentenv/base", 1, **LIMITS)  # first: the parent, taken from it, is of its fork family
    assert warm.wait_full(120)
    with agentenv.Sandbox.create(**LIMITS) as parent:
        parent.write_file("/testbed/mine", "parent's")
        try:
            assert warm.wait_full(120)
            pooled = warm.waiting()[0]
            kids = parent.fork(1, memory=False)
        finally:
            warm.drain()
        kid = kids[0]
        try:
            assert kid.id == pooled
            assert "starting it afresh" not in caplog.text  # swapped, not booted again by runc
            assert kid.exec("cat /testbed/mine").stdout == "parent's"
            root = next(line for line in kid.exec("cat /proc/self/mountinfo").stdout.splitlines()
                        if line.split()[4] == "/")
            assert "shared:" not in root  # no peer on the host: nothing propagates between them
            assert host_mounts_under(kid.lifecycle.container.bundle) == sorted([str(kid.lifecycle.container.rootfs),
                                                                       str(kid.lifecycle.container.netns)])
        finally:
            kid.close()


# --- a pooled sandbox's record naming a pid that is now another process's ---------------------------------

def test_a_pooled_sandbox_whose_agent_pid_names_another_sandbox_never_swaps_that_ones_root(pool, caplog):
    # the pid in a record can outlive its process (an agent that died behind our back, its number given to a
    # process of another sandbox): the swap must pin the agent as every call does, never act on a bare pid
    pool(2)
    with agentenv.Sandbox.create(**LIMITS) as parent, agentenv.Sandbox.create(**LIMITS) as bystander:
        parent.write_file("/testbed/mine", "parent's")
        bystander.write_file("/testbed/mine", "bystander's")
        pooled = pool(2)
        victim = next(sb for sb in agentenv.Sandbox.list() if sb.id in pooled)
        with victim.locked():  # as if its keeper had died and the bystander's got its pid
            victim.amend(init_pid=bystander.record.init_pid)
            victim.save_record()
        try:
            kids = parent.fork(2, memory=False)
        finally:
            assert bystander.exec("cat /testbed/mine").stdout == "bystander's"  # its own root, untouched
        try:
            kids_of_pool(kids, pooled)
            assert "starting it afresh" in caplog.text  # the child with the stale pid was booted instead
            assert [k.exec("cat /testbed/mine").stdout for k in kids] == ["parent's"] * 2
        finally:
            for k in kids:
                k.close()
        assert bystander.exec("cat /testbed/mine").stdout == "bystander's"


# --- guarantees that held: pinned so that they keep holding -------------------------------------------------

def test_a_pooled_child_pauses_resumes_and_restores_in_another_process(pool):
    pool(1)
    with agentenv.Sandbox.create(**LIMITS) as parent:
        parent.write_file("/testbed/mine", "parent's")
        pooled = pool(1)
        kid = parent.fork(1, memory=False)[0]
        try:
            kids_of_pool([kid], pooled)
            kid.spawn("sleep 1000")
            kid.pause()
            assert [p for p in paths().layers.iterdir() if p.name.startswith(kid.id)] == []
            kid.resume()
            assert [p.command for p in kid.processes()] == ["sleep 1000"]
            assert kid.exec("cat /testbed/mine").stdout == "parent's"
            snap = kid.snapshot(memory=True)
            try:
                script = (f"import sys; sys.path.insert(0, {os.getcwd()!r}); import agentenv\n"
                          f"with agentenv.Sandbox.restore({snap.id!r}) as r:\n"
                          "    print(r.exec('cat /testbed/mine').stdout, [p.command for p in r.processes()])\n")
                p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
                assert p.stdout == "parent's ['sleep 1000']\n", p.stderr
            finally:
                snap.delete()
        finally:
            kid.close()
    assert [p for p in paths().layers.iterdir() if p.name.split(".")[0] == kid.id] == []


def test_two_threads_forking_from_one_pool_get_distinct_children(pool):
    pool(4)
    with agentenv.Sandbox.create(**LIMITS) as a, agentenv.Sandbox.create(**LIMITS) as b:
        a.write_file("/testbed/mine", "a")
        b.write_file("/testbed/mine", "b")
        pooled = pool(4)
        got: dict[str, list[agentenv.Sandbox]] = {}
        errors: list[BaseException] = []

        def fork(sb: agentenv.Sandbox) -> None:
            try:
                got[sb.id] = sb.fork(2, memory=False)
            except BaseException as e:  # noqa: BLE001 - checked below
                errors.append(e)

        threads = [threading.Thread(target=fork, args=(sb,)) for sb in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        kids = got.get(a.id, []) + got.get(b.id, [])
        try:
            assert not errors, errors
            assert len({k.id for k in kids}) == 4
            kids_of_pool(kids, pooled)
            assert [k.exec("cat /testbed/mine").stdout for k in kids] == ["a", "a", "b", "b"]
        finally:
            for k in kids:
                k.close()


def test_kill_9_inside_the_root_swap_leaves_no_child_nor_mount():
    # the kill lands while the swap runs (its thread inside the pooled sandbox's mount namespace), or just after
    script = f"""
import sys
sys.path.insert(0, {os.getcwd()!r})
import agentenv
from agentenv.host import hostcalls
from agentenv.sandbox import forking, warm
warm.configure("agentenv/base", 1, memory="256m", disk="1g")  # first: the parent is of the pool's fork family
assert warm.wait_full(120)
sb = agentenv.Sandbox.create(memory="256m", disk="1g")
sb.write_file("/testbed/kept", "kept")
print(sb.id, flush=True)
assert warm.wait_full(120)
import os, signal, threading
orig = hostcalls.mount
def mount(source, target, fstype, flags=0, data=None):
    orig(source, target, fstype, flags, data)
    if flags & hostcalls.MS_MOVE and str(target).endswith("/dev"):
        os.kill(os.getpid(), signal.SIGKILL)  # /proc and /dev moved, /sys not yet: half-moved
hostcalls.mount = mount
sb.fork(1, memory=False)
"""
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       env={**os.environ, CRASH_ENV: ""}, check=False)
    assert p.returncode == -signal.SIGKILL, p.stderr
    parent = agentenv.Sandbox.get(p.stdout.split()[0])
    try:
        sweep.recover_all()
        assert parent.exec("cat /testbed/kept", timeout=30).stdout == "kept"
        others = [s for s in agentenv.Sandbox.list() if s.id != parent.id]
        assert all(s.labels.get("agentenv.kind") == warm.KIND for s in others)  # a refill at most: no child
        for s in others:
            s.close()
        settled(lambda: sorted(p.name for p in paths().layers.iterdir()) == [parent.id], "a child's layer stayed")
        assert host_mounts_under(paths().sandboxes) == sorted([str(parent.lifecycle.container.rootfs),
                                                               str(parent.lifecycle.container.netns)])
    finally:
        parent.close()


# --- a fork of a sandbox that is itself waiting in the pool ----------------------------------------------

def test_forking_a_sandbox_that_waits_in_the_pool_never_takes_it_as_its_own_child():
    # a pooled sandbox is listed like any other (Sandbox.list, the server's routes): forking it must not hand the
    # parent itself out as a child, whose lock the fork already holds (it would wait on itself for ever)
    script = f"""
import sys
sys.path.insert(0, {os.getcwd()!r})
import agentenv
from agentenv.sandbox import warm
warm.configure("agentenv/base", 1, memory="256m", disk="1g")
assert warm.wait_full(120)
pooled = agentenv.Sandbox.get(warm.waiting()[0])
print(pooled.id, flush=True)
pooled.write_file("/testbed/mine", "pooled")
kid = pooled.fork(1, memory=False)[0]
print(kid.id, kid.exec("cat /testbed/mine").stdout, flush=True)
kid.close()
warm.drain()
print("done", flush=True)
"""
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
    try:
        lines = out.split("\n")
        assert p.returncode == 0, (out, err)
        assert lines[1].split()[0] != lines[0] and lines[1].split()[1] == "pooled"
        assert lines[2] == "done"
    finally:
        sweep.recover_all()
        for s in agentenv.Sandbox.list():  # what the killed process left
            s.close()


def test_a_pooled_sandbox_someone_ran_a_process_in_is_booted_afresh_for_the_child(pool, caplog):
    # a pooled sandbox is listed like any other: whoever used it in the meantime (an exec through its id) may
    # have left a process there, which a swap would carry into the child, its cwd in the retired root
    pool(1)
    with agentenv.Sandbox.create(**LIMITS) as parent:
        parent.write_file("/testbed/mine", "parent's")
        pooled = agentenv.Sandbox.get(next(iter(pool(1))))
        r = pooled.exec("echo left > /testbed/left && (setsid sleep 1000 >/dev/null 2>&1 &)")
        assert r.exit_code == 0, r.stderr
        kid = parent.fork(1, memory=False)[0]
        try:
            assert kid.id == pooled.id and "starting it afresh" in caplog.text
            assert kid.exec("cat /testbed/mine").stdout == "parent's"
            assert kid.exec("pgrep -x sleep || echo none").stdout == "none\n"
            assert kid.exec("test -e /testbed/left || echo gone").stdout == "gone\n"
        finally:
            kid.close()
