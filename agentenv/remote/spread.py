"""A fork spread over a ``Pool``'s servers (what ``fork`` of a pool's sandbox does): the children go on the
source's server up to its free room, the rest on the roomiest other servers, so a fork's count is not capped by one
server's quota.

Where the source's server has room for all, it is a plain fork there. Otherwise one snapshot of the source is
taken (its processes too with ``memory``), packed once on its server, pulled by every other server that gets
children (in parallel, ``POST /v1/snapshots/import``, chunks checked by sha256, no part file kept) and
restored there; the
source's own share is restored from it on its server once the pulls are done: every child continues from the
snapshot's instant. A
failure closes every child made and raises the first error; the snapshot and its imported copies are deleted
either way. The phases are marked for ``agentenv.phases.recording`` (``spread: dump / export / import /
restore``), which ``bench.xfork`` prints.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from agentenv.api import Limits
from agentenv.errors import AgentEnvError, QuotaExceeded, SandboxStateError
from agentenv.phases import phase
from agentenv.remote.client import Client, RemoteSandbox

LABEL = "agentenv.spread_fork"  # label of the snapshot a spread fork takes: the id of the sandbox it forks
PACK_TIMEOUT = 600.0  # seconds the source's server may take to pack the snapshot for the others


def room(info: dict[str, Any], limits: Limits) -> int:
    """How many more sandboxes with ``limits`` fit on a server whose ``server_info()`` is ``info``."""
    cap = info["capacity"]
    fits = [int(cap["free_sandboxes"]), int(cap["free_memory"]) // max(int(limits.memory), 1)]
    if limits.disk:
        fits.append(int(cap["free_disk"]) // int(limits.disk))
    return max(0, min(fits))


def plan(servers: Sequence[tuple[Client, dict[str, Any]]], sandbox: RemoteSandbox,
         count: int) -> list[tuple[Client, int]]:
    """How many of ``count`` children each server gets (``servers``: those that answer, with their
    ``server_info()``): the source's server first, up to its room, then the others with the most room;
    QuotaExceeded (nothing made) when they lack room for ``count``."""
    source, limits = sandbox.client, sandbox.limits
    rooms = {c: room(info, limits) for c, info in servers}
    order = [source] + sorted((c for c in rooms if c is not source), key=lambda c: rooms[c], reverse=True)
    where, left = [], count
    for c in order:
        if (take := min(left, rooms.get(c, 0))) > 0:
            where.append((c, take))
            left -= take
    if left:
        raise QuotaExceeded(f"the pool's servers that answer have room for {count - left} of the {count} children of "
                            f"{sandbox.id} ({limits.memory} bytes of memory each)", retry_after=5.0)
    return where


def fork(servers: Sequence[tuple[Client, dict[str, Any]]], sandbox: RemoteSandbox, count: int,
         memory: bool, ttl: float | None) -> list[RemoteSandbox]:
    """``count`` children of ``sandbox`` over ``servers`` (see ``plan`` and the module doc), the source's server's
    first, each with a deadline ``ttl`` from now."""
    where = plan(servers, sandbox, count)
    source = sandbox.client
    if where == [(source, count)]:
        return sandbox.fork_here(count, memory=memory, ttl=ttl)
    if sandbox.info().state != "running":
        raise SandboxStateError(f"sandbox {sandbox.id} is {sandbox.info().state}: its server has room for "
                                f"{dict(where).get(source, 0)} of the {count} children, and only a running sandbox's "
                                "fork spreads over servers", fix="resume it first, or fork fewer")
    labels = sandbox.labels
    with phase("spread: dump"):
        snap = sandbox.snapshot(memory, labels={LABEL: sandbox.id})
    made: list[RemoteSandbox | None] = [None] * count
    copies: list[Client] = []  # servers that hold an imported copy of the snapshot
    lock = threading.Lock()

    def pull(target: Client) -> None:
        with lock:
            copies.append(target)  # listed first: a copy half-made by a failed import is deleted too
        with phase("spread: import"):
            import_snapshot(target, source, snap.id, once=True)

    def restore(i: int, target: Client, after: list[Future[None]]) -> None:
        for f in after:
            f.result()
        with phase("spread: restore"):
            made[i] = target.Sandbox.restore(snap.id, labels=labels, ttl=ttl)

    futures: list[Future[None]] = []
    try:
        with phase("spread: export"):  # packed once, before any restore (CRIU's restore touches the folder) or pull
            source.request("GET", f"/v1/snapshots/{snap.id}/export", idempotent=True,
                           timeout=max(source.timeout, PACK_TIMEOUT))
        with ThreadPoolExecutor(max_workers=count + len(where), thread_name_prefix="agentenv-spread") as ex:
            slots = iter(range(count))
            pulls = {t: ex.submit(pull, t) for t, _ in where if t is not source}
            futures += pulls.values()
            for target, share in where:
                # the source's share once every pull is done: its restores would only slow the pulls, whose
                # restores come last (on one host they share its CPUs; apart, the source serves the chunks)
                after = list(pulls.values()) if target is source else [pulls[target]]
                futures += [ex.submit(restore, next(slots), target, after) for _ in range(share)]
        if errors := [err for f in futures if (err := f.exception()) is not None]:
            raise errors[0]
    except BaseException:
        for kid in made:
            if kid is not None:
                with contextlib.suppress(AgentEnvError):
                    kid.close()
        raise
    finally:
        _delete(source, snap.id)
        for target in copies:
            _delete(target, snap.id)
    return [kid for kid in made if kid is not None]


def import_snapshot(target: Client, owner: Client, snapshot_id: str, *, chunk_size: int | None = None,
                    retries: int = 3, once: bool = False) -> dict[str, Any]:
    """Have ``target`` pull ``snapshot_id`` from ``owner``; the reply's counts (chunks, fetched, resumed_at).
    ``once``: a one-shot pull, one of several (``owner`` keeps the archive it packed for the others, and
    ``target`` keeps no part file to resume from)."""
    body: dict[str, Any] = {"id": snapshot_id, "source": owner.url, "token": owner.token, "retries": retries}
    if chunk_size is not None:
        body["chunk_size"] = chunk_size
    if once:  # sent only when asked for: a server from before the options refuses the fields
        body.update(keep_export=True, resumable=False)
    return dict(target.request("POST", "/v1/snapshots/import", body, timeout=max(target.timeout, 600.0)))


def _delete(client: Client, snapshot_id: str) -> None:
    """Delete a snapshot the fork made (on the source, its packed archive goes with it); a copy a failed import
    never finished is not there, and a server that stopped answering keeps it (its store's to collect)."""
    with contextlib.suppress(AgentEnvError):
        client.request("DELETE", f"/v1/snapshots/{snapshot_id}", idempotent=True)
