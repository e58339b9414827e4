"""A sandbox's record: ``<home>/sandboxes/<id>/sandbox.json``, what every process knows of a sandbox (its spec,
state, agent, labels, ttl, address), written whole by rename and changed under a file lock that spans processes.

``Sandbox`` is a ``Record`` with a lifecycle (``agentenv.sandbox.core``): this module is the fields it reads, the save
and reload, the check that it runs, the lock, and the states a record goes through (``TRANSITIONS``: every change of
state goes through ``Record.transition``, which refuses one the table does not list).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

from agentenv import netpolicy
from agentenv.api import Limits, Network, State
from agentenv.config import write_private
from agentenv.errors import SandboxNotFound, SandboxStateError
from agentenv.host.runtime import Container, ContainerSpec

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


def check_transition(sandbox_id: str, old: State, new: State) -> None:
    """SandboxStateError unless a record in state ``old`` may go to ``new`` (``TRANSITIONS``)."""
    if new != old and new not in TRANSITIONS[old]:
        raise SandboxStateError(f"sandbox {sandbox_id} cannot go from {old} to {new}",
                                fix="this is a bug in agentenv's lifecycle code: report it with the sandbox's log")


class Record:
    """The record of sandbox ``id`` (``_rec``), kept in its bundle (``_container.bundle``)."""

    id: str
    _rec: dict[str, Any]
    _container: Container

    def made_here(self) -> bool:
        """True if this process is making the sandbox (its record is in state 'creating' on its behalf)."""
        who = self._rec.get("owner")
        return isinstance(who, list) and bool(who) and who[0] == os.getpid()

    @property
    def recorded_state(self) -> State:
        """The state in the sandbox's record, without asking runc whether its processes still live."""
        return self._rec["state"]

    def settled_state(self) -> State:
        """The recorded state once a change under way is done (a pause, resume, snapshot or fork holds the lock
        meanwhile, and a sandbox being paused still reads 'running'): what a caller acting on the state reads."""
        with self._locked(allow_closed=True):
            return self._rec["state"]

    def transition(self, new: State, **fields: Any) -> None:
        """Move the record (in memory: ``_save`` writes it) to state ``new``, checked against ``TRANSITIONS``, with
        ``fields`` changed alongside; the lifecycle modules change a sandbox's state only through this."""
        check_transition(self.id, self._rec["state"], new)
        self._rec.update(fields, state=new)

    def exists(self) -> bool:
        """True while the sandbox is on this host (running or paused); False once closed."""
        return self._container.bundle.exists()

    @property
    def image(self) -> str:
        return str(self._rec["image"])

    @property
    def created_at(self) -> float:
        return float(self._rec["created_at"])

    @property
    def labels(self) -> dict[str, str]:
        return dict(self._rec["labels"])

    @property
    def paused_snapshot(self) -> str | None:
        """The snapshot a paused sandbox is kept in (None unless paused)."""
        return self._rec.get("paused_snapshot")

    @property
    def parent_snapshot(self) -> str | None:
        """The snapshot this sandbox was restored or forked from (None for one created from an image); it may
        have been deleted since (a fork's own snapshot is)."""
        return self._rec.get("parent_snapshot")

    @property
    def expires_at(self) -> float | None:
        return self._rec.get("expires_at")

    @property
    def limits(self) -> Limits:
        return self._spec().limits

    @property
    def network(self) -> Network | None:
        """The sandbox's address and outbound rules; None when it has loopback only."""
        spec = self._spec()
        if not spec.network:
            return None
        rules = netpolicy.Rules.from_json(spec.rules)
        return Network(rules.allow_out, rules.deny_out, self._rec.get("address"), rules.resolved)

    def _spec(self) -> ContainerSpec:
        return ContainerSpec.from_json(self._rec["spec"])

    def _reload(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._rec = json.loads((self._container.bundle / "sandbox.json").read_text())
            return
        self.transition("closed")  # its bundle is gone: another process closed it

    def require_running(self) -> None:
        """SandboxStateError unless the sandbox is running (e.g. paused or closed)."""
        if self._rec["state"] != "running":
            self._reload()
        if self._rec["state"] != "running":
            raise SandboxStateError(f"sandbox {self.id} is {self._rec['state']}",
                                    fix="resume() a paused sandbox; a closed one is gone")

    def _save(self) -> None:
        write_private(self._container.bundle / "sandbox.json", json.dumps(self._rec))  # its env holds secrets

    @contextlib.contextmanager
    def _locked(self, allow_closed: bool = False, wait: float | None = None) -> Iterator[None]:
        """An exclusive lock across processes for state changes; raises if the sandbox is gone, and
        TimeoutError if another holder keeps it past ``wait`` seconds (None: wait as long as it takes)."""
        try:
            fd = os.open(self._container.bundle / "lock", os.O_CREAT | os.O_RDWR, 0o600)
        except FileNotFoundError:
            raise SandboxNotFound(f"no sandbox {self.id!r} (closed?)") from None
        try:
            _flock(fd, wait)
            self._reload()
            if self._rec["state"] == "closed" and not allow_closed:
                raise SandboxStateError(f"sandbox {self.id} is closed")
            if self._rec["state"] == "running" and self._container.frozen():
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
