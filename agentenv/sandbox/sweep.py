"""The host-wide pass after ``kill -9``: ``recover_all`` mends every sandbox on this host, in parallel so that
one stuck sandbox holds up none of the others (``agentenv.sandbox.recovery`` mends each), then removes layers,
folders, network links and store entries that no record owns. ``agentenv serve`` and ``agentenv gc`` call it
at start. Above ``core``: it lists and makes ``Sandbox`` objects.

``release_home`` (``agentenv gc``) gives back what an idle home still holds in the host's mount table: its
btrfs volume's loop mount and the user namespaces kept for its uid ranges; the next sandbox mounts them again.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from pathlib import Path

from agentenv.config import paths
from agentenv.host import network, volume
from agentenv.host.hostcalls import umount
from agentenv.sandbox.core import Sandbox
from agentenv.sandbox.record import SandboxRecord
from agentenv.sandbox.recovery import host_processes
from agentenv.snapshot import store

log = logging.getLogger("agentenv")


def recover_all(wait: float | None = None, result: dict[str, builtins.list[str]] | None = None,
                lock: threading.Lock | None = None,
                on_result: Callable[[Sandbox, str], None] | None = None) -> dict[str, builtins.list[str]]:
    """``recover`` every sandbox on this host (in parallel, so that one stuck sandbox holds up none of the
    others), then collect the store's leftovers (``store.gc``). Returns where each sandbox ended, by
    bucket ('running', 'paused', 'lost', 'discarded', 'busy'), in ``result`` if given (updated under
    ``lock``). Waits ``wait`` seconds at most (None: until done): the sandboxes not done by then are under
    'recovering', and move to their bucket as they finish in the background (``on_result`` is called
    with each sandbox and its bucket as it finishes)."""
    result = {} if result is None else result
    lock = lock or threading.Lock()
    procs = host_processes()
    sandboxes = Sandbox.list()
    for sb in sandboxes:  # first the cheap part, so that no call waits on a frozen sandbox
        sb.thaw_abandoned(procs)
    with lock:
        for bucket in ("running", "paused", "lost"):
            result.setdefault(bucket, [])
        result.setdefault("recovering", []).extend(sb.id for sb in sandboxes)

    left = [len(sandboxes)]

    def one(sb: Sandbox) -> None:
        try:
            where = sb.recover(procs)
        except Exception as e:  # noqa: BLE001 - one sandbox's failure is reported, not raised
            log.warning("could not recover sandbox %s: %s", sb.id, e)
            where = "lost"
        with lock:
            result["recovering"].remove(sb.id)
            result.setdefault(where, []).append(sb.id)
            left[0] -= 1
            last = left[0] == 0
        if on_result is not None:
            on_result(sb, where)
        if last:  # what the recovered sandboxes' dead processes were still writing is free to go now
            _collect()

    _collect()
    if sandboxes:
        pool = ThreadPoolExecutor(max_workers=min(16, len(sandboxes)), thread_name_prefix="agentenv-recover")
        futures_wait([pool.submit(one, sb) for sb in sandboxes], timeout=wait)
        pool.shutdown(wait=False)
    return result


LEFTOVER_AGE = 60.0  # seconds after which a sandbox folder without a record is a leftover, not one being made


def _collect() -> None:
    """Remove what dead processes left outside any record: layers without a sandbox, sandbox folders without
    a record (a kill between the two first steps of making one), network links whose sandbox folder is gone,
    and the store's leftovers (``store.gc``)."""
    p = paths()
    with contextlib.suppress(FileNotFoundError):
        for layer in p.layers.iterdir():
            if not (p.sandboxes / layer.name.partition(".")[0]).exists():  # <sandbox id>[.<n>]: see forking
                log.warning("removing the layer %s: its sandbox is gone", layer.name)
                volume.drop_layer(layer)
    now = time.time()
    for bundle in p.sandboxes.iterdir():
        with contextlib.suppress(OSError):
            if not (bundle / "sandbox.json").exists() and now - bundle.stat().st_mtime > LEFTOVER_AGE:
                log.warning("removing the sandbox folder %s: it has no record", bundle.name)
                Sandbox(SandboxRecord.leftover(bundle.name)).lifecycle.destroy()
    for veth in network.sweep(f"{p.sandboxes}/"):
        log.warning("removed the network link %s: its sandbox is gone", veth)
    for name in store.gc():
        log.warning("removed %s from the snapshot store (left by a process that died)", name)


def home_mounts() -> builtins.list[str]:
    """What this home holds in the host's mount table: its volume, and the user namespaces kept for its low uid
    ranges (``agentenv.host.userns``)."""
    p = paths()
    targets = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    return [t for t in targets if t == str(p.volume) or t.startswith(f"{p.uids}/")]


def idle() -> bool:
    """No sandbox and no snapshot of this home is left."""
    p = paths()
    return not any(not d.name.startswith(".") for d in p.sandboxes.iterdir()) and not store.Snapshot.list()


def release_home(dry_run: bool = False) -> builtins.list[str]:
    """Unmount ``home_mounts()`` if the home is idle (checked again under the volume's lock before the volume goes):
    what was unmounted, or with ``dry_run`` what would be; nothing while a sandbox or a snapshot is left. A
    process that keeps using the home mounts them again as it needs them (``volume.ensure``, ``userns_fd``)."""
    if not idle():
        return []
    p = paths()
    found = home_mounts()
    if dry_run:
        return found
    done = []
    for m in found:
        if m != str(p.volume):
            umount(Path(m), lazy=True)  # a start that opened it already keeps its namespace through its descriptor
            done.append(m)
    if str(p.volume) in found and volume.unmount(idle):
        done.append(str(p.volume))
    return done
