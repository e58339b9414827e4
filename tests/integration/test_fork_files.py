"""Forks of the files alone (``fork(n, memory=False)``): each child's layer is a btrfs snapshot of the parent's
(``agentenv.sandbox.forking``), or, where layers cannot be cloned, a copy through the store. Either way the children get
every file, mode, link and deletion of the parent, then diverge; a ``kill -9`` mid-fork leaves no child. With a
warm pool the children are pooled sandboxes whose root is swapped: the same files, mounts and guarantees."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import agentenv
from agentenv.config import CRASH_ENV, paths
from agentenv.host import volume
from agentenv.sandbox import sweep, warm

pytestmark = pytest.mark.integration

# what the parent changes: a big file, many small ones, a mode, a symlink, a file of the image deleted
# (an overlay whiteout) and a folder of the image replaced (an opaque folder)
CHANGES = """set -e
mkdir -p /testbed/many && cd /testbed
head -c 150M /dev/urandom > big
for i in $(seq 1 1500); do echo $i > many/f$i; done
echo secret > mode && chmod 640 mode
ln -s big link
rm /etc/debian_version
rm -rf /usr/share/doc && mkdir /usr/share/doc && echo mine > /usr/share/doc/only
"""
STATE = ("cd /testbed && sha256sum big | cut -c1-16 && ls many | wc -l && stat -c %a mode && readlink link "
         "&& (test -e /etc/debian_version && echo present || echo deleted) && ls /usr/share/doc")


def store_is_empty() -> bool:
    return agentenv.Snapshot.list() == [] and not [p for p in paths().snapshot_files.iterdir()]


def settled(cond, what: str) -> None:
    for _ in range(200):  # the store's background deletes: a bound, not a timing check
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(what)


@pytest.fixture
def parent():
    with agentenv.Sandbox.create(memory="256m", disk="1g") as sb:
        r = sb.exec(CHANGES, timeout=300)
        assert r.exit_code == 0, r.stderr
        sb.spawn("sleep 1000")  # a process: the children of a files-only fork start without it
        yield sb


def check_children(parent: agentenv.Sandbox, kids: list[agentenv.Sandbox]) -> None:
    want = parent.exec(STATE).stdout
    assert "deleted" in want and want.endswith("only\n") and "1500" in want
    for k in kids:
        assert k.exec(STATE).stdout == want
        assert k.processes() == []
        assert k.limits == parent.limits
        assert k.forked_from == parent.id and k.info().forked_from == parent.id  # its lineage names its parent
    for i, k in enumerate(kids):  # then each goes its own way
        k.write_file("/testbed/mine", str(i))
    kids[0].exec("rm /testbed/big && echo changed > /testbed/many/f1")
    parent.exec("echo parent > /testbed/many/f2")
    assert [k.exec("cat /testbed/mine").stdout for k in kids] == [str(i) for i in range(len(kids))]
    assert kids[0].exec("test -e /testbed/big || echo gone").stdout == "gone\n"
    assert all(k.exec("sha256sum /testbed/big | cut -c1-16").stdout == want.split()[0] + "\n" for k in kids[1:])
    assert [k.exec("cat /testbed/many/f1 /testbed/many/f2").stdout for k in kids] == \
        ["changed\n2\n"] + ["1\n2\n"] * (len(kids) - 1)
    assert parent.exec("cat /testbed/many/f1 /testbed/many/f2; test -e /testbed/mine || echo none").stdout == \
        "1\nparent\nnone\n"


def test_a_files_fork_clones_the_layer_and_the_children_diverge(parent):
    assert volume.can_clone(parent.lifecycle.container.layer, paths().layers)
    kids = parent.fork(3, memory=False)
    try:
        assert all(volume.is_subvolume(k.lifecycle.container.layer) for k in kids)  # clones, not copies
        assert store_is_empty()  # nothing went through the snapshot store
        check_children(parent, kids)
    finally:
        for k in kids:
            k.close()


def test_where_layers_cannot_be_cloned_a_files_fork_copies_them(parent, monkeypatch):
    monkeypatch.setattr(volume, "can_clone", lambda src, dst: False)  # as on a volume without subvolumes
    kids = parent.fork(2, memory=False)
    try:
        check_children(parent, kids)
        settled(store_is_empty, "the fork's snapshot was not deleted")
    finally:
        for k in kids:
            k.close()


def test_snapshots_clone_the_layer_and_restores_clone_the_snapshot(parent):
    snap = parent.snapshot()
    try:
        assert snap.layer and volume.is_subvolume(snap.files)
        parent.exec("echo later > /testbed/many/f3")
        with agentenv.Sandbox.restore(snap) as r:
            assert volume.is_subvolume(r.lifecycle.container.layer)
            assert r.exec(STATE).stdout == parent.exec(STATE).stdout
            assert r.exec("cat /testbed/many/f3").stdout == "3\n"  # as it was at the snapshot
            r.exec("echo restored > /testbed/many/f4")
        with agentenv.Sandbox.restore(snap) as r2:  # the snapshot itself never changed
            assert r2.exec("cat /testbed/many/f4").stdout == "4\n"
    finally:
        snap.delete()
    assert not snap.files.exists()


@pytest.mark.parametrize(("point", "pooled"), [("fork:frozen", False), ("fork:cloned", False), ("fork:started", False),
                                               ("fork:cloned", True), ("fork:started", True)])
def test_kill_9_mid_files_fork_leaves_no_child_and_the_parent_running(point, pooled):
    # the pool first: the parent taken from it is of its fork family, whose sandboxes can be its children
    pool = 'warm.configure("agentenv/base", 2, memory="256m")\nassert warm.wait_full(120)' if pooled else ""
    script = f"""
import sys
sys.path.insert(0, {os.getcwd()!r})
import agentenv
from agentenv.sandbox import warm
{pool}
sb = agentenv.Sandbox.create(memory="256m")
sb.write_file("/testbed/kept", "kept")
print(sb.id, flush=True)
{pool}
sb.fork(2, memory=False)
"""
    env = {**os.environ, CRASH_ENV: point}
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=False)
    assert p.returncode == -signal.SIGKILL, p.stderr
    parent = agentenv.Sandbox.get(p.stdout.split()[0])
    try:
        found = sweep.recover_all()
        assert parent.id in found["running"]
        assert not parent.lifecycle.container.frozen()
        assert parent.exec("cat /testbed/kept", timeout=30).stdout == "kept"
        others = [s for s in agentenv.Sandbox.list() if s.id != parent.id]
        assert all(s.labels.get("agentenv.kind") == warm.KIND for s in others)  # the half-made children are gone
        for s in others:  # what the dead process's pool had refilled (reaped after its idle ttl otherwise)
            s.close()
        settled(lambda: sorted(p.name for p in paths().layers.iterdir()) == [parent.id], "a child's layer stayed")
        assert store_is_empty()
    finally:
        parent.close()


def mounts(sb: agentenv.Sandbox) -> list[tuple[str, ...]]:
    """Where each mount of the sandbox is, its type, flags and options; the root's layer folders left out."""
    rows = []
    for line in sb.exec("cat /proc/self/mountinfo").stdout.splitlines():
        left, _, right = line.partition(" - ")
        f, r = left.split(), right.split()
        rows.append((f[4], f[5], r[0], "" if f[4] == "/" else r[2]))
    return sorted(rows)


def waiting() -> set[str]:
    """The sandboxes waiting in the warm pool, once it is full."""
    assert warm.wait_full(120)
    return {sb.id for sb in agentenv.Sandbox.list() if sb.labels.get("agentenv.kind") == warm.KIND}


@pytest.fixture
def pool():
    """A warm pool of 2 made like ``parent``, filled before it (ask for ``pool`` first): the parent is taken from
    it, so it is of the pool's fork family (one uid range, agentenv.host.userns), whose sandboxes alone can be its
    children. Returns what waits in it once it has refilled."""
    warm.configure("agentenv/base", 2, memory="256m", disk="1g")  # made like the parent
    try:
        assert warm.wait_full(120)
        yield waiting
    finally:
        warm.drain()


def test_a_files_fork_takes_pooled_sandboxes_whose_root_it_swaps(pool, parent):
    pool = pool()
    kids = parent.fork(2, memory=False)
    try:
        assert {k.id for k in kids} == pool
        assert all(k.labels == parent.labels and k.state == "running" for k in kids)
        check_children(parent, kids)
        assert kids[1].exec("pwd").stdout == "/testbed\n"  # the agent runs from the new root, in the workdir
        for k in kids:  # a layer each, cloned; the pooled sandbox's own is gone
            assert volume.is_subvolume(k.lifecycle.container.layer) and k.lifecycle.container.layer.name.startswith(k.id + ".")
            assert [p.name for p in paths().layers.iterdir() if p.name.startswith(k.id)] == [k.lifecycle.container.layer.name]
        warm.drain()
        with parent.fork(1, memory=False)[0] as booted:  # no pool now: a child that runc started
            assert mounts(kids[0]) == mounts(booted)  # /proc's masks, /dev, /sys read-only, the keeper's file
        # nothing of the pooled sandbox's first root stays in use: CRIU dumps and restores the child
        kids[0].spawn("sleep 1000")
        snap = kids[0].snapshot(memory=True)
        try:
            with agentenv.Sandbox.restore(snap) as r:
                assert r.forked_from is None and r.parent_snapshot == snap.id  # a restore, not a fork
                assert [p.command for p in r.processes()] == ["sleep 1000"]
                assert r.exec(STATE).stdout == kids[0].exec(STATE).stdout
        finally:
            snap.delete()
        grandkids = kids[1].fork(1, memory=False)  # a pooled child forks like any other
        assert grandkids[0].exec("cat /testbed/mine").stdout == "1" and grandkids[0].forked_from == kids[1].id
        grandkids[0].close()
    finally:
        for k in kids:
            k.close()
    assert not [p for p in paths().layers.iterdir() if p.name.split(".")[0] in pool]


def test_a_parent_that_plants_a_symlink_at_a_mount_point_gets_children_booted_afresh(pool, parent, caplog):
    pool = pool()
    # the parent moves the keeper's folder away and puts a link where the keeper's file is mounted
    r = parent.exec("mv /.agentenv /.agentenv-x && mkdir /.agentenv && ln -s /etc/hostname /.agentenv/keeper.py")
    assert r.exit_code == 0, r.stderr
    host_hostname = Path("/etc/hostname").read_text()
    kids = parent.fork(1, memory=False)
    try:
        assert kids[0].id in pool  # taken from the pool, then booted by runc over its cloned layer
        assert "starting it afresh" in caplog.text
        assert kids[0].exec("cat /testbed/mode").stdout == "secret\n"
        assert kids[0].processes() == []
    finally:
        kids[0].close()
    assert Path("/etc/hostname").read_text() == host_hostname


def test_a_sandbox_with_a_1_gb_layer_forks_without_copying_it():
    with agentenv.Sandbox.create(memory="256m", disk="3g") as sb:
        r = sb.exec("dd if=/dev/zero of=/testbed/big bs=4M count=256 status=none && echo end >> /testbed/big && "
                    "sha256sum /testbed/big | cut -c1-16", timeout=300)
        assert r.exit_code == 0, r.stderr
        assert sb.exec("du -sm /testbed/big | cut -f1").stdout.strip() == "1025"  # real blocks, not a sparse file
        kids = sb.fork(2, memory=False) + sb.fork(1, memory=True)
        try:
            for k in kids:  # the whole file, from a clone (a copy would have doubled what the volume holds)
                assert volume.is_subvolume(k.lifecycle.container.layer)
                assert k.exec("sha256sum /testbed/big | cut -c1-16", timeout=120).stdout == r.stdout
            kids[0].exec("truncate -s 1M /testbed/big")
            assert kids[1].exec("stat -c %s /testbed/big").stdout == f"{(1 << 30) + 4}\n"
        finally:
            for k in kids:
                k.close()
