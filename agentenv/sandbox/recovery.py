"""Recovery after ``kill -9``: mending one sandbox, and which host processes may still work on sandboxes
(``agentenv.sandbox.sweep.recover_all`` mends every sandbox on this host and collects what dead processes left).

A process that died mid-operation leaves sandboxes frozen, half-made fork children, interrupted pauses and
folders without records. ``recover`` (``Sandbox.recover``) mends one sandbox: it waits for the dead owner's
helpers, found among ``host_processes()``, to go first, then removes a half-made sandbox, finishes or rolls back
a pause cut short, and thaws one left frozen (``thaw_abandoned``, the cheap part).
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from agentenv.config import paths
from agentenv.errors import AgentEnvError, SandboxNotFound
from agentenv.host import cgroups
from agentenv.sandbox import snapshotting
from agentenv.snapshot import store

if TYPE_CHECKING:
    from agentenv.sandbox.parts import Parts

log = logging.getLogger("agentenv")
RECOVER_PING_TIMEOUT = 2.0  # seconds a recovered sandbox's keeper has to answer
ORPHAN_WAIT = 310.0  # seconds recovery waits for a dead process's runc, CRIU or cp to end (runc's own limit: 300)
LOCK_WAIT = 60.0  # seconds recovery waits for a live process to let go of a sandbox


@dataclass(frozen=True)
class HostProcess:
    """A process of the host, as recovery sees it: its pid and command line."""

    pid: int
    cmdline: bytes


def host_processes() -> builtins.list[HostProcess]:
    """The host's processes that may be working on sandboxes for a process that died: every process but this
    one's children and those inside sandboxes (whose command lines a sandbox controls)."""
    me = os.getpid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
            if int(stat[stat.rindex(b")") + 2:].split()[1]) == me:
                continue
            with open(f"/proc/{name}/cgroup", "rb") as f:
                if b"/agentenv/" in f.read():
                    continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, ValueError):
            continue
        if cmdline:
            found.append(HostProcess(int(name), cmdline))
    return found


def process_running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return data[data.rindex(b")") + 2:].split()[0] != b"Z"


def recover(sb: Parts, procs: builtins.list[HostProcess] | None = None,
            ping_timeout: float = RECOVER_PING_TIMEOUT) -> str:
    """``Sandbox.recover`` (what it returns and mends: its docstring)."""
    sb.reload()
    if sb.recorded_state == "closed":
        return "closed"
    if store.owner_alive(sb.record.owner):
        return "busy"
    _wait_for_orphans(sb, host_processes() if procs is None else procs)
    try:
        with sb.locked(allow_closed=True, wait=LOCK_WAIT):
            if sb.recorded_state == "closed":
                return "closed"
            if store.owner_alive(sb.record.owner):
                return "busy"
            where = _recover_locked(sb)
    except TimeoutError:
        return "busy"
    except SandboxNotFound:
        return "closed"
    if where != "running":
        return where
    try:
        if sb.state != "running":
            return "lost"
        sb.ping(timeout=ping_timeout)
    except AgentEnvError:
        return "lost"
    return "running"


def _recover_locked(sb: Parts) -> str:
    state = sb.recorded_state
    if state == "creating":  # its maker died: a half-made sandbox (a fork's child, say)
        log.warning("removing sandbox %s: the process making it died", sb.id)
        sb.lifecycle.destroy()
        return "discarded"
    if pausing := sb.record.pausing:
        return _recover_pause(sb, pausing)
    if state == "paused":
        container = sb.lifecycle.container
        if container.state() is not None or cgroups.existing(container.cgroup):
            container.destroy()  # a resume cut short left a container (or processes): the snapshot stays
        if sb.lifecycle.has_own_layer() and os.path.lexists(container.layer):
            sb.lifecycle.drop_layer()  # what a resume cut short had copied: the snapshot holds the sandbox's files
        paused = sb.paused_snapshot
        return "paused" if paused and (paths().snapshots / paused / "meta.json").exists() else "lost"
    return "running"  # locked() thawed it if a dead snapshotter left it frozen


def _recover_pause(sb: Parts, snap_id: str) -> str:
    """Finish a pause cut short, or roll it back; 'paused' or 'running' ('lost' only if its processes died
    without CRIU having dumped them)."""
    tmps = sorted(paths().snapshots.glob(f".tmp-{snap_id}-*"))
    published = (paths().snapshots / snap_id / "meta.json").exists()
    if not published and _container_alive(sb):  # CRIU did not finish: the processes still run
        for t in tmps:
            store.discard(t)
        store.remove([paths().snapshot_files / snap_id])
        sb.amend(pausing=None, owner=None)
        sb.save_record()
        log.warning("rolled back the interrupted pause of sandbox %s: it runs on", sb.id)
        return "running"
    if not published:
        files = paths().snapshot_files / snap_id  # where they are if the kill came between two renames
        dumped = [t for t in tmps if (t / "criu" / "stats-dump").exists()
                  and (store.files_of(t).is_dir() or files.is_dir())]
        if not dumped:
            for t in tmps:
                store.discard(t)
            store.remove([files])
            sb.amend(pausing=None, owner=None)
            sb.save_record()
            return "lost"
        # CRIU dumped every process (and ended them): publish what it wrote, as the pause would have
        snap = snapshotting.meta(sb, snap_id, dumped[0], True, {"agentenv.kind": "pause"})
        store.write_meta(dumped[0], snap)
        store.publish(dumped[0], snap_id)
        for t in tmps[1:]:
            store.discard(t)
    sb.lifecycle.paused(snap_id)
    log.warning("finished the interrupted pause of sandbox %s (snapshot %s)", sb.id, snap_id)
    return "paused"


def _container_alive(sb: Parts) -> bool:
    st = sb.lifecycle.container.state()
    return st is not None and st.get("status") in ("running", "paused", "created")


def thaw_abandoned(sb: Parts, procs: builtins.list[HostProcess] | None = None) -> bool:
    """``Sandbox.thaw_abandoned``: thaw ``sb`` if a dead process left it frozen; True if it did."""
    try:
        if sb.recorded_state != "running" or not sb.lifecycle.container.frozen():
            return False
        if _orphans(sb, host_processes() if procs is None else procs):
            return False
        with sb.locked(wait=0):
            pass  # taking the lock thaws a sandbox that no live holder froze
    except (OSError, TimeoutError, AgentEnvError):
        return False
    log.warning("thawed sandbox %s: a process died while it was frozen for a snapshot", sb.id)
    return True


def _orphans(sb: Parts, procs: builtins.list[HostProcess]) -> builtins.list[int]:
    """The host processes still working on this sandbox for someone else (runc, CRIU, cp)."""
    container = sb.lifecycle.container
    needles = (container.cid.encode(), str(container.layer).encode() + b"/")
    return [p.pid for p in procs if any(n in p.cmdline for n in needles)]


def lazy_dump(cmdline: bytes) -> bool:
    """True for a post-copy migration's CRIU (``criu dump --lazy-pages``, ``agentenv.snapshot.postcopy``): it would
    wait for a receiver its dead owner can no longer finish with, so recovery ends it instead of waiting."""
    args = cmdline.split(b"\0")
    return b"dump" in args and b"--lazy-pages" in args


def _wait_for_orphans(sb: Parts, procs: builtins.list[HostProcess]) -> None:
    dumps = [p for p in procs if p.pid in _orphans(sb, [p]) and lazy_dump(p.cmdline)]
    for p in dumps:  # killed, CRIU lets the frozen source go (the lock then thaws it: it runs on where it was)
        log.warning("sandbox %s: ending the post-copy dump %d its dead server left", sb.id, p.pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGKILL)
    # a post-copy move whose server died: its page server went with it (CRIU, its socket closed, ends by itself
    # and leaves the sandbox frozen), and so did the pages its snapshot names
    if dumps or (sb.recorded_state == "running" and sb.lifecycle.container.frozen()):
        for snap in store.orphaned_forks():
            if snap.labels.get("agentenv.kind") == store.MIGRATE_KIND and snap.sandbox_id == sb.id:
                snap.delete()
    pids = _orphans(sb, procs)
    deadline = time.monotonic() + ORPHAN_WAIT
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if process_running(p)]
        if pids:
            time.sleep(0.05)
    if pids:
        log.warning("sandbox %s: processes %s still work on it after %g s; recovering anyway", sb.id, pids,
                    ORPHAN_WAIT)
