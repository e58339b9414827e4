"""``agentenv.Pool([...urls])``: several environment servers behind one sandbox API.

New sandboxes go to the server with the most free capacity (free sandbox slots, then free memory);
a fork's children go on their source's server up to its free room, the rest on other servers, which restore
them from one snapshot of the source that they pull (``agentenv.remote.spread``); a
restore goes to the server holding the snapshot. A server that stops answering is marked down: new
sandboxes skip it, its sandboxes are reported lost (``Pool.lost()``, and ``state == 'lost'``), and
the other servers keep working. A down server is probed again at most every ``reprobe`` seconds.
``Pool.from_ray()`` finds the servers of a Ray cluster's fleet (``agentenv.remote.fleet``).

A restore runs on the server holding the snapshot while it has room, else (or with ``server=``) on another,
which first pulls the snapshot from its owner (``POST /v1/snapshots/import``: chunks checked by sha256,
resumable); ``move`` takes a sandbox to another server that way (pause, pull, restore there, close here), or
running (``post_copy=True``: its memory follows it, served by CRIU's page server; docs/transfer.md).
Servers started with the same ``--shared-store`` see each other's snapshots there: a snapshot whose server is
gone is restored on one of them (``agentenv.snapshot.shared``).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from agentenv.api import DEFAULT_IMAGE, DEFAULT_TTL, SnapshotLike
from agentenv.errors import (
    AgentEnvError,
    ConnectionLost,
    QuotaExceeded,
    SandboxNotFound,
    SnapshotNotFound,
    TransferError,
    Unauthorized,
)
from agentenv.remote import spread
from agentenv.remote.client import DEFAULT_TIMEOUT, Client, RemoteSandbox, RemoteSnapshot
from agentenv.remote.spread import import_snapshot

T = TypeVar("T")
MIGRATE_WAIT = 300.0  # seconds a post-copy move waits for every page to be in on the receiver


class Pool:
    """Servers at ``urls`` (one token for all, or one per url) used as one; ``.Sandbox`` and ``.Snapshot``."""

    def __init__(self, urls: Sequence[str], token: str | Sequence[str], *, timeout: float = DEFAULT_TIMEOUT,
                 retries: int = 1, reprobe: float = 10.0) -> None:
        if not urls:
            raise ValueError("a pool needs at least one server url")
        tokens = [token] * len(urls) if isinstance(token, str) else list(token)
        if len(tokens) != len(urls):
            raise ValueError(f"{len(urls)} urls but {len(tokens)} tokens")
        self.clients = [Client(u, t, timeout=timeout, retries=retries) for u, t in zip(urls, tokens, strict=True)]
        self.reprobe = reprobe
        self._known: dict[str, RemoteSandbox] = {}
        self._lock = threading.Lock()
        self._probed: dict[str, float] = {}
        for c in self.clients:
            c.on_sandbox = self._seen
            c.spread = self._spread
        self.Sandbox = PoolSandboxAPI(self)
        self.Snapshot = PoolSnapshotAPI(self)

    @classmethod
    def from_ray(cls, token: str | None = None, *, address: str | None = None, **kwargs: Any) -> Pool:
        """The env servers ``agentenv cluster up`` started on the Ray cluster (the one this process is a driver
        of, else ``address``, else this machine's); ``token`` (else $AGENTENV_TOKEN) must be theirs."""
        from agentenv.remote import fleet

        token = token or os.environ.get("AGENTENV_TOKEN")
        if not token:
            raise Unauthorized("a pool of the fleet's servers needs their token", fix="pass token= or set $AGENTENV_TOKEN")
        infos = fleet.servers(address=address)
        if not infos:
            raise fleet.FleetError("no env server of the fleet answers on this Ray cluster",
                                   fix="run `agentenv cluster up` first")
        fleet.check_token(infos, token)
        return cls([i["url"] for i in infos], token, **kwargs)

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for c in self.clients:
            c.close()

    def _seen(self, sb: RemoteSandbox) -> None:
        with self._lock:
            self._known[sb.id] = sb

    def _spread(self, sandbox: RemoteSandbox, count: int, memory: bool, ttl: float | None) -> list[RemoteSandbox]:
        return spread.fork(self._each(lambda c: c.server_info()), sandbox, count, memory, ttl)

    def up(self) -> list[Client]:
        """The servers not marked down (a down one is probed again once ``reprobe`` seconds have passed)."""
        now = time.monotonic()
        for c in self.clients:
            if c.down and now - self._probed.get(c.url, 0.0) >= self.reprobe:
                self._probed[c.url] = now
                with contextlib.suppress(ConnectionLost):
                    c.request("GET", "/health", idempotent=True)
        return [c for c in self.clients if not c.down]

    def lost(self) -> list[str]:
        """Ids of the sandboxes this pool has seen on servers that are now down."""
        with self._lock:
            return sorted(sid for sid, sb in self._known.items() if sb.client.down and not sb._closed)

    def _each(self, fn: Callable[[Client], T]) -> list[tuple[Client, T]]:
        """``fn`` on every server that is up; one that fails to answer is marked down and skipped."""
        out = []
        for c in self.up():
            try:
                out.append((c, fn(c)))
            except ConnectionLost:
                continue
        return out

    def first(self, fetch: Callable[[Client], T], missing: type[AgentEnvError], message: str) -> T:
        """``fetch`` on each server that answers until one has it; ``missing(message)`` when none does."""
        for c in self.up():
            try:
                return fetch(c)
            except (missing, ConnectionLost):
                continue
        raise missing(message)

    def _by_free_capacity(self) -> list[Client]:
        def key(item: tuple[Client, dict[str, Any]]) -> tuple[int, int]:
            cap = item[1]["capacity"]
            return int(cap["free_sandboxes"]), int(cap["free_memory"])

        ranked = sorted(self._each(lambda c: c.server_info()), key=key, reverse=True)
        return [c for c, info in ranked if info["capacity"]["free_sandboxes"] > 0]

    def client(self, url: str) -> Client:
        """The pool's client of the server at ``url``; ValueError if the pool has none."""
        for c in self.clients:
            if c.url == url.rstrip("/"):
                return c
        raise ValueError(f"{url} is not a server of this pool; pass one of {[c.url for c in self.clients]}")

    def place(self, fn: Callable[[Client], T], order: list[Client] | None = None) -> T:
        """Run ``fn`` on the server with the most free capacity (or the first of ``order``), falling back to the
        next when one is full or down."""
        last: AgentEnvError | None = None
        for c in self._by_free_capacity() if order is None else order:
            try:
                return fn(c)
            except (QuotaExceeded, ConnectionLost) as e:
                last = e
        if last is not None:
            raise last
        raise QuotaExceeded("no server in the pool has room for a sandbox (or none answers)", retry_after=5.0)


class PoolSandboxAPI:
    """``pool.Sandbox``: create on the freest server; get, list and restore across the pool."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool

    def create(self, image: str = DEFAULT_IMAGE, **kwargs: Any) -> RemoteSandbox:
        return self._pool.place(lambda c: c.Sandbox.create(image, **kwargs))

    def restore(self, snapshot: SnapshotLike | str, *, labels: dict[str, str] | None = None,
                ttl: float | None = DEFAULT_TTL, server: str | None = None) -> RemoteSandbox:
        """A sandbox from ``snapshot`` on ``server`` (a url of the pool), else on its owner while that has room,
        else on the freest server; one that lacks the snapshot pulls it from the owner first."""
        if not isinstance(snapshot, RemoteSnapshot) or snapshot.client is None:
            snapshot = self._pool.Snapshot.get(snapshot if isinstance(snapshot, str) else snapshot.id)
        owner = snapshot.client
        assert owner is not None  # a snapshot the pool found names its server
        if server is not None:
            return self._restore_on(self._pool.client(server), owner, snapshot.id, labels, ttl)
        ranked = self._pool._by_free_capacity()
        if owner.down:  # its server is gone: one that still sees the snapshot (in a shared store) answers for it
            snapshot = self._pool.Snapshot.get(snapshot.id)
            owner = snapshot.client
            assert owner is not None
        if owner in ranked:
            ranked.remove(owner)
            ranked.insert(0, owner)
        return self._pool.place(lambda c: self._restore_on(c, owner, snapshot.id, labels, ttl), ranked)

    def _restore_on(self, target: Client, owner: Client, snapshot_id: str,
                    labels: dict[str, str] | None, ttl: float | None) -> RemoteSandbox:
        if target is not owner:
            try:
                target.Snapshot.get(snapshot_id)
            except SnapshotNotFound:
                import_snapshot(target, owner, snapshot_id)
        return target.Sandbox.restore(snapshot_id, labels=labels, ttl=ttl)

    def move(self, sandbox: RemoteSandbox, server: str, *, post_copy: bool = False,
             on_running: Callable[[RemoteSandbox], None] | None = None) -> RemoteSandbox:
        """``sandbox`` carried to ``server``: paused here, pulled and restored there (a new id, the same files,
        processes and memory), then closed here. What it had is the snapshot's: a copy, not a live migration.

        ``post_copy``: migrated running instead (``agentenv.server.routes.migration``): frozen here, it runs there
        as soon as all but its memory is in, its pages pulled from here meanwhile (``on_running(moved)`` is called
        then); closed here once they all are. On any failure it runs on here (TransferError) and what the other
        server made is closed."""
        if post_copy:
            return self._migrate(sandbox, self._pool.client(server), on_running)
        if on_running is not None:
            raise ValueError("on_running is for post_copy moves: a paused move runs nothing before it is done")
        if sandbox.state == "paused":  # its pause snapshot is not named by the API: take a fresh one
            sandbox.resume()
        snap = sandbox.pause()
        moved = self._restore_on(self._pool.client(server), sandbox.client, snap.id, dict(sandbox.labels),
                                 _left(sandbox))
        sandbox.close()
        return moved

    def _migrate(self, sandbox: RemoteSandbox, target: Client,
                 on_running: Callable[[RemoteSandbox], None] | None) -> RemoteSandbox:
        source = sandbox.client
        if target is source:
            raise ValueError(f"sandbox {sandbox.id} is on {target.url} already: move it to another server")
        started = source.request("POST", f"/v1/sandboxes/{sandbox.id}/migrate", {})
        snap_id = started["snapshot"]["id"]
        moved: RemoteSandbox | None = None
        delivered = False
        try:
            import_snapshot(target, source, snap_id)
            moved = target.sandbox_of(target.request("POST", f"/v1/snapshots/{snap_id}/receive",
                                                   {"labels": dict(sandbox.labels), "key": started["key"],
                                                    "ttl": _left(sandbox)}))
            if on_running is not None:
                on_running(moved)
            reply = target.request("GET", f"/v1/sandboxes/{moved.id}/memory", params={"wait": MIGRATE_WAIT},
                                   timeout=MIGRATE_WAIT + target.timeout)
            delivered = bool(reply["all_in"])
        finally:
            with contextlib.suppress(AgentEnvError):  # the images are the restored sandbox's own (or of no use)
                target.request("DELETE", f"/v1/snapshots/{snap_id}", params={"background": True}, idempotent=True)
            done = source.request("POST", f"/v1/sandboxes/{sandbox.id}/migrate/finish",
                                  {"snapshot": snap_id, "delivered": delivered}, timeout=MIGRATE_WAIT + source.timeout)
            if not done["moved"] and moved is not None:
                moved.close()
        if not done["moved"]:
            raise TransferError(f"sandbox {sandbox.id} did not get every page of its memory to {target.url} within "
                                f"{MIGRATE_WAIT:g} s: it runs on at {source.url}, and the copy there was closed",
                                fix="retry, or move it paused (post_copy=False)")
        sandbox._closed = True  # the source closed it
        assert moved is not None
        return moved

    def get(self, sandbox_id: str) -> RemoteSandbox:
        return self._pool.first(lambda c: c.Sandbox.get(sandbox_id), SandboxNotFound,
                                f"no sandbox {sandbox_id!r} on any server of the pool that answers")

    def list(self) -> list[RemoteSandbox]:
        """Every sandbox on the servers that answer, and the ones last seen on servers that are down."""
        found = [sb for _, sbs in self._pool._each(lambda c: c.Sandbox.list()) for sb in sbs]
        seen = {sb.id for sb in found}
        with self._pool._lock:
            gone = [sb for sid, sb in self._pool._known.items() if sb.client.down and sid not in seen and not sb._closed]
        return sorted(found + gone, key=lambda s: s.created_at)


class PoolSnapshotAPI:
    """``pool.Snapshot``: snapshots across the pool's servers."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool

    def get(self, snapshot_id: str) -> RemoteSnapshot:
        return self._pool.first(lambda c: c.Snapshot.get(snapshot_id), SnapshotNotFound,
                                f"no snapshot {snapshot_id!r} on any server of the pool that answers")

    def list(self) -> list[RemoteSnapshot]:
        return sorted((s for _, snaps in self._pool._each(lambda c: c.Snapshot.list()) for s in snaps),
                      key=lambda s: s.created_at)


def _left(sandbox: RemoteSandbox) -> float | None:
    """What is left of ``sandbox``'s deadline, which a move keeps (None: it has none)."""
    return None if sandbox.expires_at is None else max(1e-3, sandbox.expires_at - time.time())
