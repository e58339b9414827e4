"""Post-copy migration of a running sandbox: it runs on the receiver before its memory is there.

``send`` dumps the sandbox lazily (``agentenv.snapshot.postcopy``): its files and every image but the anonymous
pages make a snapshot whose label names the page server (``PAGE_SERVER``), which serves the pages on
127.0.0.1 to whoever proves the migration's key (``Outgoing.key``, ``agentenv.snapshot.page_channel``); the sandbox
stays frozen on the source. A restore of that snapshot with the key (here, or on another server once exported:
``agentenv.snapshot.transfer``; the key goes there in the receiver's own request, never with the snapshot)
restores lazily with a ``criu lazy-pages`` daemon pulling from the page server, so its processes run as soon as
the small images are in; ``all_in`` says when every page is. The
source's ``Outgoing.finish`` then closes the sandbox there, or, on anything less (no receiver before the
deadline, a receiver that failed, a transfer CRIU did not finish), thaws it and it runs on: never lost, and
never running twice (the source is frozen while the receiver runs, and only destroyed once it has every page).
"""

from __future__ import annotations

import contextlib
import ipaddress
import threading

from agentenv.errors import CheckpointError, PageServerKeyError, SandboxStateError
from agentenv.sandbox import snapshotting
from agentenv.sandbox.parts import Parts
from agentenv.snapshot import page_channel, postcopy, store
from agentenv.snapshot.store import Snapshot

PAGE_SERVER = "agentenv.page_server"  # label of a post-copy snapshot: "address:port" of its page server
CONNECT_TIMEOUT = 60.0  # seconds the page server waits for a receiver before the source resumes
ALL_IN_TIMEOUT = 300.0  # seconds for every page to go over once the receiver runs
FINISH_TIMEOUT = CONNECT_TIMEOUT + ALL_IN_TIMEOUT + 60.0  # seconds before an unfinished migration resumes the source
outgoing: dict[str, Outgoing] = {}  # the migrations this process is sending, by snapshot id (the server's routes)


def page_server_of(snap: Snapshot, key: bytes | None = None) -> page_channel.Endpoint | None:
    """Where a post-copy snapshot's pages are served, with the migration's ``key`` that its page server asks for
    (None for any other snapshot); PageServerKeyError where the key is missing for one, or given for another."""
    value = snap.labels.get(PAGE_SERVER)
    if not value:
        if key is not None:
            raise PageServerKeyError(f"snapshot {snap.id} is not a post-copy migration's: a page-server key is for "
                                  "those alone", fix="restore it without one")
        return None
    if key is None or len(key) != page_channel.KEY_BYTES:
        raise PageServerKeyError(f"snapshot {snap.id} is a post-copy migration's: its pages are served to the holder of "
                              f"the migration's key ({page_channel.KEY_BYTES} bytes), and "
                              f"{'none' if key is None else f'one of {len(key)} bytes'} was given",
                              fix="receive it with the key its migrate call returned (POST /v1/snapshots/{id}/"
                                  "receive, or Sandbox.restore(..., page_server_key=...)); Pool.Sandbox.move("
                                  "..., post_copy=True) does both")
    host, _, port = value.rpartition(":")
    return page_channel.Endpoint(host, int(port), key)


class Outgoing:
    """A sandbox being migrated away: frozen here, its pages served until the receiver has them all. A watchdog
    ends it (the sandbox runs on here) when no receiver connected within CONNECT_TIMEOUT s, or nobody called
    ``finish`` within FINISH_TIMEOUT s."""

    def __init__(self, sb: Parts, snapshot: Snapshot, server: postcopy.PageServer) -> None:
        self.sb, self.snapshot, self.server = sb, snapshot, server
        self.key = server.channel.key  # what the receiver proves (given to the caller, never stored)
        self._lock = threading.Lock()
        self.finished = threading.Event()  # set once ``finish`` has ended it
        self.moved: bool | None = None
        threading.Thread(target=self._watch, name="agentenv-migration-watch", daemon=True).start()

    def _watch(self) -> None:
        if self.finished.wait(CONNECT_TIMEOUT):
            return
        if self.server.listening() or not self.finished.wait(FINISH_TIMEOUT - CONNECT_TIMEOUT):
            self.finish(False)

    def finish(self, delivered: bool, timeout: float = ALL_IN_TIMEOUT) -> bool:
        """End the migration here: with ``delivered`` (the receiver said it has every page) and CRIU's transfer
        ended well within ``timeout`` s, the sandbox is closed here (True); otherwise the transfer is ended and
        the sandbox thawed: it runs on here (False), and the receiver's copy must be closed. Once: a later call
        answers what the first did."""
        with self._lock:
            if self.moved is None:
                self.moved = self._finish(delivered, timeout)
                self.finished.set()
                with contextlib.suppress(KeyError):
                    del outgoing[self.snapshot.id]
            return self.moved

    def _finish(self, delivered: bool, timeout: float) -> bool:
        self.server.wait(timeout if delivered else 0.0)
        code = self.server.abandon()  # its listener closed on every path; CRIU ended if it still serves
        moved = delivered and code == 0
        try:
            if moved:
                self.sb.close()
            elif self.sb.lifecycle.container.freezer() is not None:  # (none if the sandbox was closed meanwhile)
                self.sb.lifecycle.container.freeze(False)
        finally:
            with contextlib.suppress(Exception):
                self.snapshot.delete()
        return moved


def send(sb: Parts, address: str = "127.0.0.1", port: int = 0) -> Outgoing:
    """Dump ``sb`` lazily with its pages served on ``address``:``port`` (one the kernel picks if 0) to the holder
    of the returned migration's ``key``, for a receiver to restore the returned snapshot from; the sandbox is
    frozen until ``finish``. The connection is authenticated, not encrypted: only a loopback address is taken
    (see docs/transfer.md for other hosts)."""
    try:
        loopback = ipaddress.ip_address(address).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise CheckpointError(f"the page server of a post-copy migration binds loopback only, not {address!r}",
                              fix="use 127.0.0.1 (servers on one host), or a tunnel to the other host's loopback")
    served: list[postcopy.PageServer] = []
    with sb.locked():
        sb.require_running()
        refuse_calls(sb.id)
        if sb.paused_snapshot:
            raise SandboxStateError(f"sandbox {sb.id} is paused: resume it before migrating it post-copy")
        try:
            channel = page_channel.Listener(address, port)  # bound now: the label names a port that is ours
        except OSError as e:
            raise CheckpointError(f"could not listen on {address}:{port} for the page server: {e}",
                                  fix="leave the port to the kernel (0), or free it") from e
        try:
            snap = snapshotting.take(sb, memory=True, leave_running=True, op="migrate",
                                     labels={"agentenv.kind": store.MIGRATE_KIND, PAGE_SERVER: str(channel.endpoint)},
                                     page_server=channel, served=served, owner=store.owner())
        except BaseException:
            for server in served:  # dumped, then failed: the source is kept
                server.abandon()
            channel.close()
            if served:
                sb.lifecycle.container.freeze(False)
            raise
    out = outgoing[snap.id] = Outgoing(sb, snap, served[0])
    return out


def under_way(sandbox_id: str) -> Outgoing | None:
    """The migration this process is sending of that sandbox, if one is under way (its calls are refused
    meanwhile: it is frozen)."""
    return next((out for out in list(outgoing.values()) if out.sb.id == sandbox_id), None)


def refuse_calls(sandbox_id: str) -> None:
    """SandboxStateError while the sandbox is frozen by a migration under way (a call would wait for it)."""
    if (out := under_way(sandbox_id)) is not None:
        raise SandboxStateError(f"sandbox {sandbox_id} is being migrated post-copy (snapshot {out.snapshot.id}): it "
                                "is frozen here until the move ends",
                                fix=f"wait for the move to end (at most {FINISH_TIMEOUT:g} s), then use the sandbox "
                                    "where it went (or here, if the move failed)")


def moving(sandbox_id: str) -> str | None:
    """The snapshot id of a migration of that sandbox under way in any live process of this host (another
    ``agentenv serve`` of the same home, say), found by its snapshot, which lives as long as the move; None
    when there is none. A scan of the store: for the TTL reaper, not for every call (``refuse_calls``)."""
    if (out := under_way(sandbox_id)) is not None:
        return out.snapshot.id
    return next((s.id for s in Snapshot.list() if s.labels.get("agentenv.kind") == store.MIGRATE_KIND
                 and s.sandbox_id == sandbox_id and store.owner_alive(s.owner)), None)


def all_in(sb: Parts, timeout: float = ALL_IN_TIMEOUT) -> bool:
    """True once a sandbox restored from a post-copy snapshot in this process has every page (its lazy-pages
    daemon exited 0), waiting at most ``timeout`` s; False if the transfer failed or is not done."""
    daemon = sb.record.lazy_pages
    return daemon is not None and postcopy.pulled(int(daemon[0]), timeout)
