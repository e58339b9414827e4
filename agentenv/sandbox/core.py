"""Sandboxes: containers you exec in, snapshot, fork, pause and restore (docs/architecture.md §3).

A sandbox is a runc container over a Docker image (see ``runtime``) whose PID 1 is the keeper
(see ``agentenv.inside.keeper``). Its record lives in ``<home>/sandboxes/<id>/sandbox.json``, so any process can
list, reattach to or restore it; state changes take a file lock, so two processes never snapshot
or close the same sandbox at once. This module is what a user calls: create, restore, get and list, state,
snapshot, fork, pause, resume and close. The calls into a running sandbox (exec, jobs, files) are
``agentenv.sandbox.calls``, which ``Sandbox`` inherits, as it inherits its record and lock (``Record``:
``agentenv.sandbox.record``).

The lifecycle surface. The lifecycle modules (how a snapshot is written, ``snapshotting``; a fork made, ``forking``;
a sandbox mended after ``kill -9``, ``recovery``; ``migration``, ``expiry``, ``usage``, the ``warm`` pool) work on
a sandbox through public names only (``agentenv.sandbox.parts.Parts``): its record (``record``, ``transition``,
``amend``, ``save_record``, ``reload``, under ``locked``) and one typed object, ``Sandbox.lifecycle``
(``agentenv.sandbox.lifecycle``), that holds the container, the channel to the keeper and the steps (start,
a pause's end, destroy, the layer; a new sandbox of the same class). The steps are kept off ``Sandbox`` itself so
that its methods stay what a user may call: each of those takes the lock and checks the state, then composes
steps that do neither.

What a sandbox writes goes to its layer on the volume (``agentenv.host.volume``): a subvolume limited to its
``disk=`` bytes. Operations that a ``kill -9`` could cut in half say so in the record first (the
``owner`` of a sandbox being made, the snapshot a ``pausing`` sandbox is writing), so that ``recover``
can finish or undo them: thaw a sandbox left frozen, remove half-made ones, finish or roll back a pause
(the work is in ``agentenv.sandbox.recovery``).
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from agentenv import netpolicy
from agentenv.api import (
    DEFAULT_DISK,
    DEFAULT_IMAGE,
    DEFAULT_TTL,
    Limits,
    Network,
    SandboxInfo,
    SnapshotLike,
    State,
    check_ttl,
    fork_count,
)
from agentenv.config import parse_disk, parse_size, paths
from agentenv.errors import MemorySharingUnsupported, SandboxNotFound, SandboxStateError
from agentenv.host import images, ksm, volume
from agentenv.host import network as hostnet
from agentenv.host.runtime import ContainerSpec
from agentenv.sandbox import (
    expiry,
    forking,
    forward,
    lifecycle,
    migration,
    record,
    recovery,
    snapshotting,
    warm,
    watchdog,
)
from agentenv.sandbox.calls import Calls, Process, max_output
from agentenv.sandbox.forward import Forward
from agentenv.sandbox.lifecycle import SandboxLifecycle
from agentenv.sandbox.record import Record, SandboxRecord
from agentenv.sandbox.recovery import RECOVER_PING_TIMEOUT, HostProcess
from agentenv.snapshot import shared
from agentenv.snapshot.container import Container
from agentenv.snapshot.store import Snapshot

__all__ = ["Process", "Sandbox", "max_output"]  # Process and max_output live in agentenv.sandbox.calls

log = logging.getLogger("agentenv")


class Sandbox(Calls, Record):
    """An isolated Linux environment with fast snapshot, fork, pause and restore."""

    def __init__(self, record: SandboxRecord) -> None:
        self._rec = record
        self.id: str = record.id
        p = paths()
        layer = record.layer  # its name; None in records made before the volume: the bundle then
        self._container = Container(f"ae-{self.id}", p.sandboxes / self.id, p.runc_root,
                                    p.layers / layer if layer else None)
        self.lifecycle: SandboxLifecycle[Sandbox] = SandboxLifecycle(self, self._container)
        self._channel = self.lifecycle.channel  # the same parts, as ``Record`` and ``Calls`` name them

    # --- creation ------------------------------------------------------------------------------

    @classmethod
    def create(cls, image: str = DEFAULT_IMAGE, *, cpus: float = 1.0, memory: str | int = "1g", pids: int = 512,
               disk: str | int | None = DEFAULT_DISK, network: bool | Network | Mapping[str, Any] = False,
               env: dict[str, str] | None = None, workdir: str | None = None, ttl: float | None = DEFAULT_TTL,
               labels: dict[str, str] | None = None, share_memory: bool | None = False) -> Sandbox:
        """Start a sandbox from a Docker image: CPU/memory/pids limits, a disk limit (``disk`` bytes, e.g. '10g';
        None: none), few capabilities. DiskLimitUnsupported if this host cannot enforce it. ``network``: False
        (loopback only), True (the outside, never the host), or outbound rules (``Network`` or a mapping with
        ``allow_out`` / ``deny_out``; NetworkRuleError for one that cannot be enforced). ``share_memory``: its
        memory forks share unwritten pages (KSM, ``agentenv.host.ksm``): True (MemorySharingUnsupported where
        not), None (where this host can, no other owner shares and the image's python3 can flag its pages: what the
        envs ask for) or False. The record's ``spec.share_memory`` says what it got. ``ttl``: seconds until it is
        closed (absolute; ``set_ttl`` moves it), enforced with or without a server (``agentenv.sandbox.watchdog``);
        None: it lives until closed."""
        check_ttl(ttl)
        if share_memory is not None and not isinstance(share_memory, bool):
            raise ValueError(f"share_memory must be True, False or None (share where this host can), got "
                             f"{share_memory!r}")
        share = ksm.choose(share_memory)
        disk_bytes = parse_disk(disk)
        rules = netpolicy.requested(network, never=(str(hostnet.subnet()),))
        limits = Limits(cpus=cpus, memory=parse_size(memory), pids=pids, disk=disk_bytes).checked()
        volume.ensure().require(disk_bytes)
        info = images.resolve(image)
        merged = dict(e.split("=", 1) for e in info.env if "=" in e)
        merged.update(env or {})
        spec = ContainerSpec(image_id=info.id, layers=info.layers, env=[f"{k}={v}" for k, v in merged.items()],
                             workdir=workdir or info.workdir, limits=limits, network=rules is not None,
                             rules=rules.to_json() if rules is not None else None, uids=warm.family(),
                             share_memory=share)
        if (sb := warm.take(image, spec, ttl, labels, cls)) is None:  # a started one, where a warm pool has it
            try:
                sb = lifecycle.make(cls, spec, image=image, ttl=ttl, labels=labels, parent=None)
                lifecycle.boot(sb, None, "create")
            except MemorySharingUnsupported:
                if share_memory is not None:
                    raise
                # the default falls back: this image's python3 could not flag its pages (no ctypes)
                spec.share_memory = False
                sb = lifecycle.make(cls, spec, image=image, ttl=ttl, labels=labels, parent=None)
                lifecycle.boot(sb, None, "create")
        return sb

    @classmethod
    def restore(cls, snapshot: SnapshotLike | str, *, labels: dict[str, str] | None = None,
                ttl: float | None = DEFAULT_TTL, page_server_key: bytes | None = None) -> Sandbox:
        """A new sandbox from a snapshot, in any process, after dockerd restarts or the source is gone; ``ttl`` as
        ``create``'s.
        ``page_server_key``: a post-copy migration's snapshot is restored with its migration's key
        (``agentenv.sandbox.migration``), which the source's page server asks for; no other snapshot takes one."""
        snap = snapshot if isinstance(snapshot, Snapshot) else Snapshot.get(
            snapshot if isinstance(snapshot, str) else snapshot.id)
        check_ttl(ttl)
        migration.page_server_of(snap, page_server_key)  # a missing or stray key refused before anything is made
        return lifecycle.restore(cls, snap, labels, "restore", ttl, page_server_key)

    # --- lookup -------------------------------------------------------------------------------

    @classmethod
    def get(cls, sandbox_id: str) -> Sandbox:
        try:
            return cls(record.load(paths().sandboxes / os.path.basename(sandbox_id) / "sandbox.json"))
        except FileNotFoundError:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}") from None

    @classmethod
    def list(cls) -> list[Sandbox]:
        """Every sandbox on this host, running or paused, oldest first."""
        return sorted((cls(rec) for rec in record.listed(paths().sandboxes)), key=lambda s: s.created_at)

    # --- properties ---------------------------------------------------------------------------

    def __repr__(self) -> str:
        return f"Sandbox(id={self.id!r}, state={self.state!r}, image={self.image!r})"

    @property
    def state(self) -> State:
        """'running', 'paused', 'closed', or 'lost' when its processes died behind our back (not while a pause is
        under way: its container goes before the record says paused, and a pause cut short is recovered)."""
        self.reload()
        st = self.recorded_state
        if st == "running" and not self._rec.pausing:
            runc = self._container.state()
            if runc is None or runc.get("status") not in ("running", "paused", "created"):
                return "lost"
        return st

    def ping(self, timeout: float | None = None) -> None:
        """Ask the keeper to answer (within ``timeout`` s, else the call's usual deadline); ConnectionLost (or
        another AgentEnvError) when it does not."""
        self._channel.call({"op": "ping"}, timeout=timeout)

    def info(self, state: State | None = None) -> SandboxInfo:
        """What this sandbox is now (``state`` when the caller knows it, saving a runc call)."""
        return SandboxInfo(id=self.id, state=state or self.state, image=self.image,
                           created_at=self.created_at, expires_at=self.expires_at, labels=self.labels,
                           limits=self.limits, network=self.network, parent_snapshot=self.parent_snapshot,
                           forked_from=self.forked_from)

    def update_network(self, allow_out: Sequence[str] = (), deny_out: Sequence[str] = ()) -> Network:
        """Replace the outbound rules of a sandbox made with network, at once if it runs (a paused one gets them
        when it resumes); host names are resolved now. NetworkRuleError (nothing changed) for a rule that
        cannot be enforced."""
        rules = netpolicy.check(allow_out, deny_out, never=(str(hostnet.subnet()),))
        with self.locked():
            spec = self.container_spec()
            if not spec.network:
                raise SandboxStateError(f"sandbox {self.id} was made without network: it has no rules to change",
                                        fix="create it with network=True (or rules) to give it an outside link")
            if self._rec.state == "running":
                self._container.set_rules(rules)
            spec.rules = rules.to_json()
            self.amend(spec=spec.to_json())
            self.save_record()
        assert (net := self.network) is not None
        return net

    def forward(self, port: int, to: tuple[str, int], *, max_connections: int = 64,
                idle_timeout: float = 900.0) -> Forward:
        """Make ``127.0.0.1:port`` inside the sandbox reach the host endpoint ``to`` (an IP address and a port, e.g.
        an LLM gateway on the host's loopback) and nothing else of the host, with or without network; returns the
        forward (its ``url`` is what a process inside connects to). At most ``max_connections`` relays at once,
        each closed after ``idle_timeout`` s of silence. Relayed by this process, until the sandbox closes (a
        fork made here keeps it, a restore needs it again: ``agentenv.sandbox.forward``). ValueError for a bad
        port or target, or a port forwarded elsewhere already; OSError if the port is taken inside."""
        if not (isinstance(to, tuple | list) and len(to) == 2):
            raise ValueError(f"to must be (host address, port), e.g. ('127.0.0.1', 8080); got {to!r}")
        fwd = Forward(port, to[0], to[1], max_connections, idle_timeout).checked()
        self.require_running()
        self._channel.call({"op": "listen", "port": fwd.port})
        relayed = type(self).get(self.id)  # a handle of the relays' own: their reloads never undo this one's changes
        forward.add(self.id, fwd, relayed.lifecycle.channel, lambda: relayed.state)
        return fwd

    @property
    def forwards(self) -> builtins.list[Forward]:
        """The host endpoints this process forwards into the sandbox (``forward``)."""
        return forward.of(self.id)

    def set_ttl(self, ttl: float) -> None:
        """Extend (or shorten) the time to live, counted from now."""
        with self.locked():
            self.amend(expires_at=time.time() + ttl)
            self.save_record()
        watchdog.ensure()

    # --- snapshots ----------------------------------------------------------------------------

    def snapshot(self, memory: bool = False, *, labels: dict[str, str] | None = None) -> Snapshot:
        """Save the filesystem (and with ``memory=True`` every process) into the snapshot store."""
        with self.locked():
            self.require_running()
            snap = snapshotting.take(self, memory, leave_running=True, labels=labels, op="snapshot")
        shared.publish(snap)  # with a shared store, other servers can restore it (even once this one is gone)
        return snap

    def fork(self, n: int = 1, *, memory: bool = True, ttl: float | None = DEFAULT_TTL) -> builtins.list[Sandbox]:
        """``n`` independent sandboxes that continue from this instant; this one keeps running (a paused one, forked
        with its memory, stays paused: its children continue from where it was paused). Each child has its own
        deadline, ``ttl`` from now (as ``create``'s), whatever the parent's.

        With ``memory=False`` the children get this sandbox's files only (fresh processes): cheaper,
        and all an episode needs when its state lives in files. How: ``agentenv.sandbox.forking``.
        """
        kids = forking.fork(self, fork_count(n), memory, check_ttl(ttl))
        try:
            for fwd in self.forwards:  # each child's own relays, to the same endpoints
                for kid in kids:
                    kid.forward(fwd.port, (fwd.host, fwd.host_port), max_connections=fwd.max_connections,
                                idle_timeout=fwd.idle_timeout)
        except BaseException:
            for kid in kids:
                kid.close()
            raise
        return kids

    def pause(self, memory: bool = True) -> Snapshot:
        """Free the sandbox's CPU and memory; its whole state goes to the snapshot store (with ``memory=False``
        its files only, as at the instant they were saved: its processes end, and ``resume`` boots it afresh).

        The record names the snapshot being written (``pausing``) until the pause is done, so that if this
        process dies midway, ``recover`` finishes the pause (CRIU had dumped the processes) or rolls it
        back (they still run): the sandbox ends up paused or running, never lost.
        """
        with self.locked():
            return snapshotting.pause(self, memory)

    def resume(self, memory: bool = True) -> None:
        """Bring a paused sandbox back where it was; with ``memory=False`` (or from a files-only pause) boot it
        afresh from its files instead: its processes are gone, the keeper starts anew. A deadline that passed while
        it was paused starts again, ``DEFAULT_TTL`` from now (as E2B's connect gives a timeout again): a resumed
        sandbox is never reaped at once."""
        with self.locked():
            if self._rec.state != "paused":
                raise SandboxStateError(f"sandbox {self.id} is {self._rec.state}, not paused")
            if self._rec.expires_at is not None and self._rec.expires_at <= time.time():
                self.amend(expires_at=time.time() + DEFAULT_TTL)
            snap = Snapshot.get(self._rec.paused_snapshot or "")
            self.lifecycle.drop_layer()
            try:
                self.lifecycle.start(snap, "resume", memory)
            except BaseException:
                self.transition("paused", init_pid=None, init_start=None)
                self.lifecycle.keeper = None
                self.save_record()
                raise
            self.amend(paused_snapshot=None)
            self.save_record()
        for fwd in self.forwards:  # listening again before this returns (a keeper started afresh has no listener)
            self._channel.call({"op": "listen", "port": fwd.port})
        forward.woken(self.id)
        snap.delete(background=True)

    # --- teardown -----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every process and remove the sandbox (its snapshots stay in the store); idempotent."""
        if not self._container.bundle.exists():
            self.transition("closed")
            return
        with self.locked(allow_closed=True):
            paused = self._rec.paused_snapshot
            self.lifecycle.destroy()
        forward.dropped(self.id)
        if paused:
            with contextlib.suppress(Exception):
                Snapshot.get(paused).delete()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def expire(self) -> str | None:
        """Close (or pause, where it asked to) the sandbox if, checked under its lock, it runs past its TTL
        (``expiry.expire``)."""
        return expiry.expire(self)

    @classmethod
    def reap_expired(cls) -> builtins.list[str]:
        """Close, or pause where its ``agentenv.on_expiry`` label asks for it, every running sandbox past its TTL;
        returns their ids (``agentenv.sandbox.expiry``)."""
        return expiry.reap(cls.list())

    # --- recovery (the work: agentenv.sandbox.recovery) -----------------------------------------------

    def recover(self, procs: builtins.list[HostProcess] | None = None,
                ping_timeout: float = RECOVER_PING_TIMEOUT) -> str:
        """Bring a sandbox that a dead process left mid-operation back to a whole state, and say where it is.

        Returns 'running' (it answers), 'paused', 'lost' (its processes are gone), 'discarded' (it was
        half-made: removed) or 'busy' (a live process is working on it: left alone). A sandbox left frozen
        is thawed, a pause cut short is finished (CRIU had dumped its processes: the snapshot is published)
        or rolled back (they still run). Before touching it, recovery waits for what a dead process started
        on it (runc, CRIU, cp) to end. Idempotent, and safe while other processes use the sandbox.
        ``procs``: the host's processes (``host_processes()``), when the caller already listed them.
        """
        return recovery.recover(self, procs, ping_timeout)

    def thaw_abandoned(self, procs: builtins.list[HostProcess] | None = None) -> bool:
        """Thaw the sandbox if a dead process left it frozen (its snapshot was cut short); True if it did.

        Cheap (no keeper call); it leaves alone a sandbox that a live process holds, or that a runc, CRIU or
        cp of a dead one is still working on (``recover`` waits for those).
        """
        return recovery.thaw_abandoned(self, procs)

warm.bind(Sandbox.create)  # the warm pool starts its sandboxes as ``Sandbox.create`` does
