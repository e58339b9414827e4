"""A warm pool: sandboxes started ahead of time, handed out by ``Sandbox.create`` when one matches.

A start costs tens of milliseconds of CPU (runc, the kernel's namespaces, the keeper coming up). A burst of
creates bigger than the machine's cores queues behind that work (``agentenv.host.admission``) however fast one
start is; a pool moves the work before the burst: a create whose image and limits match a pooled sandbox
gets it at once (its labels and ttl set to the caller's), and the pool refills behind, one start at a time
and only once takes pause (``REFILL_DELAY``), so that the refill takes little from the sandboxes just handed
out. A files-only fork of a sandbox made like the pool's takes its children from the pool too
(``agentenv.sandbox.forking``), where they are of its fork family (one uid range, ``agentenv.host.userns``): the pool's
sandboxes are one family, and so are those it handed out while others of it waited.

Off by default: ``configure(image, size, **limits)`` turns it on for this process (the arguments are those
of ``Sandbox.create``), ``drain()`` closes what it holds. A pooled sandbox is a sandbox like any other,
listed, labelled ``agentenv.kind=warm`` and with a ttl of ``IDLE_TTL`` while it waits, so that the pool of
a process that died (``kill -9``) goes with the next ``Sandbox.reap_expired`` (one that exits normally drains
its pool).
"""

from __future__ import annotations

import atexit
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from agentenv.config import paths
from agentenv.host import userns
from agentenv.host.runtime import ContainerSpec
from agentenv.sandbox.parts import Parts

S = TypeVar("S", bound=Parts)

log = logging.getLogger("agentenv")

KIND = "warm"  # the ``agentenv.kind`` label of a sandbox waiting in the pool
IDLE_TTL = 3600.0  # seconds a pooled sandbox lives unused (the pool of a dead process is reaped after it)
REFILL_DELAY = 0.25  # seconds the pool waits after a take before it refills: a burst or fork is done first

_lock = threading.Condition()
_ready: list[tuple[str, Parts]] = []  # (key, sandbox): the key says what it was started as (``_key``)
_want: dict[str, Any] = {}  # the create arguments of the pool ("image" included); empty: no pool
_size = 0
_filler: threading.Thread | None = None
_registered = False
_last_take = 0.0  # time.monotonic() of the last take
_family: int | None = None  # the uid range of the pool's sandboxes (``family``)
_members: list[str] = []  # the ids of the sandboxes the pool started in it (that may still live)
_create: Callable[..., Parts] | None = None  # how the pool starts one: ``Sandbox.create`` (``bind``)


def bind(create: Callable[..., Parts]) -> None:
    """How the pool starts a sandbox (``agentenv.sandbox.core`` binds ``Sandbox.create`` once, at import): the pool
    never imports the class it fills with."""
    global _create
    _create = create


def configure(image: str, size: int, **create: Any) -> None:
    """Keep ``size`` sandboxes of ``image`` started (``create``: the other arguments of ``Sandbox.create``,
    labels and ttl excepted); a pool of another image or limits is drained first."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"the warm pool's size must be a non-negative integer, got {size!r}")
    global _size, _filler, _registered
    want = {"image": image, **create}
    if want != _want:
        drain()
    with _lock:
        _want.clear()
        _want.update(want if size else {})
        _size = size
        if size and not _registered:
            atexit.register(drain)  # a pool outlives no process that ends normally
            _registered = True
        if size and (_filler is None or not _filler.is_alive()):
            _filler = threading.Thread(target=_fill, name="agentenv-warm-pool", daemon=True)
            _filler.start()
        _lock.notify_all()


def ready() -> int:
    """How many sandboxes wait in the pool now."""
    with _lock:
        return len(_ready)


def waiting() -> list[str]:
    """The ids of the sandboxes waiting in the pool now, in the order ``take`` hands them out."""
    with _lock:
        return [sb.id for _, sb in _ready]


def size() -> int:
    """How many sandboxes the pool keeps started (0: no pool)."""
    with _lock:
        return _size


def wait_full(timeout: float) -> bool:
    """Wait until the pool holds its size; False if it did not within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    with _lock:
        while len(_ready) < _size:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            _lock.wait(left)
    return True


def take(image: str, spec: ContainerSpec, ttl: float | None, labels: dict[str, str] | None, kind: type[S],
         skip: str | None = None) -> S | None:
    """A pooled sandbox of ``image`` started with ``spec``, now the caller's (its labels and ttl set), or
    None when there is none (no pool, another image or limits, or the pool is empty: create one then).
    ``skip``: never the sandbox of this id (a fork's parent, which may itself be waiting here, listed as
    every sandbox is, and whose lock the fork holds). ``kind``: the caller's sandbox class, which the pool's are."""
    if threading.current_thread() is _filler:  # the pool's own creates
        return None
    with _lock:
        key = _key(image, spec)
        at = next((i for i, (k, sb) in enumerate(_ready)
                   if k == key and sb.id != skip and spec.uids in (None, sb.container_spec().uids)), None)
        if at is None:
            return None
        found = _ready.pop(at)[1]
        if not isinstance(found, kind):
            raise TypeError(f"the warm pool holds a {type(found).__name__}, not a {kind.__name__}")
        global _last_take
        _last_take = time.monotonic()
        _lock.notify_all()  # the filler starts a replacement, once takes pause
    with found.locked():
        found.amend(labels=dict(labels or {}), expires_at=time.time() + ttl if ttl else None)
        found.save_record()
    return found


def family() -> int | None:
    """The uid range (``agentenv.host.userns``) of a sandbox the pool starts now: that of the pool's earlier ones, so that
    the pool is one fork family and a files-only fork of a sandbox taken from it takes its children from it too.
    None (a new family) outside the pool's thread, at first, or once nothing holds the range any more (every
    sandbox of the family gone: it may be another family's by now)."""
    global _family
    if threading.current_thread() is not _filler:
        return None
    with _lock:
        _members[:] = [m for m in _members if (paths().sandboxes / m).exists()]
        if _family is not None and not (_members or userns.held(_family)):
            _family = None
        return _family


def _key(image: str, spec: ContainerSpec) -> str:
    """What a pooled sandbox must match: the image and spec, its uid range aside (a create takes any; a fork only
    one of its own family, whose ids its files have: ``take`` checks)."""
    return json.dumps([image, {**spec.to_json(), "uids": None}], sort_keys=True)


def drain() -> None:
    """Stop refilling and close every sandbox waiting in the pool."""
    global _size, _filler, _family
    with _lock:
        _size, _family, _members[:] = 0, None, []
        _want.clear()
        gone, _ready[:] = [sb for _, sb in _ready], []
        filler, _filler = _filler, None
        _lock.notify_all()
    if filler is not None:
        filler.join()
    for sb in gone:
        try:
            sb.close()
        except Exception as e:  # noqa: BLE001 - the rest are closed all the same
            log.warning("could not close the pooled sandbox %s: %s", sb.id, e)


def _fill() -> None:
    """Start sandboxes one at a time while the pool is short of its size (the pool's thread)."""
    global _family
    while True:
        with _lock:
            while _size and (len(_ready) >= _size or (quiet := time.monotonic() - _last_take) < REFILL_DELAY):
                _lock.wait(None if len(_ready) >= _size else REFILL_DELAY - quiet)
            if not _size or threading.current_thread() is not _filler:
                return
            want = dict(_want)
        image = want.pop("image")
        try:
            if _create is None:
                raise RuntimeError("agentenv.sandbox.core was not imported: nothing bound the pool's create")
            sb = _create(image, **want, ttl=IDLE_TTL, labels={"agentenv.kind": KIND})
        except Exception as e:  # noqa: BLE001 - the pool retries; creates without it go on regardless
            log.warning("the warm pool could not start a sandbox of %s: %s", image, e)
            time.sleep(1.0)
            continue
        with _lock:
            keep = bool(_size) and threading.current_thread() is _filler and want == {
                k: v for k, v in _want.items() if k != "image"} and _want.get("image") == image
            if keep:
                _ready.append((_key(image, sb.container_spec()), sb))
                _family = sb.container_spec().uids
                _members.append(sb.id)
                _lock.notify_all()
        if not keep:
            sb.close()
