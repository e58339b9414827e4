"""A sandbox's record: ``<home>/sandboxes/<id>/sandbox.json``, what every process knows of a sandbox (its spec,
state, keeper, labels, ttl, address), written whole by rename and changed under a file lock that spans processes.

``Sandbox`` is a ``Record`` with a lifecycle (``agentenv.sandbox.core``): this module is the record's fields
(``SandboxRecord``, typed and frozen) and their form on disk, the save and reload, the check that it runs, the lock,
and the states a record goes through (``TRANSITIONS``: every change of state goes through ``Record.transition``,
which refuses one the table does not list; other fields change through ``Record.amend``).

On disk a record is one JSON object: ``{"version": 3, <every field>}``. A record without ``"version"`` is the form
an agentenv before version 2 wrote (version 1: the same keys, each present only once set); version 2 is version 3
without ``forked_from`` (``ADDED``: the fields each version brought). An older record is read as what it is (a
field its version did not have takes its default: ``forked_from=None``, its lineage unknown), and written back in
the current form at its next save. A record of a later version, with a key that is no field (or a field its version
did not have), or a field of the wrong type is refused (``RecordError``, naming what): it is never read as something
it is not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import time
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from agentenv import netpolicy
from agentenv.api import Limits, Network, State
from agentenv.config import write_private
from agentenv.errors import SandboxError, SandboxNotFound, SandboxStateError
from agentenv.host.runtime import ContainerSpec
from agentenv.snapshot.container import Container

log = logging.getLogger("agentenv")

# The states a sandbox's record goes through and the changes allowed; staying in a state is always allowed. 'lost' is
# never recorded: it is what ``state`` and ``recover`` report of a sandbox whose processes are gone.
TRANSITIONS: Mapping[State, frozenset[State]] = MappingProxyType({
    "creating": frozenset({"running", "closed"}),  # started; its making failed, or its maker died (recover)
    # paused (or a resume cut short, back to paused); closed; a pooled sandbox taken to become a fork's child, or
    # such a child whose start failed, is 'creating' again
    "running": frozenset({"paused", "closed", "creating"}),
    "paused": frozenset({"running", "closed"}),  # resumed; closed
    "closed": frozenset(),
    "lost": frozenset(),
})
RECORD_VERSION = 3  # the form ``SandboxRecord.to_json`` writes; 1: the unversioned form before version 2
ADDED: Mapping[str, int] = MappingProxyType({"forked_from": 3})  # the fields later versions brought, and which


class RecordError(SandboxError):
    """A sandbox record this agentenv cannot read as one: of a later version, or with unknown or ill-typed fields."""


@dataclass(frozen=True, kw_only=True)
class SandboxRecord:
    """What ``sandbox.json`` holds, one typed field a key; frozen: a ``Record`` changes it by replacing it."""

    id: str  # the sandbox's id (``sb-...``), also the name of its bundle's folder
    image: str  # the image it was created from, as the caller named it (or the image's id)
    spec: dict[str, Any]  # its ContainerSpec as ``ContainerSpec.to_json`` writes it (``container_spec`` reads it)
    state: State  # where it is in TRANSITIONS ('lost' is never recorded); changed by ``Record.transition`` only
    created_at: float  # when the record was made (``time.time()``)
    expires_at: float | None = None  # when its TTL ends (``time.time()`` scale); None: it has none
    labels: dict[str, str] = field(default_factory=dict)  # the caller's labels (``agentenv.on_expiry`` among them)
    init_pid: int | None = None  # the pid of its keeper (PID 1) while it runs
    init_start: int | None = None  # that process's start time (``proc_start_time``): a reused pid is never followed
    owner: list[int] | None = None  # [pid, start time] of the process making or pausing it (``store.owner``)
    pausing: str | None = None  # the snapshot a pause under way writes: ``recover`` finishes or rolls it back
    paused_snapshot: str | None = None  # the snapshot a paused sandbox is kept in
    parent_snapshot: str | None = None  # the snapshot it was restored or forked from (None: made from an image)
    forked_from: str | None = None  # the sandbox it is a fork of (None: created, restored, or read from before v3)
    layer: str | None = None  # its layer's folder under ``paths().layers``; None in records older than the volume
    retired_layers: list[str] | None = None  # a pooled sandbox's layers before a fork took it, dropped once it runs
    lazy_pages: list[int] | None = None  # [pid, start time] of the lazy-pages daemon bringing its memory in
    address: str | None = None  # its address on the sandboxes' network; None: loopback only

    @classmethod
    def leftover(cls, sandbox_id: str) -> SandboxRecord:
        """The record of a sandbox folder whose own never got written: closed, with its layer of its name (so that
        ``lifecycle.destroy`` removes whatever there is of it)."""
        return cls(id=sandbox_id, image="", spec={}, state="closed", created_at=0.0, layer=sandbox_id)

    def to_json(self) -> dict[str, Any]:
        """The current on-disk form: ``{"version": RECORD_VERSION, <every field>}``."""
        return {"version": RECORD_VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, data: Any, where: str = "") -> SandboxRecord:
        """The record in ``data`` (any version up to ``RECORD_VERSION``: the module doc); RecordError, naming what
        and ``where`` it was read from, for one of a later version, with unknown, missing or ill-typed fields."""
        def refuse(what: str, fix: str = "the file was not written by this agentenv: close the sandbox with the "
                                         "agentenv that made it, or remove its folder") -> RecordError:
            return RecordError(f"sandbox record {where or '(unnamed)'}: {what}", fix=fix)

        if not isinstance(data, dict):
            raise refuse(f"not a JSON object but {type(data).__name__}")
        version = data.get("version", 1)  # unversioned: the form before version 2
        if type(version) is not int or version < 1:
            raise refuse(f"version {version!r} is no record version")
        if version > RECORD_VERSION:
            raise refuse(f"version {version} is of a later agentenv (this one reads versions up to {RECORD_VERSION})",
                         fix="use the agentenv that wrote it (or a later one) on this home")
        values = {k: v for k, v in data.items() if k != "version"}  # version 1's keys are the fields: no renames
        if unknown := sorted(k for k in values if k not in _HINTS or ADDED.get(k, 1) > version):
            raise refuse(f"unknown field(s) {', '.join(unknown)} (a version {version} record has none such)")
        if missing := [f.name for f in dataclasses.fields(cls) if f.name not in values and _required(f)]:
            raise refuse(f"missing field(s) {', '.join(missing)}")
        if wrong := [f"{k}={v!r}" for k, v in values.items() if not _fits(v, _HINTS[k])]:
            raise refuse(f"ill-typed field(s) {', '.join(wrong)}")
        if values["state"] == "lost":
            raise refuse("state 'lost' is never recorded")
        return cls(**values)


def _required(f: dataclasses.Field[Any]) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _fits(value: Any, hint: Any) -> bool:
    """Whether a JSON value is of a field's type (containers checked as such: their items are not)."""
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        return any(_fits(value, arg) for arg in get_args(hint))
    if origin is Literal:
        return value in get_args(hint)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if isinstance(value, bool):  # JSON's true/false are no numbers here
        return hint is bool
    if hint is float:
        return isinstance(value, int | float)
    return isinstance(value, origin or hint)


_HINTS: Mapping[str, Any] = MappingProxyType(get_type_hints(SandboxRecord))
_FIXED = frozenset({"id", "state"})  # never amended: a record keeps its id, and its state changes by ``transition``


def load(path: Path) -> SandboxRecord:
    """The record in the file ``path`` (FileNotFoundError, json.JSONDecodeError as reading it raises them)."""
    return SandboxRecord.from_json(json.loads(path.read_text()), str(path))


def save(path: Path, rec: SandboxRecord) -> None:
    """Write ``rec`` to ``path`` whole, in the current form, 0600 (its env holds secrets)."""
    write_private(path, json.dumps(rec.to_json()))


def listed(folder: Path) -> Iterator[SandboxRecord]:
    """The records of the sandboxes in ``folder`` (``paths().sandboxes``); one gone or half-removed meanwhile is
    passed over, and so, with a warning, is one this agentenv cannot read (``RecordError``)."""
    for d in folder.iterdir():
        try:
            rec = load(d / "sandbox.json")
        except (FileNotFoundError, json.JSONDecodeError):
            continue
        except RecordError as e:
            log.warning("passing over sandbox %s: %s", d.name, e)
            continue
        yield rec


def check_transition(sandbox_id: str, old: State, new: State) -> None:
    """SandboxStateError unless a record in state ``old`` may go to ``new`` (``TRANSITIONS``)."""
    if new != old and new not in TRANSITIONS[old]:
        raise SandboxStateError(f"sandbox {sandbox_id} cannot go from {old} to {new}",
                                fix="this is a bug in agentenv's lifecycle code: report it with the sandbox's log")


def _check_fields(fields: Mapping[str, Any]) -> None:
    """TypeError for a change of a field the record does not have, or of its id or state (``_FIXED``)."""
    if unknown := sorted(set(fields) - _HINTS.keys()):
        raise TypeError(f"a sandbox record has no field(s) {', '.join(unknown)}")
    if fixed := sorted(set(fields) & _FIXED):
        raise TypeError(f"cannot change {', '.join(fixed)} of a sandbox record: its id is fixed, and its state "
                        "changes by transition(new) alone")


class Record:
    """The record of sandbox ``id`` (``_rec``, read through ``record``), kept in its bundle (``_container.bundle``)."""

    id: str
    _rec: SandboxRecord
    _container: Container

    @property
    def record(self) -> SandboxRecord:
        """The record as this handle last read or changed it (frozen: it changes by ``transition`` and ``amend``)."""
        return self._rec

    def made_here(self) -> bool:
        """True if this process is making the sandbox (its record is in state 'creating' on its behalf)."""
        who = self._rec.owner or []
        return bool(who) and who[0] == os.getpid()

    @property
    def recorded_state(self) -> State:
        """The state in the sandbox's record, without asking runc whether its processes still live."""
        return self._rec.state

    def settled_state(self) -> State:
        """The recorded state once a change under way is done (a pause, resume, snapshot or fork holds the lock
        meanwhile, and a sandbox being paused still reads 'running'): what a caller acting on the state reads."""
        with self.locked(allow_closed=True):
            return self._rec.state

    def transition(self, new: State, **fields: Any) -> None:
        """Move the record (in memory: ``save_record`` writes it) to state ``new``, checked against ``TRANSITIONS``,
        with ``fields`` changed alongside; the lifecycle modules change a sandbox's state only through this."""
        _check_fields(fields)
        check_transition(self.id, self._rec.state, new)
        self._rec = dataclasses.replace(self._rec, **fields, state=new)

    def amend(self, **fields: Any) -> None:
        """Change ``fields`` of the record (in memory: ``save_record`` writes it); TypeError for a field it does not
        have, or for its id or state (``transition`` changes that)."""
        _check_fields(fields)
        self._rec = dataclasses.replace(self._rec, **fields)

    def exists(self) -> bool:
        """True while the sandbox is on this host (running or paused); False once closed."""
        return self._container.bundle.exists()

    @property
    def image(self) -> str:
        return self._rec.image

    @property
    def created_at(self) -> float:
        return float(self._rec.created_at)

    @property
    def labels(self) -> dict[str, str]:
        return dict(self._rec.labels)

    @property
    def paused_snapshot(self) -> str | None:
        """The snapshot a paused sandbox is kept in (None unless paused)."""
        return self._rec.paused_snapshot

    @property
    def parent_snapshot(self) -> str | None:
        """The snapshot this sandbox was restored or forked from (None for one created from an image); it may
        have been deleted since (a fork's own snapshot is)."""
        return self._rec.parent_snapshot

    @property
    def forked_from(self) -> str | None:
        """The sandbox this one is a fork of (None for one created or restored, or recorded before version 3); it
        may have been closed since."""
        return self._rec.forked_from

    @property
    def expires_at(self) -> float | None:
        return self._rec.expires_at

    @property
    def limits(self) -> Limits:
        return self.container_spec().limits

    @property
    def network(self) -> Network | None:
        """The sandbox's address and outbound rules; None when it has loopback only."""
        spec = self.container_spec()
        if not spec.network:
            return None
        rules = netpolicy.Rules.from_json(spec.rules)
        return Network(rules.allow_out, rules.deny_out, self._rec.address, rules.resolved)

    def container_spec(self) -> ContainerSpec:
        """The sandbox's ``ContainerSpec`` (limits, image layers, uid range), read afresh from the record."""
        return ContainerSpec.from_json(self._rec.spec)

    def reload(self) -> None:
        """Read the record again from disk (another handle or process may have changed it); closed if it is gone."""
        with contextlib.suppress(FileNotFoundError):
            self._rec = load(self._container.bundle / "sandbox.json")
            return
        self.transition("closed")  # its bundle is gone: another process closed it

    def require_running(self) -> None:
        """SandboxStateError unless the sandbox is running (e.g. paused or closed)."""
        if self._rec.state != "running":
            self.reload()
        if self._rec.state != "running":
            raise SandboxStateError(f"sandbox {self.id} is {self._rec.state}",
                                    fix="resume() a paused sandbox; a closed one is gone")

    def save_record(self) -> None:
        """Write the record (as ``transition`` and ``amend`` left it) to disk, whole; under ``locked``."""
        save(self._container.bundle / "sandbox.json", self._rec)

    @contextlib.contextmanager
    def locked(self, allow_closed: bool = False, wait: float | None = None) -> Iterator[None]:
        """An exclusive lock across processes for state changes; raises if the sandbox is gone, and
        TimeoutError if another holder keeps it past ``wait`` seconds (None: wait as long as it takes)."""
        try:
            fd = os.open(self._container.bundle / "lock", os.O_CREAT | os.O_RDWR, 0o600)
        except FileNotFoundError:
            raise SandboxNotFound(f"no sandbox {self.id!r} (closed?)") from None
        try:
            _flock(fd, wait)
            self.reload()
            if self._rec.state == "closed" and not allow_closed:
                raise SandboxStateError(f"sandbox {self.id} is closed")
            if self._rec.state == "running" and self._container.frozen():
                self._container.freeze(False)  # a snapshotter died holding it frozen; the lock is ours now
            yield
        finally:
            os.close(fd)


def _flock(fd: int, wait: float | None) -> None:
    if wait is None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise TimeoutError("the sandbox is held by another process") from None
            time.sleep(0.02)
