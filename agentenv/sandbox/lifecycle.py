"""The steps a sandbox's lifecycle is made of, and the parts they work on: ``Sandbox.lifecycle``.

``agentenv.sandbox.core`` composes these steps into what a user calls (``Sandbox.create``, ``restore``, ``pause``,
``resume``, ``close``), and the lifecycle modules (``forking``, ``snapshotting``, ``recovery``, ...) use them through
the ``Lifecycle`` protocol (``agentenv.sandbox.parts``): make a sandbox's record, start it (fresh or from a
snapshot) and wait for its keeper, end a pause, destroy it, and drop its layer. A step takes no lock and checks no
state: its caller holds the sandbox's lock and knows where the sandbox is.

The object also pins the keeper: the record names the keeper by pid *and* start time, and ``root`` checks, before
every connection, that the process it reaches is still that keeper (with a pidfd). A pid number that the kernel has
since given to another sandbox's keeper therefore never leads there: the handle follows the record (another handle
may have paused and resumed the sandbox) or fails with SandboxLost.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Generic, TypeVar

from agentenv.config import PRIVATE_DIR, crash_point, paths
from agentenv.errors import CheckpointError, SandboxError, SandboxLost
from agentenv.host import admission, image_store, images, ksm, userns, volume
from agentenv.host.hostcalls import proc_start_time
from agentenv.host.keeper_process import KeeperProcess, protect_keeper
from agentenv.host.runtime import ContainerSpec
from agentenv.host.trees import remove_tree
from agentenv.inside import frames
from agentenv.phases import phase
from agentenv.sandbox import migration, watchdog
from agentenv.sandbox.channel import Channel, Gate, Root
from agentenv.sandbox.parts import START_TIMEOUT, Parts
from agentenv.sandbox.record import SandboxRecord
from agentenv.snapshot import lazy_pages, store
from agentenv.snapshot.container import Container
from agentenv.snapshot.store import Snapshot

S = TypeVar("S", bound=Parts)  # the sandbox class whose lifecycle it is
_gates: dict[str, Gate] = {}
_gates_lock = threading.Lock()


def gate(sandbox_id: str) -> Gate:
    """One gate per sandbox per process, shared by every Sandbox object of that id."""
    with _gates_lock:
        return _gates.setdefault(sandbox_id, Gate())


def make(kind: type[S], spec: ContainerSpec, image: str, ttl: float | None, labels: dict[str, str] | None,
         parent: str | None, forked_from: str | None = None) -> S:
    """The record of a sandbox being made: state 'creating', owned by this process until it runs (if
    the process dies first, ``recover`` removes what there is of it); ``parent``: the snapshot it comes from,
    ``forked_from``: the sandbox it is a fork of."""
    with contextlib.suppress(OSError):  # the image's last use (agentenv.host.image_store): never fails a start
        image_store.record_use(spec.image_id, [image] if image != spec.image_id else [])
    now = time.time()
    sid = store.new_id("sb")
    sb = kind(SandboxRecord(id=sid, image=image, spec=spec.to_json(), state="creating", created_at=now,
                            expires_at=now + ttl if ttl else None, labels=dict(labels or {}),
                            parent_snapshot=parent, forked_from=forked_from, layer=sid, owner=store.owner()))
    sb.lifecycle.container.bundle.mkdir(mode=PRIVATE_DIR)  # the gate of its range once it holds one (userns)
    sb.save_record()
    return sb


def restore(kind: type[S], snap: Snapshot, labels: dict[str, str] | None, op: str, ttl: float | None,
            page_server_key: bytes | None = None, forked_from: str | None = None) -> S:
    """A new sandbox of ``kind`` from ``snap`` (a fork of the sandbox ``forked_from``, if named), started; on failure
    nothing of it is left."""
    spec = ContainerSpec.from_json(snap.spec)
    volume.ensure().require(spec.limits.disk)
    sb = make(kind, spec, image=snap.labels.get("image", spec.image_id), ttl=ttl, labels=labels, parent=snap.id,
              forked_from=forked_from)
    boot(sb, snap, op, page_server_key)
    return sb


def boot(sb: S, snap: Snapshot | None, op: str, page_server_key: bytes | None = None) -> None:
    """Start a new sandbox, fresh or from a snapshot; on failure nothing of it is left."""
    try:
        sb.lifecycle.start(snap, op, page_server_key=page_server_key)
    except BaseException:
        sb.lifecycle.destroy()
        raise


class SandboxLifecycle(Generic[S]):
    """The ``Lifecycle`` of ``sandbox``: its container, the channel to its keeper, and the steps."""

    def __init__(self, sandbox: S, container: Container) -> None:
        self.sandbox = sandbox
        self.container = container
        self.channel = Channel(self.root, gate(sandbox.id))
        self.keeper: KeeperProcess | None = None  # the pinned keeper, once a call has needed it
        self.starting = False  # in start: the record on disk does not name the new keeper yet

    def new(self, spec: ContainerSpec, image: str, ttl: float | None, labels: dict[str, str] | None,
            parent: str | None, forked_from: str | None = None) -> S:
        """A new sandbox's record (``make``), of this one's class."""
        return make(type(self.sandbox), spec, image, ttl, labels, parent, forked_from)

    def restore(self, snap: Snapshot, labels: dict[str, str] | None, op: str, ttl: float | None,
                forked_from: str | None = None) -> S:
        """A new sandbox of this one's class from ``snap`` (``restore``)."""
        return restore(type(self.sandbox), snap, labels, op, ttl, forked_from=forked_from)

    @admission.admitted  # a burst of starts queues rather than thrashes (agentenv.host.admission)
    def start(self, snap: Snapshot | None, op: str, memory: bool = True, page_server_key: bytes | None = None) -> None:
        """Make the layer and the bundle, start the keeper (or restore every process, unless ``memory`` is False)
        and wait until it answers. On failure the container is torn down but the record stays: the caller
        decides its fate."""
        sb, container = self.sandbox, self.container
        restoring = None
        try:
            if snap is not None and snap.has_memory and memory:  # begun now: a lazy restore's daemon starts as the root is made
                restoring = lazy_pages.Restore(snap.criu_dir, container.bundle, os.environ.get("AGENTENV_CRIU"),
                                               page_server=migration.page_server_of(snap, page_server_key))
            spec = sb.container_spec()
            if spec.share_memory:  # the host's merging is this home's from now, or it is refused
                ksm.claim()
            if not images.layers_present(spec.layers):  # e.g. the engine re-created its storage
                spec.layers = images.resolve(spec.image_id).layers
                sb.amend(spec=spec.to_json())
            if spec.uids is None:  # a new family (agentenv.host.userns); snapshots and forks keep their parent's range
                if snap is not None:
                    raise CheckpointError(f"the snapshot {snap.id} was taken before sandboxes ran in user namespaces "
                                        "and cannot be restored into one",
                                        fix="create the sandbox afresh and take a new snapshot")
                spec.uids = userns.allocate(container.bundle)
                sb.amend(spec=spec.to_json())
            else:
                userns.hold(spec.uids, container.bundle)
            fs_from = snap.fs_dir if snap else None
            if self.has_own_layer() and not os.path.lexists(container.layer):
                if snap is not None and snap.layer and volume.can_clone(snap.files, container.layer):
                    with phase("fs clone"):  # the snapshot's layer, cloned whole: nothing to copy
                        volume.clone_layer(snap.files, container.layer, spec.limits.disk)
                    fs_from = None
                else:
                    with phase("layer"):
                        volume.make_layer(container.layer, spec.limits.disk)
            container.prepare(spec, fs_from=fs_from)
            # the files just copied (reflinks) count against the disk limit (with full quota groups once a commit
            # accounted them: one starts now, and is done before this returns, usually long before)
            txn = volume.account_copy(container.layer, spec.limits.disk) if fs_from else None
            if restoring is not None:  # lazily where it pays: the record names the daemon until it is done
                work = container.bundle / "criu-restore"
                pid, daemon = restoring.run(
                    lambda images, lazy: container.restore(images, work, spec, restoring.criu, lazy=lazy,
                                                           address=sb.record.address))
                sb.amend(lazy_pages=daemon)
            else:
                with phase("runc run"):
                    pid = container.start()
            container.connect(spec, pid, restored=restoring is not None, address=sb.record.address)
            sb.amend(address=(container.link() or {}).get("address"))
            crash_point(f"{op}:started")
            self.keeper = None
            sb.transition("running", init_pid=pid, init_start=proc_start_time(pid), owner=None)
            protect_keeper(pid)
            self.starting = True
            try:
                with phase("keeper answers"):
                    self.wait_started(START_TIMEOUT)
            finally:
                self.starting = False
            if spec.share_memory:
                ksm.check_flag(sb.id, pid)
            volume.wait_accounted(container.layer, txn)
            sb.save_record()
            if sb.expires_at is not None:  # running with a deadline: someone holds it to it (agentenv.sandbox.watchdog)
                watchdog.ensure()
            if spec.share_memory:
                ksm.sync()
        except BaseException:
            if restoring is not None:
                restoring.cancel()
            container.destroy()
            raise

    def wait_started(self, timeout: float) -> None:
        """Wait until the keeper, starting, answers a ping (at most ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        with self.channel.connect(wait=timeout, through_gate=False) as s:
            frames.send_frame(s, {"op": "ping"}, deadline=deadline)
            frames.recv_frame(s, 0, deadline)

    def paused(self, snap_id: str) -> None:
        """The end of a pause whose snapshot is in the store: the container and its layer go."""
        self.container.destroy()
        self.drop_layer()
        self.sandbox.transition("paused", paused_snapshot=snap_id, pausing=None, owner=None, init_pid=None,
                                init_start=None)
        self.keeper = None
        self.sandbox.save_record()
        self.unshare()

    def destroy(self) -> None:
        """Stop every process and remove the sandbox's layer and bundle; its record says closed."""
        self.container.destroy()
        self.keeper = None
        self.sandbox.transition("closed")
        self.drop_layer()  # before the record goes: a close cut short is closed again
        remove_tree(self.container.bundle)  # never through a layer mount a start cut short left there
        self.unshare()

    def unshare(self) -> None:
        """After a sharing sandbox stopped running: KSM off if it was the host's last (``ksm.sync``)."""
        if self.sandbox.record.spec.get("share_memory"):
            ksm.sync()

    def has_own_layer(self) -> bool:
        """True if the sandbox's layer is its own folder on the volume (not its bundle, as in older sandboxes)."""
        return self.container.layer != self.container.bundle

    def drop_layer(self) -> None:
        """Delete the sandbox's layer (and those a pooled sandbox retired), or its bundle's upper and work dirs."""
        if self.has_own_layer():
            volume.drop_layer(self.container.layer)
            for name in self.sandbox.record.retired_layers or []:  # a pooled sandbox's own, before a fork took it
                volume.drop_layer(paths().layers / name)
        else:
            for d in (self.container.upper, self.container.work):
                remove_tree(d)

    def root(self) -> Root:
        """The keeper's root, for one connection, after checking that the process is the sandbox's keeper.

        If the keeper this object knew is gone, the record is read again: another handle (or process)
        may have paused, resumed or closed the sandbox. If the record still names the dead keeper, the
        sandbox is lost (SandboxLost); a pid number reused by another process is never followed.
        """
        sb = self.sandbox
        for _attempt in range(3):
            ref = self.keeper
            pid = sb.record.init_pid
            if ref is None or ref.pid != pid:
                ref = None
                if sb.record.state == "running" and pid:
                    with contextlib.suppress(OSError):
                        ref = KeeperProcess(pid, sb.record.init_start, self.container.cgroup)
                self.keeper = ref
            if ref is not None:
                with contextlib.suppress(OSError):
                    return ref.root()
                self.keeper = None
            if self.starting:
                raise SandboxError(f"the keeper of sandbox {sb.id} (pid {pid}) exited as it started",
                                   fix=f"check that the image has python3 (docker run --rm {sb.image} python3 -V)")
            seen = pid, sb.record.init_start
            sb.reload()
            sb.require_running()
            if (sb.record.init_pid, sb.record.init_start) == seen:
                break
        raise SandboxLost(f"sandbox {sb.id} is lost: its keeper (pid {sb.record.init_pid}) is gone",
                          fix="close it; restore one of its snapshots to go on from there")
