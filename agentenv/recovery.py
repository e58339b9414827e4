"""Recovery after ``kill -9``: which host processes may still work on sandboxes, and ``recover_all``, which mends
every sandbox on this host and collects what dead processes left.

A process that died mid-operation leaves sandboxes frozen, half-made fork children, interrupted pauses and
folders without records. ``Sandbox.recover`` mends one sandbox (it waits for the dead owner's helpers, found
among ``host_processes()``, to go first); ``recover_all`` runs it on every sandbox in parallel, so that one
stuck sandbox holds up none of the others, then removes layers, folders and store entries that no record owns.
``agentenv serve`` and ``agentenv gc`` call it at start.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from agentenv import store, volume
from agentenv.config import paths

if TYPE_CHECKING:
    from agentenv.sandbox import Sandbox

log = logging.getLogger("agentenv")


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
    from agentenv.sandbox import Sandbox

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
    a record (a kill between the two first steps of making one), and the store's leftovers (``store.gc``)."""
    from agentenv.sandbox import Sandbox

    p = paths()
    with contextlib.suppress(FileNotFoundError):
        for layer in p.layers.iterdir():
            if not (p.sandboxes / layer.name).exists():
                log.warning("removing the layer %s: its sandbox is gone", layer.name)
                volume.drop_layer(layer)
    now = time.time()
    for bundle in p.sandboxes.iterdir():
        with contextlib.suppress(OSError):
            if not (bundle / "sandbox.json").exists() and now - bundle.stat().st_mtime > LEFTOVER_AGE:
                log.warning("removing the sandbox folder %s: it has no record", bundle.name)
                Sandbox({"id": bundle.name, "state": "closed", "layer": bundle.name})._destroy()
    for name in store.gc():
        log.warning("removed %s from the snapshot store (left by a process that died)", name)
