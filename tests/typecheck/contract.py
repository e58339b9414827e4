"""Checked by mypy, never run: the local API, a server's client and a Pool all satisfy the contract.

``scripts/test.sh`` type-checks this file with the packages; ``tests/unit/test_contract.py`` also shows
that mypy rejects an implementation that misses a method, so the check can fail.
"""

from __future__ import annotations

import agentenv
from agentenv.api import Backend, ProcessLike, SandboxLike, SnapshotLike
from agentenv.remote.client import Client, RemoteProcess, RemoteSandbox, RemoteSnapshot
from agentenv.remote.pool import Pool
from agentenv.sandbox.core import Process, Sandbox
from agentenv.snapshot.store import Snapshot


def local_backend() -> Backend:
    return agentenv


def client_backend(c: Client) -> Backend:
    return c


def pool_backend(p: Pool) -> Backend:
    return p


def sandboxes(local: Sandbox, remote: RemoteSandbox) -> list[SandboxLike]:
    return [local, remote]


def snapshots(local: Snapshot, remote: RemoteSnapshot) -> list[SnapshotLike]:
    return [local, remote]


def processes(local: Process, remote: RemoteProcess) -> list[ProcessLike]:
    return [local, remote]
