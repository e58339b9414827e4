"""Sandboxes: containers you exec in, snapshot, fork, pause and restore (docs/architecture.md §3).

A sandbox is a runc container over a Docker image (see ``runtime``) whose PID 1 is the agent
(see ``agent``). Its record lives in ``<home>/sandboxes/<id>/sandbox.json``, so any process can
list, reattach to or restore it; state changes take a file lock, so two processes never snapshot
or close the same sandbox at once. This module is its lifecycle: create, restore, get and list, state,
snapshot, fork, pause, resume and close (the record and the lock: ``agentenv.sandbox.record``). The calls into a running sandbox
(exec, jobs, files) are ``agentenv.sandbox.calls``, which ``Sandbox`` inherits; how a snapshot is written,
``agentenv.sandbox.snapshotting``; how a fork is made, ``agentenv.sandbox.forking``.

The record names the agent by pid *and* start time; each Sandbox object pins it with a pidfd and
checks, before every connection, that the process it reaches is still that agent. A pid number that
the kernel has since given to another sandbox's agent therefore never leads there: the handle follows
the record (another handle may have paused and resumed the sandbox) or fails with SandboxLost.

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
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from agentenv import netpolicy
from agentenv.api import (
    DEFAULT_DISK,
    DEFAULT_IMAGE,
    Limits,
    Network,
    SandboxInfo,
    SnapshotLike,
    State,
    fork_count,
)
from agentenv.config import PRIVATE_DIR, crash_point, parse_disk, parse_size, paths
from agentenv.errors import (
    CheckpointError,
    SandboxError,
    SandboxLost,
    SandboxNotFound,
    SandboxStateError,
)
from agentenv.host import admission, image_store, images, ksm, userns, volume
from agentenv.host import network as hostnet
from agentenv.host.hostcalls import proc_start_time
from agentenv.host.keeper_process import KeeperProcess, protect_keeper
from agentenv.host.runtime import ContainerSpec
from agentenv.host.trees import remove_tree
from agentenv.inside import frames
from agentenv.phases import phase
from agentenv.sandbox import expiry, forking, migration, record, recovery, snapshotting, warm
from agentenv.sandbox.calls import Calls, Process, max_output
from agentenv.sandbox.channel import Channel, Gate, Root
from agentenv.sandbox.parts import START_TIMEOUT
from agentenv.sandbox.record import Record, SandboxRecord
from agentenv.sandbox.recovery import RECOVER_PING_TIMEOUT, HostProcess
from agentenv.snapshot import lazy_pages, shared, store
from agentenv.snapshot.container import Container
from agentenv.snapshot.store import Snapshot

__all__ = ["Process", "Sandbox", "max_output"]  # Process and max_output live in agentenv.sandbox.calls

log = logging.getLogger("agentenv")
_gates: dict[str, Gate] = {}
_gates_lock = threading.Lock()


def _gate(sandbox_id: str) -> Gate:
    """One gate per sandbox per process, shared by every Sandbox object of that id."""
    with _gates_lock:
        return _gates.setdefault(sandbox_id, Gate())


class Sandbox(Calls, Record):
    """An isolated Linux environment with fast snapshot, fork, pause and restore."""

    def __init__(self, record: SandboxRecord) -> None:
        self._rec = record
        self.id: str = record.id
        p = paths()
        layer = record.layer  # its name; None in records made before the volume: the bundle then
        self._container = Container(f"ae-{self.id}", p.sandboxes / self.id, p.runc_root,
                                    p.layers / layer if layer else None)
        self._channel = Channel(self._root, _gate(self.id))
        self._agent: KeeperProcess | None = None  # the pinned keeper, once a call has needed it
        self._starting = False  # in _start: the record on disk does not name the new agent yet

    # --- creation ------------------------------------------------------------------------------

    @classmethod
    def create(cls, image: str = DEFAULT_IMAGE, *, cpus: float = 1.0, memory: str | int = "1g", pids: int = 512,
               disk: str | int | None = DEFAULT_DISK, network: bool | Network | Mapping[str, Any] = False,
               env: dict[str, str] | None = None, workdir: str | None = None, ttl: float | None = None,
               labels: dict[str, str] | None = None, share_memory: bool = False) -> Sandbox:
        """Start a sandbox from a Docker image: CPU/memory/pids limits, a disk limit (``disk`` bytes, e.g. '10g';
        None: none), few capabilities. DiskLimitUnsupported if this host cannot enforce it. ``network``: False
        (loopback only), True (the outside, never the host), or outbound rules (``Network`` or a mapping with
        ``allow_out`` / ``deny_out``; NetworkRuleError for one that cannot be enforced). ``share_memory``: its
        memory forks share unwritten pages (KSM, opt-in: ``agentenv.host.ksm``); MemorySharingUnsupported where not."""
        if ttl is not None and ttl <= 0:
            raise ValueError(f"ttl must be positive seconds, got {ttl!r}")
        if not isinstance(share_memory, bool):
            raise ValueError(f"share_memory must be True or False, got {share_memory!r}")
        if share_memory:
            ksm.require()
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
                             share_memory=share_memory)
        if (sb := warm.take(image, spec, ttl, labels, cls)) is None:  # a started one, where a warm pool has it
            sb = cls._new(spec, image=image, ttl=ttl, labels=labels, parent=None)
            sb._boot(None, "create")
        return sb

    @classmethod
    def _new(cls, spec: ContainerSpec, image: str, ttl: float | None, labels: dict[str, str] | None,
             parent: str | None) -> Sandbox:
        """The record of a sandbox being made: state 'creating', owned by this process until it runs (if
        the process dies first, ``recover`` removes what there is of it)."""
        with contextlib.suppress(OSError):  # the image's last use (agentenv.host.image_store): never fails a start
            image_store.record_use(spec.image_id, [image] if image != spec.image_id else [])
        now = time.time()
        sid = store.new_id("sb")
        sb = cls(SandboxRecord(id=sid, image=image, spec=spec.to_json(), state="creating", created_at=now,
                               expires_at=now + ttl if ttl else None, labels=dict(labels or {}),
                               parent_snapshot=parent, layer=sid, owner=store.owner()))
        sb._container.bundle.mkdir(mode=PRIVATE_DIR)  # the gate of its range once it holds one (userns)
        sb._save()
        return sb

    def _boot(self, snap: Snapshot | None, op: str, page_server_key: bytes | None = None) -> None:
        """Start a new sandbox, fresh or from a snapshot; on failure nothing of it is left."""
        try:
            self._start(snap, op, page_server_key=page_server_key)
        except BaseException:
            self._destroy()
            raise

    @admission.admitted  # a burst of starts queues rather than thrashes (agentenv.host.admission)
    def _start(self, snap: Snapshot | None, op: str, memory: bool = True, page_server_key: bytes | None = None) -> None:
        """Make the layer and the bundle, start the agent (or restore every process, unless ``memory`` is False)
        and wait until it answers. On failure the container is torn down but the record stays: the caller
        decides its fate."""
        restoring = None
        try:
            if snap is not None and snap.has_memory and memory:  # begun now: a lazy restore's daemon starts as the root is made
                restoring = lazy_pages.Restore(snap.criu_dir, self._container.bundle, os.environ.get("AGENTENV_CRIU"),
                                               page_server=migration.page_server_of(snap, page_server_key))
            spec = self._spec()
            if not images.layers_present(spec.layers):  # e.g. the engine re-created its storage
                spec.layers = images.resolve(spec.image_id).layers
                self.amend(spec=spec.to_json())
            if spec.uids is None:  # a new family (agentenv.host.userns); snapshots and forks keep their parent's range
                if snap is not None:
                    raise CheckpointError(f"the snapshot {snap.id} was taken before sandboxes ran in user namespaces "
                                        "and cannot be restored into one",
                                        fix="create the sandbox afresh and take a new snapshot")
                spec.uids = userns.allocate(self._container.bundle)
                self.amend(spec=spec.to_json())
            else:
                userns.hold(spec.uids, self._container.bundle)
            fs_from = snap.fs_dir if snap else None
            if self._has_own_layer() and not os.path.lexists(self._container.layer):
                if snap is not None and snap.layer and volume.can_clone(snap.files, self._container.layer):
                    with phase("fs clone"):  # the snapshot's layer, cloned whole: nothing to copy
                        volume.clone_layer(snap.files, self._container.layer, spec.limits.disk)
                    fs_from = None
                else:
                    with phase("layer"):
                        volume.make_layer(self._container.layer, spec.limits.disk)
            self._container.prepare(spec, fs_from=fs_from)
            # the files just copied (reflinks) count against the disk limit (with full quota groups once a commit
            # accounted them: one starts now, and is done before this returns, usually long before)
            txn = volume.account_copy(self._container.layer, spec.limits.disk) if fs_from else None
            if restoring is not None:  # lazily where it pays: the record names the daemon until it is done
                work = self._container.bundle / "criu-restore"
                pid, daemon = restoring.run(
                    lambda images, lazy: self._container.restore(images, work, spec, restoring.criu, lazy=lazy,
                                                                 address=self._rec.address))
                self.amend(lazy_pages=daemon)
            else:
                with phase("runc run"):
                    pid = self._container.start()
            self._container.connect(spec, pid, restored=restoring is not None, address=self._rec.address)
            self.amend(address=(self._container.link() or {}).get("address"))
            crash_point(f"{op}:started")
            self._agent = None
            self.transition("running", init_pid=pid, init_start=proc_start_time(pid), owner=None)
            protect_keeper(pid)
            self._starting = True
            try:
                with phase("keeper answers"):
                    self.wait_started(START_TIMEOUT)
            finally:
                self._starting = False
            if spec.share_memory:
                ksm.check_flag(self.id, pid)
            volume.wait_accounted(self._container.layer, txn)
            self._save()
            if spec.share_memory:
                ksm.sync()
        except BaseException:
            if restoring is not None:
                restoring.cancel()
            self._container.destroy()
            raise

    def wait_started(self, timeout: float) -> None:
        """Wait until the agent, starting, answers a ping (at most ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        with self._channel.connect(wait=timeout, through_gate=False) as s:
            frames.send_frame(s, {"op": "ping"}, deadline=deadline)
            frames.recv_frame(s, 0, deadline)

    @classmethod
    def restore(cls, snapshot: SnapshotLike | str, *, labels: dict[str, str] | None = None,
                page_server_key: bytes | None = None) -> Sandbox:
        """A new sandbox from a snapshot, in any process, after dockerd restarts or the source is gone.
        ``page_server_key``: a post-copy migration's snapshot is restored with its migration's key
        (``agentenv.sandbox.migration``), which the source's page server asks for; no other snapshot takes one."""
        snap = snapshot if isinstance(snapshot, Snapshot) else Snapshot.get(
            snapshot if isinstance(snapshot, str) else snapshot.id)
        migration.page_server_of(snap, page_server_key)  # a missing or stray key refused before anything is made
        return cls._restore(snap, labels, "restore", page_server_key)

    @classmethod
    def _restore(cls, snap: Snapshot, labels: dict[str, str] | None, op: str,
                 page_server_key: bytes | None = None) -> Sandbox:
        spec = ContainerSpec.from_json(snap.spec)
        volume.ensure().require(spec.limits.disk)
        sb = cls._new(spec, image=snap.labels.get("image", spec.image_id), ttl=None, labels=labels, parent=snap.id)
        sb._boot(snap, op, page_server_key)
        return sb

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
        self._reload()
        st = self.recorded_state
        if st == "running" and not self._rec.pausing:
            runc = self._container.state()
            if runc is None or runc.get("status") not in ("running", "paused", "created"):
                return "lost"
        return st

    def ping(self, timeout: float | None = None) -> None:
        """Ask the agent to answer (within ``timeout`` s, else the call's usual deadline); ConnectionLost (or
        another AgentEnvError) when it does not."""
        self._channel.call({"op": "ping"}, timeout=timeout)

    def info(self, state: State | None = None) -> SandboxInfo:
        """What this sandbox is now (``state`` when the caller knows it, saving a runc call)."""
        return SandboxInfo(id=self.id, state=state or self.state, image=self.image,
                           created_at=self.created_at, expires_at=self.expires_at, labels=self.labels,
                           limits=self.limits, network=self.network)

    def update_network(self, allow_out: Sequence[str] = (), deny_out: Sequence[str] = ()) -> Network:
        """Replace the outbound rules of a sandbox made with network, at once if it runs (a paused one gets them
        when it resumes); host names are resolved now. NetworkRuleError (nothing changed) for a rule that
        cannot be enforced."""
        rules = netpolicy.check(allow_out, deny_out, never=(str(hostnet.subnet()),))
        with self._locked():
            spec = self._spec()
            if not spec.network:
                raise SandboxStateError(f"sandbox {self.id} was made without network: it has no rules to change",
                                        fix="create it with network=True (or rules) to give it an outside link")
            if self._rec.state == "running":
                self._container.set_rules(rules)
            spec.rules = rules.to_json()
            self.amend(spec=spec.to_json())
            self._save()
        assert (net := self.network) is not None
        return net

    def set_ttl(self, ttl: float) -> None:
        """Extend (or shorten) the time to live, counted from now."""
        with self._locked():
            self.amend(expires_at=time.time() + ttl)
            self._save()

    # --- snapshots ----------------------------------------------------------------------------

    def snapshot(self, memory: bool = False, *, labels: dict[str, str] | None = None) -> Snapshot:
        """Save the filesystem (and with ``memory=True`` every process) into the snapshot store."""
        with self._locked():
            self.require_running()
            snap = snapshotting.take(self, memory, leave_running=True, labels=labels, op="snapshot")
        shared.publish(snap)  # with a shared store, other servers can restore it (even once this one is gone)
        return snap

    def fork(self, n: int = 1, *, memory: bool = True) -> builtins.list[Sandbox]:
        """``n`` independent sandboxes that continue from this instant; this one keeps running.

        With ``memory=False`` the children get this sandbox's files only (fresh processes): cheaper,
        and all an episode needs when its state lives in files. How: ``agentenv.sandbox.forking``.
        """
        return forking.fork(self, fork_count(n), memory)

    def pause(self, memory: bool = True) -> Snapshot:
        """Free the sandbox's CPU and memory; its whole state goes to the snapshot store (with ``memory=False``
        its files only, as at the instant they were saved: its processes end, and ``resume`` boots it afresh).

        The record names the snapshot being written (``pausing``) until the pause is done, so that if this
        process dies midway, ``recover`` finishes the pause (CRIU had dumped the processes) or rolls it
        back (they still run): the sandbox ends up paused or running, never lost.
        """
        with self._locked():
            return snapshotting.pause(self, memory)

    def _paused(self, snap_id: str) -> None:
        """The end of a pause whose snapshot is in the store: the container and its layer go."""
        self._container.destroy()
        self._drop_layer()
        self.transition("paused", paused_snapshot=snap_id, pausing=None, owner=None, init_pid=None, init_start=None)
        self._agent = None
        self._save()
        self._unshare()

    def resume(self, memory: bool = True) -> None:
        """Bring a paused sandbox back where it was; with ``memory=False`` (or from a files-only pause) boot it
        afresh from its files instead: its processes are gone, the agent starts anew."""
        with self._locked():
            if self._rec.state != "paused":
                raise SandboxStateError(f"sandbox {self.id} is {self._rec.state}, not paused")
            snap = Snapshot.get(self._rec.paused_snapshot or "")
            self._drop_layer()
            try:
                self._start(snap, "resume", memory)
            except BaseException:
                self.transition("paused", init_pid=None, init_start=None)
                self._agent = None
                self._save()
                raise
            self.amend(paused_snapshot=None)
            self._save()
        snap.delete(background=True)

    # --- teardown -----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every process and remove the sandbox (its snapshots stay in the store); idempotent."""
        if not self._container.bundle.exists():
            self.transition("closed")
            return
        with self._locked(allow_closed=True):
            paused = self._rec.paused_snapshot
            self._destroy()
        if paused:
            with contextlib.suppress(Exception):
                Snapshot.get(paused).delete()

    def _destroy(self) -> None:
        self._container.destroy()
        self._agent = None
        self.transition("closed")
        self._drop_layer()  # before the record goes: a close cut short is closed again
        remove_tree(self._container.bundle)  # never through a layer mount a start cut short left there
        self._unshare()

    def _unshare(self) -> None:
        """After a sharing sandbox stopped running: KSM off if it was the host's last (``ksm.sync``)."""
        if self._rec.spec.get("share_memory"):
            ksm.sync()

    def _has_own_layer(self) -> bool:
        """True if the sandbox's layer is its own folder on the volume (not its bundle, as in older sandboxes)."""
        return self._container.layer != self._container.bundle

    def _drop_layer(self) -> None:
        if self._has_own_layer():
            volume.drop_layer(self._container.layer)
            for name in self._rec.retired_layers or []:  # a pooled sandbox's own, before a fork took it
                volume.drop_layer(paths().layers / name)
        else:
            for d in (self._container.upper, self._container.work):
                remove_tree(d)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def expire(self) -> str | None:
        """Pause or close the sandbox if, checked under its lock, it runs past its TTL (``expiry.expire``)."""
        return expiry.expire(self)

    @classmethod
    def reap_expired(cls) -> builtins.list[str]:
        """Pause, or close where its ``agentenv.on_expiry`` label says so, every running sandbox past its TTL;
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

        Cheap (no agent call); it leaves alone a sandbox that a live process holds, or that a runc, CRIU or
        cp of a dead one is still working on (``recover`` waits for those).
        """
        return recovery.thaw_abandoned(self, procs)

    # --- internals ----------------------------------------------------------------------------

    def _root(self) -> Root:
        """The agent's root, for one connection, after checking that the process is the sandbox's agent.

        If the agent this object knew is gone, the record is read again: another handle (or process)
        may have paused, resumed or closed the sandbox. If the record still names the dead agent, the
        sandbox is lost (SandboxLost); a pid number reused by another process is never followed.
        """
        for _attempt in range(3):
            ref = self._agent
            pid = self._rec.init_pid
            if ref is None or ref.pid != pid:
                ref = None
                if self._rec.state == "running" and pid:
                    with contextlib.suppress(OSError):
                        ref = KeeperProcess(pid, self._rec.init_start, self._container.cgroup)
                self._agent = ref
            if ref is not None:
                with contextlib.suppress(OSError):
                    return ref.root()
                self._agent = None
            if self._starting:
                raise SandboxError(f"the keeper of sandbox {self.id} (pid {pid}) exited as it started",
                                   fix=f"check that the image has python3 (docker run --rm {self.image} python3 -V)")
            seen = pid, self._rec.init_start
            self._reload()
            self.require_running()
            if (self._rec.init_pid, self._rec.init_start) == seen:
                break
        raise SandboxLost(f"sandbox {self.id} is lost: its keeper (pid {self._rec.init_pid}) is gone",
                          fix="close it; restore one of its snapshots to go on from there")


warm.bind(Sandbox.create)  # the warm pool starts its sandboxes as ``Sandbox.create`` does
