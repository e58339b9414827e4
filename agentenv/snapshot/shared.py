"""A snapshot store that outlives a node (``agentenv serve --shared-store DIR``, DIR on storage every server sees).

Every pause and snapshot the server takes is also published in DIR as the transfer archive
(``agentenv.snapshot.transfer``: the same ``archive``, ``parts.json`` and ``manifest-<chunk>.json``) plus its
``info.json``, built in this host's hidden ``DIR/.staging-<host>/`` and renamed to ``DIR/<id>``: a reader never
sees half of one. A server
asked for a snapshot its own store lacks imports it from there with ``transfer.receive`` (the manifest's seal,
with the key the servers share, and every chunk's sha256 checked: a writer of DIR without the key makes nothing a
server imports), so a sandbox paused on a server that is gone since resumes on another.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from agentenv.config import paths
from agentenv.errors import SandboxError, SnapshotNotFound, TransferError
from agentenv.snapshot import store, transfer, trust
from agentenv.snapshot.store import FORK_KIND, Snapshot


def configure(folder: str | Path | None) -> Path | None:
    """Publish to and import from ``folder`` from now on (None: no shared store); refused unless it is a
    writable directory outside this server's home (a home is lost with its node)."""
    if folder is None:
        store.set_shared_root(None)
        return None
    root = Path(folder).resolve()
    if not root.is_dir():
        raise ValueError(f"--shared-store {folder}: not a directory; create it first, on storage every server "
                         "sees (e.g. an NFS mount)")
    if not os.access(root, os.W_OK | os.X_OK):
        raise ValueError(f"--shared-store {folder}: this server cannot write there; give it write access")
    home = paths().home.resolve()
    if root == home or root.is_relative_to(home) or home.is_relative_to(root):
        raise ValueError(f"--shared-store {folder} overlaps this server's home {home}, which is lost with the node; "
                         "give a folder outside it")
    store.set_shared_root(root)
    _collect()
    return root


def _collect() -> None:
    """Remove what this host's dead processes left half-published or half-deleted in its staging folder."""
    for d in store.shared_staging().iterdir():
        pid = d.name.rpartition("-")[2]
        if not (pid.isdigit() and store.pid_alive(int(pid))):
            store.remove([d])


def _checked_id(snapshot_id: str) -> str:
    if not transfer.SNAPSHOT_ID.match(snapshot_id):
        raise ValueError(f"{snapshot_id!r} is not a snapshot id (letters, digits, '.', '_', '-', at most 128, "
                         "not starting with '.' or '-'); pass the id a snapshot or pause returned")
    return snapshot_id


def publish(snap: Snapshot) -> None:
    """Copy ``snap`` into the shared store (if there is one): packed in a hidden folder, renamed into place."""
    root = store.shared_root()
    if root is None or snap.labels.get("agentenv.kind") == FORK_KIND:
        return
    dest = root / _checked_id(snap.id)
    if dest.exists():
        return
    tmp = store.shared_staging() / f"{snap.id}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        transfer.pack(snap, tmp)
        manifest = trust.seal(transfer.manifest_of(tmp, snap.id, transfer.CHUNK))  # what a reader believes
        (tmp / f"manifest-{transfer.CHUNK}.json").write_text(json.dumps(manifest))
        (tmp / "info.json").write_text(json.dumps(snap.info().to_wire()))
        os.chmod(tmp, 0o700)  # the sandbox's files and memory: for the servers (root) only
        os.rename(tmp, dest)
    except OSError as e:
        raise SandboxError(f"snapshot {snap.id} is in this server's store but could not be published to the shared "
                           f"store {root} ({e})", fix="free space there or check its mount; the next pause or "
                                                      "snapshot is published again") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def info(snapshot_id: str) -> dict[str, Any] | None:
    """The wire info of a snapshot in the shared store (without importing it), or None."""
    root = store.shared_root()
    if root is None:
        return None
    try:
        return dict(json.loads((root / _checked_id(snapshot_id) / "info.json").read_text()))
    except (FileNotFoundError, ValueError):
        return None


def get(snapshot_id: str) -> Snapshot:
    """The snapshot from this server's store, else imported from the shared store; SnapshotNotFound if neither
    has it, TransferError (nothing kept) if the shared copy is damaged."""
    try:
        return Snapshot.get(snapshot_id)
    except SnapshotNotFound:
        root = store.shared_root()
        if root is None:
            raise
    folder = root / _checked_id(snapshot_id)
    manifests = sorted(folder.glob("manifest-*.json"))
    if not manifests:
        raise SnapshotNotFound(f"no snapshot {snapshot_id!r} in this server's store nor in the shared store {root}")
    try:
        manifest = json.loads(manifests[0].read_text())
    except (OSError, ValueError) as e:
        raise TransferError(f"the shared copy of {snapshot_id} has an unreadable manifest ({e}); nothing was kept",
                            fix="take the snapshot again on a server that has it") from e
    if not isinstance(manifest, dict) or manifest.get("id") != snapshot_id:
        raise TransferError(f"the shared copy of {snapshot_id} holds a manifest of another snapshot; nothing was kept")

    def read(i: int) -> bytes:  # the manifest's chunk size: receive() has checked the manifest by now
        with open(folder / "archive", "rb") as f:
            f.seek(i * manifest["chunk"])
            return f.read(manifest["chunk"])

    try:
        snap, _ = transfer.receive(manifest, read, origin=root.as_uri(), resumable=False)
    except FileNotFoundError:
        raise SnapshotNotFound(f"snapshot {snapshot_id!r} was deleted from the shared store {root}") from None
    except TransferError:  # a local read: nothing worth resuming from, so no part file is kept
        imports = paths().home / "imports"
        for leftover in (f".part-{snapshot_id}", f".part-{snapshot_id}.json"):
            (imports / leftover).unlink(missing_ok=True)
        raise
    return snap


def drop(snapshot_id: str) -> bool:
    """Delete a snapshot's shared copy (one only there: its server is gone); False if there was none."""
    trash = store.shared_trash(_checked_id(snapshot_id))
    if trash is None:
        return False
    shutil.rmtree(trash, ignore_errors=True)
    return True
