"""Fork: ``count`` sandboxes that continue from one instant of another, which keeps running (``Sandbox.fork``).

Forking is what the platform is for (GRPO groups from one state, parallel search), so it takes the
cheapest path its children allow:

- Files only (``memory=False``), where the parent's layer is a btrfs subvolume (``volume.can_clone``): the
  parent is frozen just long enough for one snapshot of its layer (``volume.clone_layer``, a few ms whatever
  the layer holds), the other children's layers are snapshots of that one, and each child boots fresh
  processes as soon as its layer is there (the clones wait on the disk, the starts on the CPU: they
  overlap). Nothing goes through the snapshot store and no file is copied, not even once.
  Where a warm pool (``agentenv.sandbox.warm``) holds sandboxes started like the parent, a child is one of them:
  its layer cloned the same way and its root swapped under its running keeper (``hostcalls.swap_root``:
  the overlay over the clone moved in, /proc, /dev and /sys moved onto it, ``pivot_root``), so a child
  costs a clone and a few system calls instead of a runc start and an interpreter coming up. Nothing
  untrusted has run in a pooled sandbox, so nothing it could have left there carries over; one that runs
  anything besides its keeper (it is listed like any sandbox: someone may have used it) is booted afresh instead.
- Otherwise (processes too, or a volume without subvolumes): one snapshot in the store, restored ``count``
  times in parallel, then deleted off the caller's path. A paused sandbox forks (memory and all) from its pause
  snapshot the same way, which it keeps; the server's fork route comes here too.

Either way nothing half-made outlives a ``kill -9``: the children's records are written first (state
'creating', owned by this process), so ``recover`` removes children whose maker died, thaws a parent left
frozen, and ``store.gc`` deletes the store snapshot of a fork whose process died.
"""

from __future__ import annotations

import builtins
import logging
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from agentenv.config import crash_point, paths
from agentenv.errors import SandboxError
from agentenv.host import volume
from agentenv.host.keeper_process import KeeperProcess
from agentenv.host.keeper_start import keeper_command, keeper_env
from agentenv.phases import phase
from agentenv.sandbox import snapshotting, warm
from agentenv.sandbox.parts import START_TIMEOUT, Parts
from agentenv.snapshot import store

if TYPE_CHECKING:
    from agentenv.host.runtime import ContainerSpec

T = TypeVar("T")
S = TypeVar("S", bound=Parts)  # the sandbox class: its children are of it
log = logging.getLogger("agentenv")


def fork(parent: S, count: int, memory: bool, ttl: float | None) -> builtins.list[S]:
    """``count`` running children of ``parent`` (a count ``api.fork_count`` passed); see the module doc."""
    if not memory and volume.can_clone(parent.lifecycle.container.layer, paths().layers):
        return _fork_files(parent, count, ttl)
    return _fork_snapshot(parent, count, memory, ttl)


def _fork_files(parent: S, count: int, ttl: float | None) -> builtins.list[S]:
    """Children with the parent's files and fresh processes, their layers cloned from the parent's."""
    kids: builtins.list[S] = []
    try:
        with parent.locked():
            parent.require_running()
            spec = parent.container_spec()
            lineage = parent.parent_snapshot  # no snapshot of its own: the children descend from the parent's
            for _ in range(count):
                kids.append(_from_pool(parent, spec, lineage, ttl)
                            or parent.lifecycle.new(spec, image=parent.image, ttl=ttl, labels=parent.labels, parent=lineage,
                                                   forked_from=parent.id))
            disk = spec.limits.disk
            with phase("freeze+clone"), snapshotting.frozen(parent, quiesce=False):
                volume.clone_layer(parent.lifecycle.container.layer, kids[0].lifecycle.container.layer, disk)
                crash_point("fork:frozen")
        # the others are clones of the first child's copy (the parent already runs on), each started as soon as
        # its layer is there; the first child starts last, once nothing is cloned from it any more
        # (if a clone fails, leaving the pool waits for the children already starting: then all go)
        with ThreadPoolExecutor(max_workers=count, thread_name_prefix="agentenv-fork") as pool:
            futures = []
            for k in kids[1:]:
                with phase("clone"):
                    volume.clone_layer(kids[0].lifecycle.container.layer, k.lifecycle.container.layer, disk)
                futures.append(pool.submit(_boot_child, k))
            crash_point("fork:cloned")
            futures.append(pool.submit(_boot_child, kids[0]))
        _raise_first(futures)
        crash_point("fork:children")
        return kids
    except BaseException:
        for k in kids:
            k.lifecycle.destroy()
        raise


def _from_pool(parent: S, spec: ContainerSpec, lineage: str | None, ttl: float | None) -> S | None:
    """A started sandbox from the warm pool (``agentenv.sandbox.warm``) made like ``parent`` (never ``parent`` itself, which
    may be waiting there too), now a child being made (state 'creating', owned by this process) whose layer is a
    new one, its own retired; None if there is none."""
    sb = warm.take(parent.image, spec, ttl=ttl, labels=parent.labels, kind=type(parent), skip=parent.id)
    if sb is None:
        return None
    with sb.locked():
        retired, layer = sb.record.layer, f"{sb.id}.{uuid.uuid4().hex[:6]}"
        assert retired is not None  # the pool's sandboxes are new: each has a layer of its own
        sb.transition("creating", owner=store.owner(), parent_snapshot=lineage, forked_from=parent.id, layer=layer,
                      retired_layers=[retired])
        sb.save_record()
    sb.lifecycle.container.layer = paths().layers / layer
    return sb


def _boot_child(kid: S) -> None:
    """Start a child whose layer is there: boot it, or, for one from the pool, give its processes the files."""
    if not kid.record.retired_layers:
        kid.lifecycle.start(None, "fork")
        return
    spec, container = kid.container_spec(), kid.lifecycle.container
    try:
        with phase("swap root"):
            try:
                # its keeper pinned as for every call: the pid in a record may name another sandbox's process by now
                init = KeeperProcess(kid.record.init_pid or 0, kid.record.init_start, container.cgroup)
                if container.pids() != [init.pid]:  # listed like any sandbox, it may have been used meanwhile
                    raise SandboxError("the pooled sandbox runs processes besides its keeper")
                container.take_root(spec, init)
            except (OSError, SandboxError) as e:  # e.g. a mount point the parent made a symlink: boot it instead
                log.warning("fork: could not give the pooled sandbox %s its files (%s); starting it afresh", kid.id, e)
                container.destroy()
                volume.reset_work(container.layer)  # the overlay mounted for the swap used it
                _retire(kid)
                kid.lifecycle.start(None, "fork")
                return
        crash_point("fork:started")
        kid.transition("running")  # on disk still 'creating' (removed if this process dies) until saved below
        kid.lifecycle.starting = True
        try:
            # the keeper starts again from the new root: nothing of the old one stays in use (CRIU could not
            # dump a process that maps files of a root that is no longer mounted)
            name, _, code = keeper_env().partition("=")
            kid.lifecycle.channel.last_word({"op": "reroot", "cwd": spec.workdir or "/", "argv": keeper_command(),
                                             "env": {name: code}}, START_TIMEOUT)
            with phase("keeper answers"):
                kid.lifecycle.wait_started(START_TIMEOUT)
        finally:
            kid.lifecycle.starting = False
        _retire(kid)
        kid.amend(owner=None)
        kid.save_record()
    except BaseException:
        kid.transition("creating")
        raise


def _retire(kid: S) -> None:
    """Delete the layers a pooled child no longer runs on (its record keeps their names until it is saved)."""
    retired = kid.record.retired_layers or []
    kid.amend(retired_layers=None)
    for name in retired:
        volume.drop_layer(paths().layers / name)


def _fork_snapshot(parent: S, count: int, memory: bool, ttl: float | None) -> builtins.list[S]:
    """Children restored in parallel from one snapshot of the parent (its processes too with ``memory``); those of
    a paused parent, memory and all, from its pause snapshot, which it keeps."""
    with parent.locked():
        kept = parent.paused_snapshot if memory and parent.recorded_state == "paused" else None
        if kept:
            snap = store.Snapshot.get(kept)
        else:
            parent.require_running()
            with phase("snapshot"):  # a fork's snapshot: gc() removes it if this process dies
                snap = snapshotting.take(parent, memory, leave_running=True,
                                         labels={"agentenv.kind": store.FORK_KIND}, op="fork", owner=store.owner())
    try:
        made: builtins.list[S | None] = [None] * count

        def one(i: int) -> None:
            made[i] = parent.lifecycle.restore(snap, parent.labels, "fork", ttl, forked_from=parent.id)

        try:
            _all(list(range(count)), one)
        except BaseException:
            for k in made:
                if k is not None:
                    k.close()
            raise
        crash_point("fork:children")
        return [k for k in made if k is not None]
    finally:
        if not kept:
            snap.delete(background=True)


def _all(items: builtins.list[T], fn: Callable[[T], object]) -> None:
    """``fn`` on every item, in parallel threads (inline for one); the first error is raised once all are done."""
    if len(items) == 1:
        fn(items[0])
        return
    with ThreadPoolExecutor(max_workers=len(items), thread_name_prefix="agentenv-fork") as pool:
        futures = [pool.submit(fn, it) for it in items]
    _raise_first(futures)


def _raise_first(futures: builtins.list[Future[Any]]) -> None:
    """Raise the first error of these (finished) futures, if any."""
    errors = [e for f in futures if (e := f.exception()) is not None]
    if errors:
        raise errors[0]
