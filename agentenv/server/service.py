"""What the server's routes share: a cache of Sandbox objects, the quotas, the TTL reaper and the metrics.

All state lives on disk (sandbox records and the snapshot store), so a server killed with ``kill -9``
and started again lists every paused sandbox and snapshot, reattaches to the running sandboxes and
reports the ones whose processes died as ``lost`` (``Service.recover``). What the kill cut short is
mended first (``agentenv.sandbox.sweep.recover_all``): a sandbox left frozen is thawed, half-made fork children
are removed, a pause is finished or rolled back, the fork's snapshot is collected; one sandbox that does
not answer holds up neither the start nor the others.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from agentenv import errors
from agentenv.api import DEFAULT_TTL, fork_count
from agentenv.host import network, userns
from agentenv.sandbox import migration
from agentenv.sandbox.core import Sandbox
from agentenv.sandbox.sweep import recover_all
from agentenv.server.schemas import Capacity
from agentenv.snapshot.imported import ORIGIN
from agentenv.snapshot.store import Snapshot

log = logging.getLogger("agentenv.server")
RETRY_AFTER = 5.0  # seconds a client is told to wait when a quota is full
RECOVER_WAIT = 5.0  # seconds the start waits for recovery; what is not done by then goes on in the background


@dataclass
class Metrics:
    """Operation latencies for Prometheus: a histogram per route."""

    buckets: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
    ops: dict[str, list[float]] = field(default_factory=dict)  # name -> [count, sum, *bucket counts]
    lock: threading.Lock = field(default_factory=threading.Lock)

    def observe(self, op: str, seconds: float) -> None:
        with self.lock:
            row = self.ops.setdefault(op, [0.0] * (2 + len(self.buckets)))
            row[0] += 1
            row[1] += seconds
            for i, b in enumerate(self.buckets):
                if seconds <= b:
                    row[2 + i] += 1

    def lines(self) -> Iterator[str]:
        yield "# HELP agentenv_operation_seconds Latency of server operations."
        yield "# TYPE agentenv_operation_seconds histogram"
        with self.lock:
            rows = {k: list(v) for k, v in self.ops.items()}
        for op, row in sorted(rows.items()):
            for i, b in enumerate(self.buckets):
                yield f'agentenv_operation_seconds_bucket{{op="{op}",le="{b}"}} {int(row[2 + i])}'
            yield f'agentenv_operation_seconds_bucket{{op="{op}",le="+Inf"}} {int(row[0])}'
            yield f'agentenv_operation_seconds_sum{{op="{op}"}} {row[1]:.6f}'
            yield f'agentenv_operation_seconds_count{{op="{op}"}} {int(row[0])}'


class Service:
    """What the routes share: a cache of Sandbox objects, the quotas, the TTL reaper and the metrics."""

    def __init__(self, max_sandboxes: int, max_memory: int, reap_interval: float, max_disk: int = 640 << 30,
                 unlimited_disk: bool = False) -> None:
        self.max_sandboxes, self.max_memory, self.reap_interval = max_sandboxes, max_memory, reap_interval
        self.max_disk, self.unlimited_disk = max_disk, unlimited_disk
        self.metrics = Metrics()
        self.recovered: dict[str, list[str]] = {"running": [], "paused": [], "lost": []}
        self._cache: dict[str, Sandbox] = {}
        self._lock = threading.Lock()
        self._pending = [0, 0, 0]  # sandboxes, bytes of memory and of disk reserved by operations in flight
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None

    # lookup
    def sandbox(self, sandbox_id: str) -> Sandbox:
        """The cached Sandbox of an id (its record is read once), SandboxNotFound if there is none."""
        sb = self._cache.get(sandbox_id)
        if sb is None:
            sb = Sandbox.get(sandbox_id)
            if not sb.exists():
                raise errors.SandboxNotFound(f"no sandbox {sandbox_id!r}")
            self._cache[sandbox_id] = sb
        return sb

    def remember(self, sb: Sandbox) -> Sandbox:
        self._cache[sb.id] = sb
        return sb

    def forget(self, sandbox_id: str) -> None:
        self._cache.pop(sandbox_id, None)

    def call(self, sandbox_id: str, fn: Callable[[Sandbox], Any]) -> Any:
        """Run ``fn`` on a sandbox; if its keeper stopped answering, drop the cached object and say why. Refused
        while a post-copy migration holds it frozen (``migration.refuse_calls``)."""
        migration.refuse_calls(sandbox_id)
        sb = self.sandbox(sandbox_id)
        try:
            return fn(sb)
        except (errors.SandboxLost, errors.ConnectionLost) as e:
            failure = self.failed(sandbox_id, e)
            if failure is e:
                raise
            raise failure from None

    def failed(self, sandbox_id: str, exc: BaseException) -> BaseException:
        """What a call on a sandbox that raised ``exc`` should raise (``call``'s handling, for a stream): if its
        keeper stopped answering, the cached object is dropped, and a sandbox no longer running says so."""
        if isinstance(exc, errors.SandboxLost):
            self.forget(sandbox_id)  # its pinned keeper is gone: the next call starts from the record
        elif isinstance(exc, errors.ConnectionLost):
            self.forget(sandbox_id)
            try:
                state = self.sandbox(sandbox_id).state
            except errors.SandboxNotFound as gone:
                return gone
            if state != "running":  # paused (e.g. by the TTL reaper) or closed by another process
                return errors.SandboxStateError(f"sandbox {sandbox_id} is {state}",
                                                fix="resume() a paused sandbox; a lost or closed one is gone")
        return exc

    # quotas
    def _usage(self) -> tuple[int, int, int]:
        """Live sandboxes, and the memory and disk they may use: the running ones, and those that other
        processes are making (this one's are reserved while it makes them); a disk without a limit counts 0."""
        live = mem = disk = 0
        for sb in Sandbox.list():
            if sb.recorded_state == "running" or (sb.recorded_state == "creating" and not sb.made_here()):
                limits = sb.limits
                live += 1
                mem += limits.memory
                disk += limits.disk or 0
        return live, mem, disk

    def capacity(self) -> Capacity:
        live, mem, disk = (a + b for a, b in zip(self._usage(), self._pending, strict=True))
        return Capacity(max_sandboxes=self.max_sandboxes, live_sandboxes=live,
                        free_sandboxes=max(0, self.max_sandboxes - live), max_memory=self.max_memory,
                        memory_used=mem, free_memory=max(0, self.max_memory - mem), max_disk=self.max_disk,
                        disk_used=disk, free_disk=max(0, self.max_disk - disk))

    def check_disk(self, disk: int | None) -> None:
        """DiskLimitRequired for a sandbox without a disk limit, unless the server allows them (--unlimited-disk)."""
        if disk is None and not self.unlimited_disk:
            raise errors.DiskLimitRequired("this server gives every sandbox a disk limit",
                                           fix="send disk as a size (e.g. '10g'); sandboxes without one need a "
                                               "server started with --unlimited-disk")

    @contextlib.contextmanager
    def reserve(self, count: int, memory: int, disk: int | None = None) -> Iterator[None]:
        """Hold room for ``count`` new live sandboxes using ``memory`` and ``disk`` bytes each, or raise
        QuotaExceeded."""
        held = (count, count * memory, count * (disk or 0))  # sandboxes, memory, disk: as ``_pending`` counts them
        with self._lock:
            live, used, disk_used = (a + b for a, b in zip(self._usage(), self._pending, strict=True))
            if live + count > self.max_sandboxes:
                raise errors.QuotaExceeded(f"{live} of {self.max_sandboxes} sandboxes are live; {count} more do not fit",
                                           retry_after=RETRY_AFTER)
            if used + held[1] > self.max_memory:
                raise errors.QuotaExceeded(f"{used} of {self.max_memory} bytes of sandbox memory are in use; "
                                           f"{count} x {memory} more do not fit", retry_after=RETRY_AFTER)
            if disk_used + held[2] > self.max_disk:
                raise errors.QuotaExceeded(f"{disk_used} of {self.max_disk} bytes of sandbox disk are promised; "
                                           f"{count} x {disk} more do not fit", retry_after=RETRY_AFTER)
            for i, amount in enumerate(held):
                self._pending[i] += amount
        try:
            yield
        finally:
            with self._lock:
                for i, amount in enumerate(held):
                    self._pending[i] -= amount

    # sandboxes made within the quotas: the operations that start sandboxes, for every route that does
    def restore(self, snap: Snapshot, labels: dict[str, str] | None = None, ttl: float | None = DEFAULT_TTL,
                page_server_key: bytes | None = None) -> Sandbox:
        """A sandbox restored from ``snap``, its room reserved first (QuotaExceeded when there is none); one imported
        from elsewhere is held to this server's rule on disk limits too, as a create is (``check_disk``); a post-copy
        migration's with its ``page_server_key``."""
        limits = snap.spec.get("limits", {})
        if ORIGIN in snap.labels:
            self.check_disk(limits.get("disk"))
        with self.reserve(1, int(limits.get("memory", 1 << 30)), limits.get("disk")):
            return self.remember(Sandbox.restore(snap, labels=labels, ttl=ttl, page_server_key=page_server_key))

    def fork(self, sandbox_id: str, count: int, memory: bool, ttl: float | None = DEFAULT_TTL) -> list[Sandbox]:
        """``count`` children of a sandbox (``api.fork_count``, ``Sandbox.fork``), their room reserved first; those
        of a paused one (memory and all) are restored from its pause snapshot, which it keeps."""
        count = fork_count(count)
        limits = self.sandbox(sandbox_id).limits
        with self.reserve(count, limits.memory, limits.disk):
            kids = self.call(sandbox_id, lambda s: s.fork(count, memory=memory, ttl=ttl))
        return [self.remember(k) for k in kids]

    def resume(self, sandbox_id: str, memory: bool = True) -> Sandbox:
        """A paused sandbox running again, its room reserved first (``memory=False``: booted from its files)."""
        sb = self.sandbox(sandbox_id)
        limits = sb.limits
        with self.reserve(1, limits.memory, limits.disk):
            sb.resume(memory=memory)
        return sb

    # lifecycle
    def recover(self, wait: float = RECOVER_WAIT) -> None:
        """After a (re)start: mend what a kill cut short, reattach running sandboxes, report lost ones.

        Waits ``wait`` seconds at most: sandboxes still being recovered then are listed under 'recovering'
        and move to their bucket when done (their calls wait on their lock meanwhile).
        """
        def done(sb: Sandbox, where: str) -> None:
            if where == "running":
                self.remember(sb)

        log.info("%s", network.describe())
        log.info("%s", userns.describe())
        recover_all(wait, self.recovered, self._lock, on_result=done)
        found = self.recovered_now()
        if found["lost"]:
            log.warning("lost sandboxes (their processes are gone; close them): %s", ", ".join(found["lost"]))
        log.info("reattached %d running sandboxes; %d paused; %d half-made removed; %d still recovering; "
                 "%d snapshots in the store", len(found["running"]), len(found["paused"]),
                 len(found.get("discarded", [])), len(found.get("recovering", [])), len(Snapshot.list()))

    def recovered_now(self) -> dict[str, list[str]]:
        """What recovery found so far, by bucket (a copy)."""
        with self._lock:
            return {k: list(v) for k, v in self.recovered.items()}

    def start_reaper(self) -> None:
        def loop() -> None:
            while not self._stop.wait(self.reap_interval):
                try:
                    for sid in Sandbox.reap_expired():  # each logged as it is paused or closed
                        self.forget(sid)
                except Exception:  # noqa: BLE001 - the reaper must outlive any one failure
                    log.exception("TTL reaper")

        self._reaper = threading.Thread(target=loop, name="agentenv-ttl-reaper", daemon=True)
        self._reaper.start()

    def stop(self) -> None:
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join(timeout=5)

    def prometheus(self) -> str:
        states: dict[str, int] = dict.fromkeys(("running", "paused", "lost", "creating"), 0)
        for sb in Sandbox.list():
            states[sb.state] = states.get(sb.state, 0) + 1
        snaps = Snapshot.list()
        lines = ["# HELP agentenv_sandboxes Sandboxes on this host by state.", "# TYPE agentenv_sandboxes gauge"]
        lines += [f'agentenv_sandboxes{{state="{k}"}} {v}' for k, v in sorted(states.items())]
        lines += ["# HELP agentenv_snapshots Snapshots in the store.", "# TYPE agentenv_snapshots gauge",
                  f"agentenv_snapshots {len(snaps)}",
                  "# HELP agentenv_snapshot_store_bytes Bytes used by the snapshot store.",
                  "# TYPE agentenv_snapshot_store_bytes gauge",
                  f"agentenv_snapshot_store_bytes {sum(s.size_bytes for s in snaps)}"]
        lines += list(self.metrics.lines())
        return "\n".join(lines) + "\n"
