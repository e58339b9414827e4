"""Pulling a snapshot from another server (``POST /v1/snapshots/import`` runs this on the receiving one).

The manifest and then each chunk missing here are asked of the sender with its token; each chunk is checked
against the manifest's sha256 before it is kept (``agentenv.snapshot.transfer.receive``). A dropped
connection is retried ``retries`` times per request; past that the import fails and the next one resumes from
the chunks already in. Once the snapshot is in the store the sender is told to drop its packed archive.
"""

from __future__ import annotations

import contextlib
from typing import Any

import httpx

from agentenv.errors import AgentEnvError, TransferError
from agentenv.remote.client import Client
from agentenv.snapshot import transfer
from agentenv.snapshot.store import Snapshot

PACK_TIMEOUT = 600.0  # seconds the sender may take to pack a large snapshot before it answers the manifest


def pull(source: str, token: str, snapshot_id: str, *, chunk: int = transfer.CHUNK, retries: int = 3,
         keep_export: bool = False, resumable: bool = True) -> tuple[Snapshot, dict[str, int]]:
    """Import ``snapshot_id`` from the server at ``source``; returns it and the transfer's counts. With
    ``keep_export`` the sender keeps its packed archive (others pull it too; deleting the snapshot drops it);
    ``resumable=False`` keeps no part file (nothing stays after a failure, and nothing is written twice)."""
    transfer.check_chunk(chunk)
    try:
        client = Client(source, token, retries=retries)
    except httpx.InvalidURL as e:
        raise ValueError(f"the source {source!r} is not a server url ({e}); give one like http://10.0.0.2:8700") from e
    with client as c:
        path = f"/v1/snapshots/{snapshot_id}/export"
        manifest = c.request("GET", path, params={"chunk": chunk}, idempotent=True, timeout=PACK_TIMEOUT)

        def fetch(i: int) -> bytes:
            data: Any = c.request("GET", f"{path}/{i}", params={"chunk": chunk}, idempotent=True)
            if not isinstance(data, bytes):
                raise TransferError(f"chunk {i} of {snapshot_id} came back as {type(data).__name__}, not bytes")
            return data

        snap, counts = transfer.receive(manifest, fetch, origin=c.url, resumable=resumable)
        if not keep_export:
            with contextlib.suppress(AgentEnvError):
                c.request("DELETE", path, idempotent=True)
    return snap, counts
