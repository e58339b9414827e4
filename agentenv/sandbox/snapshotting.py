"""How a sandbox's state is saved: its files (a clone of its layer) and, for a memory snapshot, every process.

``Sandbox.snapshot``, ``pause`` and the snapshot path of ``fork`` all come here. The sandbox is held still by
its cgroup freezer while its files are cloned, so files and processes are of one instant. Before a memory
snapshot the keeper first closes every connection of the host (``quiesce``, with the sandbox's gate shut so no
new one opens): CRIU cannot dump a process holding the other end of a socket whose peer it does not own. A
sandbox restored lazily (``agentenv.snapshot.lazy_pages``) is dumped only once all of its memory is in. The snapshot is
written in a hidden folder of the store and renamed into place (``store.writing``): a crash leaves nothing
half-made listed.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from agentenv.config import crash_point, paths
from agentenv.errors import CheckpointError, ConnectionLost
from agentenv.host import userns, volume
from agentenv.phases import note, phase
from agentenv.sandbox import usage
from agentenv.snapshot import lazy_pages, page_channel, postcopy, shared, store
from agentenv.snapshot.criu import dump_stats
from agentenv.snapshot.store import Snapshot

if TYPE_CHECKING:
    from agentenv.sandbox.parts import Parts

QUIESCE_TIMEOUT = 15.0  # seconds the keeper has to close the host's connections before a memory snapshot
# CRIU's account of a dump (stats-dump, microseconds), recorded as phases: the processes frozen (CRIU's part),
# their pages drained into pipes and written out (memdump), and the writing alone (memwrite)
CRIU_PHASES = {"frozen_time": "criu: frozen", "memdump_time": "criu: memdump", "memwrite_time": "criu: memwrite"}
DUMP_ATTEMPTS = 3  # a dump that met a host connection opened meanwhile is quiesced and tried again


def take(sb: Parts, memory: bool, leave_running: bool, labels: dict[str, str] | None, op: str,
         snap_id: str | None = None, owner: builtins.list[int] | None = None,
         page_server: page_channel.Listener | None = None,
         served: builtins.list[postcopy.PageServer] | None = None) -> Snapshot:
    """Write a snapshot of ``sb`` (locked by the caller) into the store; ``op`` names the crash points (tests).
    With ``page_server``, a lazy dump whose pages are served there (post-copy: ``agentenv.sandbox.migration``),
    its running CRIU appended to ``served``; the sandbox is left frozen by it."""
    snap_id = snap_id or store.new_id("snap")
    if memory and (daemon := sb.record.lazy_pages):  # restored lazily: its memory must be all in before a dump
        lazy_pages.await_memory(daemon, sb.id)
        sb.amend(lazy_pages=None)
        sb.save_record()
    container = sb.lifecycle.container
    with store.writing(snap_id) as folder:
        uids = sb.container_spec().uids
        if uids is not None:  # the snapshot holds its family's uid range: its files are those uids
            userns.hold(uids, folder)
        failed: CheckpointError | None = None
        for attempt in range(DUMP_ATTEMPTS):
            with frozen(sb, quiesce=memory):
                with phase("fs"):
                    store.save_files(container.layer, container.upper, store.files_of(folder))
                crash_point(f"{op}:frozen")
                if not memory:
                    break
                try:
                    crash_point(f"{op}:dumping")
                    with phase("criu dump"):
                        # a lazy dump's log and work files outside the snapshot: it is exported while CRIU runs
                        work = folder / "criu" if page_server is None else container.bundle / "criu-migrate"
                        server = container.checkpoint(folder / "criu", work, leave_running=leave_running,
                                                      criu=os.environ.get("AGENTENV_CRIU"), page_server=page_server)
                    if server is not None and served is not None:
                        served.append(server)
                    break
                except CheckpointError as e:
                    # a host connection that another process opened in the meantime: quiesce again
                    if "unix" not in str(e).lower() or attempt == DUMP_ATTEMPTS - 1:
                        failed = e
                        break
            shutil.rmtree(folder / "criu", ignore_errors=True)  # a failed try's images, before the next
        if failed is not None:
            raise _terminals_named(sb, failed)  # once thawed, the gate open: the keeper can answer
        crash_point(f"{op}:dumped")
        snap = meta(sb, snap_id, folder, memory, labels, owner)
        store.write_meta(folder, snap)
    for key, name in CRIU_PHASES.items():  # where the dump's own time went, for whoever records phases
        if key in snap.criu_stats:
            note(name, snap.criu_stats[key] / 1e6)
    return snap


def _terminals_named(sb: Parts, e: CheckpointError) -> CheckpointError:
    """A dump that CRIU refused over a terminal, with the sandbox's open terminals (``start_terminal``) named."""
    if "tty" not in str(e):
        return e
    try:
        reply, _ = sb.lifecycle.channel.call({"op": "jobs"})
        open_ttys = [j for j in reply.get("jobs", []) if isinstance(j, dict) and j.get("pty") is True]
    except (OSError, ConnectionLost):
        return e
    if not open_ttys:
        return e
    criu_said = str(e).split(" \u2014 ")[0]  # without its fix: this error gives its own
    named = ", ".join(f"pid {j.get('pid')} ({str(j.get('command'))[:60]!r})" for j in open_ttys)
    return CheckpointError(
        f"a memory snapshot cannot be taken while this terminal is open: {named}; a process on it uses the "
        f"terminal in a way CRIU cannot save (as /dev/tty held open: dash -i, vim, less). Nothing was saved and "
        f"the sandbox runs on. ({criu_said})",
        fix="exit or kill the terminal's program (or the process holding /dev/tty), then retry; a terminal "
            "running bash is carried through pause, snapshots and fork")


def meta(sb: Parts, snap_id: str, folder: Path, memory: bool, labels: dict[str, str] | None,
         owner: builtins.list[int] | None = None) -> Snapshot:
    """The record of a snapshot of ``sb`` written into ``folder`` (also how recovery completes a cut-off pause)."""
    layer = any(volume.is_subvolume(f) for f in (store.files_of(folder), paths().snapshot_files / snap_id))
    return Snapshot(id=snap_id, parent_id=sb.parent_snapshot, created_at=time.time(),
                    size_bytes=store.size_of(folder), has_memory=memory, sandbox_id=sb.id,
                    spec=sb.record.spec, labels={"image": sb.image, **(labels or {})},
                    criu_stats=dump_stats(folder / "criu") if memory else {}, owner=owner, layer=layer)


@contextlib.contextmanager
def frozen(sb: Parts, quiesce: bool) -> Iterator[None]:
    """Hold every process of ``sb`` still (cgroup freezer); with ``quiesce``, first close the host's connections."""
    gate, container = sb.lifecycle.channel.gate, sb.lifecycle.container
    if quiesce:
        gate.shut()
    try:
        if quiesce:
            with phase("quiesce"):
                _quiesce(sb)
        try:
            with phase("freeze"):
                container.freeze(True)
            yield
        finally:
            if container.freezer() is not None:
                container.freeze(False)
    finally:
        if quiesce:
            gate.open()


def _quiesce(sb: Parts) -> None:
    """Have the keeper close every host connection, within QUIESCE_TIMEOUT (a stopped keeper never will)."""
    try:
        sb.lifecycle.channel.last_word({"op": "quiesce"}, QUIESCE_TIMEOUT)  # the gate is shut: the one connection
    except TimeoutError:
        raise ConnectionLost(f"the sandbox keeper did not get ready for a snapshot within {QUIESCE_TIMEOUT:g} s "
                             f"({usage.stall_hint(sb)}); nothing was saved and the sandbox was left running",
                             fix="the keeper may be stopped (traced) or starved of CPU; retry, or close the "
                                 "sandbox") from None


def pause(sb: Parts, memory: bool) -> Snapshot:
    """``Sandbox.pause`` under its lock: the record names the snapshot being written (``pausing``) until the
    sandbox is down, so that ``recover`` can finish or roll back a pause its process did not live to end."""
    sb.require_running()
    snap_id = store.new_id("snap")
    sb.amend(pausing=snap_id, owner=store.owner())
    sb.save_record()
    try:
        snap = take(sb, memory, leave_running=False, labels={"agentenv.kind": "pause"}, op="pause", snap_id=snap_id)
    except BaseException:
        sb.amend(pausing=None, owner=None)
        sb.save_record()
        raise
    crash_point("pause:published")
    sb.lifecycle.paused(snap_id)
    shared.publish(snap)  # with a shared store, another server can resume it, even once this one is gone
    return snap
