"""Fork: ``n`` sandboxes that continue from one instant of another, which keeps running (``Sandbox.fork``).

Forking is what the platform is for (GRPO groups from one state, parallel search), so it takes the
cheapest path its children allow:

- Files only (``memory=False``), where the parent's layer is a btrfs subvolume (``volume.can_clone``): the
  parent is frozen just long enough for one snapshot of its layer (``volume.clone_layer``, a few ms whatever
  the layer holds), the other children's layers are snapshots of that one, and each child boots fresh
  processes as soon as its layer is there (the clones wait on the disk, the starts on the CPU: they
  overlap). Nothing goes through the snapshot store and no file is copied, not even once.
- Otherwise (processes too, or a volume without subvolumes): one snapshot in the store, restored ``n``
  times in parallel, then deleted off the caller's path.

Either way nothing half-made outlives a ``kill -9``: the children's records are written first (state
'creating', owned by this process), so ``recover`` removes children whose maker died, thaws a parent left
frozen, and ``store.gc`` deletes the store snapshot of a fork whose process died.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from agentenv import store, volume
from agentenv.config import crash_point, paths
from agentenv.phases import phase

if TYPE_CHECKING:
    from agentenv.sandbox import Sandbox

T = TypeVar("T")


def fork(parent: Sandbox, n: int, memory: bool) -> builtins.list[Sandbox]:
    """``n`` running children of ``parent`` (checked by the caller: 1 <= n <= MAX_FORK); see the module doc."""
    if not memory and volume.can_clone(parent._container.layer, paths().layers):
        return _fork_files(parent, n)
    return _fork_snapshot(parent, n, memory)


def _fork_files(parent: Sandbox, n: int) -> builtins.list[Sandbox]:
    """Children with the parent's files and fresh processes, their layers cloned from the parent's."""
    kids: builtins.list[Sandbox] = []
    try:
        with parent._locked():
            parent.require_running()
            spec = parent._spec()
            lineage = parent._rec.get("parent_snapshot")  # no snapshot of its own: the children descend from the parent's
            kids = [type(parent)._new(spec, image=parent.image, ttl=None, labels=parent.labels, parent=lineage)
                    for _ in range(n)]
            disk = spec.limits.disk
            with phase("freeze+clone"), parent._frozen(quiesce=False):
                volume.clone_layer(parent._container.layer, kids[0]._container.layer, disk)
                crash_point("fork:frozen")
        # the others are clones of the first child's copy (the parent already runs on), each started as soon as
        # its layer is there; the first child starts last, once nothing is cloned from it any more
        # (if a clone fails, leaving the pool waits for the children already starting: then all go)
        with ThreadPoolExecutor(max_workers=n, thread_name_prefix="agentenv-fork") as pool:
            futures = []
            for k in kids[1:]:
                with phase("clone"):
                    volume.clone_layer(kids[0]._container.layer, k._container.layer, disk)
                futures.append(pool.submit(k._start, None, "fork"))
            crash_point("fork:cloned")
            futures.append(pool.submit(kids[0]._start, None, "fork"))
        _raise_first(futures)
        crash_point("fork:children")
        return kids
    except BaseException:
        for k in kids:
            k._destroy()
        raise


def _fork_snapshot(parent: Sandbox, n: int, memory: bool) -> builtins.list[Sandbox]:
    """Children restored from one snapshot of the parent (its processes too with ``memory``)."""
    with parent._locked():
        parent.require_running()
        with phase("snapshot"):  # a fork's snapshot: gc() removes it if this process dies
            snap = parent._snapshot(memory, leave_running=True, labels={"agentenv.kind": store.FORK_KIND},
                                    op="fork", owner=store.owner())
    try:
        made: builtins.list[Sandbox | None] = [None] * n

        def one(i: int) -> None:
            made[i] = type(parent)._restore(snap, parent.labels, "fork")

        try:
            _all(list(range(n)), one)
        except BaseException:
            for k in made:
                if k is not None:
                    k.close()
            raise
        crash_point("fork:children")
        return [k for k in made if k is not None]
    finally:
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
