"""The snapshot store: one folder per snapshot, written atomically, with parent links.

Layout: ``<home>/snapshots/<id>/{meta.json, fs/, criu/}``. A snapshot is built in a hidden
``.tmp-<id>-<pid>`` folder and renamed into place only when complete, so a crash or ``kill -9``
mid-snapshot leaves nothing listed; ``gc()`` removes such leftovers once their writer is gone.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agentenv.api import SnapshotInfo, info_of
from agentenv.config import paths
from agentenv.errors import SnapshotNotFound, StoreFullError


@dataclass(frozen=True)
class Snapshot(SnapshotInfo):
    """A snapshot in this host's store: the shared fields, plus what restoring it needs (the container
    spec) and CRIU's dump statistics."""

    spec: dict[str, Any] = field(default_factory=dict, repr=False)
    criu_stats: dict[str, int] = field(default_factory=dict, repr=False)  # e.g. frozen_time (µs)

    def info(self) -> SnapshotInfo:
        """The fields every snapshot has, local or remote (what the server sends)."""
        return info_of(self, SnapshotInfo)

    @property
    def path(self) -> Path:
        return paths().snapshots / self.id

    @property
    def fs_dir(self) -> Path:
        return self.path / "fs"

    @property
    def criu_dir(self) -> Path:
        return self.path / "criu"

    @classmethod
    def get(cls, snapshot_id: str) -> Snapshot:
        """Load a snapshot by id; SnapshotNotFound if it is not in the store."""
        meta = paths().snapshots / os.path.basename(snapshot_id) / "meta.json"
        try:
            return cls(**json.loads(meta.read_text()))
        except FileNotFoundError:
            raise SnapshotNotFound(f"no snapshot {snapshot_id!r} in the store") from None

    @classmethod
    def list(cls) -> list[Snapshot]:
        """Every complete snapshot, oldest first."""
        found = []
        for d in paths().snapshots.iterdir():
            if d.name.startswith("."):
                continue
            with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
                found.append(cls(**json.loads((d / "meta.json").read_text())))
        return sorted(found, key=lambda s: s.created_at)

    def delete(self, background: bool = False) -> None:
        """Remove the snapshot (sandboxes made from it are independent and stay).

        It leaves the list at once (an atomic rename); with ``background`` the files are removed by a
        thread, off the caller's critical path (``gc`` finishes the job if the process dies first).
        """
        root = paths().snapshots
        trash = root / f".del-{self.id}-{os.getpid()}"
        try:
            os.rename(self.path, trash)
        except FileNotFoundError:
            raise SnapshotNotFound(f"no snapshot {self.id!r} in the store") from None
        if background:
            threading.Thread(target=shutil.rmtree, args=(trash, True), name="agentenv-discard").start()
        else:
            shutil.rmtree(trash, ignore_errors=True)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


@contextlib.contextmanager
def writing(snapshot_id: str) -> Iterator[Path]:
    """Yield a private folder to build a snapshot in; publish it atomically on success.

    On any error (ENOSPC included) the folder is removed and nothing is listed.
    """
    root = paths().snapshots
    tmp = root / f".tmp-{snapshot_id}-{os.getpid()}"
    tmp.mkdir()
    try:
        yield tmp
        os.rename(tmp, root / snapshot_id)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno == errno.ENOSPC:
            raise StoreFullError(f"the snapshot store at {root} is out of space; nothing was kept",
                                 fix="delete snapshots (agentenv snapshots rm / gc) or free disk space") from e
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_meta(folder: Path, snap: Snapshot) -> None:
    """Write meta.json last: a folder without it is never a snapshot."""
    tmp = folder / "meta.json.tmp"
    tmp.write_text(json.dumps(asdict(snap)))
    os.replace(tmp, folder / "meta.json")


def disk_usage(folder: Path) -> int:
    """Bytes used by the files under a folder (sparse-aware)."""
    total = 0
    for dirpath, _, files in os.walk(folder):
        for f in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
    return total


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def gc(max_age: float | None = None) -> list[str]:
    """Remove leftovers of crashed writers, and (with ``max_age`` seconds) snapshots older than that.

    Returns the names removed.
    """
    removed = []
    now = time.time()
    for d in paths().snapshots.iterdir():
        if d.name.startswith((".tmp-", ".del-")):
            pid = int(d.name.rsplit("-", 1)[-1]) if d.name.rsplit("-", 1)[-1].isdigit() else 0
            if not _pid_alive(pid):
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d.name)
    if max_age is not None:
        for snap in Snapshot.list():
            if now - snap.created_at > max_age:
                snap.delete()
                removed.append(snap.id)
    return removed
