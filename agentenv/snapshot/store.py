"""The snapshot store: one folder per snapshot, written atomically, with parent links.

Layout: ``<home>/snapshots/<id>/{meta.json, criu/}`` and the snapshot's files in ``<home>/volume/snapshots/<id>/``
on the volume (see ``agentenv.host.volume``). There they are a btrfs snapshot of the sandbox's whole layer (a
subvolume holding its overlay's ``upper/``: ``layer`` in meta.json), taken in a few milliseconds whatever the
files, and a restore clones it whole in turn, so a snapshot's files are never copied, not even once; where
the layer is no subvolume they are a reflink copy of the upper folder (older snapshots: ``fs/`` beside
meta.json). A snapshot is built in hidden ``.tmp-<id>-<pid>`` folders (one in each
place) and renamed into place only when complete, its files first and meta.json's folder last, so a crash
or ``kill -9`` mid-snapshot leaves nothing listed; ``gc()`` removes such leftovers once their writer is gone
(except the folders of a pause that recovery can still finish), files without a snapshot, and the
snapshots of forks whose process died.

The store may have a limit (``set_limit``): a snapshot that would take the store past it raises
StoreFullError and leaves nothing behind. It counts the snapshots' sizes (``size_bytes``, what their files
take, shared data included: for a cloned layer, its quota group's count, read in O(1) whatever the number
of files, see ``size_of``); on a volume with quotas the kernel also bounds what is written into copies
(a cloned layer is a subvolume of its own, outside the store's quota group: the store's own count bounds it).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agentenv.api import SnapshotInfo, info_of
from agentenv.config import PRIVATE_DIR, parse_size, paths, write_private
from agentenv.errors import CheckpointError, SnapshotNotFound, StoreFullError
from agentenv.host import volume
from agentenv.host.hostcalls import proc_start_time
from agentenv.host.trees import copy_tree, remove_tree

FORK_KIND = "fork"  # the ``agentenv.kind`` label of a fork's snapshot (deleted when the fork is done)
MIGRATE_KIND = "migrate"  # ... and of a post-copy migration's (its pages live only in its sender's page server)


@dataclass(frozen=True)
class Snapshot(SnapshotInfo):
    """A snapshot in this host's store: the shared fields, plus what restoring it needs (the container
    spec) and CRIU's dump statistics."""

    spec: dict[str, Any] = field(default_factory=dict, repr=False)
    criu_stats: dict[str, int] = field(default_factory=dict, repr=False)  # e.g. frozen_time (µs)
    owner: list[int] | None = field(default=None, repr=False)  # [pid, start] of the process a fork's snapshot serves
    layer: bool = field(default=False, repr=False)  # its files are a clone of the sandbox's whole layer (see save_files)

    def info(self) -> SnapshotInfo:
        """The fields every snapshot has, local or remote (what the server sends)."""
        return info_of(self, SnapshotInfo)

    @property
    def path(self) -> Path:
        return paths().snapshots / self.id

    @property
    def files(self) -> Path:
        """The snapshot's folder on the volume: a clone of the sandbox's layer (``layer``: a subvolume holding
        ``upper/`` and ``work/``, which a restore clones in turn), else a copy of the sandbox's upper folder."""
        return paths().snapshot_files / self.id

    @property
    def fs_dir(self) -> Path:
        """The sandbox's files (what its overlay's upper folder held); in ``fs/`` for a snapshot made before the
        volume."""
        old = self.path / "fs"
        if old.is_dir():
            return old
        return self.files / "upper" if self.layer else self.files

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
        try:
            entries = list(paths().snapshots.iterdir())
        except FileNotFoundError:
            return []
        for d in entries:
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
        p = paths()
        trash = [p.snapshots / f".del-{self.id}-{os.getpid()}", p.snapshot_files / f".del-{self.id}-{os.getpid()}"]
        try:
            os.rename(self.path, trash[0])
        except FileNotFoundError:
            raise SnapshotNotFound(f"no snapshot {self.id!r} in the store") from None
        with contextlib.suppress(FileNotFoundError):
            os.rename(p.snapshot_files / self.id, trash[1])
        with contextlib.suppress(FileNotFoundError):  # its archive packed for another server (snapshot.transfer)
            os.rename(exports() / self.id, exports() / f".del-{self.id}-{os.getpid()}")
            trash.append(exports() / f".del-{self.id}-{os.getpid()}")
        if (shared := shared_trash(self.id)) is not None:  # its copy in the shared store (snapshot.shared)
            trash.append(shared)
        if background:
            threading.Thread(target=remove, args=(trash,), name="agentenv-discard").start()
        else:
            remove(trash)


_shared: list[Path] = []  # the shared store of this process, if any (agentenv serve --shared-store)


def shared_root() -> Path | None:
    """The folder where this server publishes its snapshots for others (``agentenv.snapshot.shared``), or None."""
    return _shared[0] if _shared else None


def set_shared_root(folder: Path | None) -> None:
    _shared[:] = [] if folder is None else [folder]


def shared_staging() -> Path:
    """This host's hidden folder in the shared store: copies being published, or deleted (``<id>-<pid>``), so
    that a host cleans up after its own dead processes only (pids of other hosts mean nothing here)."""
    root = shared_root()
    assert root is not None
    d = root / f".staging-{os.uname().nodename}"
    d.mkdir(mode=0o700, exist_ok=True)
    return d


def shared_trash(snapshot_id: str) -> Path | None:
    """Take a snapshot's copy out of the shared store (renamed aside: no reader finds it from now on); the
    folder to remove, or None if there was none."""
    root = shared_root()
    if root is None:
        return None
    trash = shared_staging() / f".del-{os.path.basename(snapshot_id)}-{os.getpid()}"
    try:
        os.rename(root / os.path.basename(snapshot_id), trash)
    except FileNotFoundError:
        return None
    return trash


def exports() -> Path:
    """Where snapshots packed for another server lie (``agentenv.snapshot.transfer``): ``<home>/exports/<id>/``."""
    return paths().exports


def remove(folders: list[Path]) -> None:
    """Remove folders of the store: a subvolume (a snapshot's cloned layer) at once, anything else file by file."""
    for f in folders:
        if volume.is_subvolume(f):
            volume.drop_layer(f)
        else:
            remove_tree(f)


def save_files(layer: Path, upper: Path, dest: Path) -> None:
    """Put a (frozen) sandbox's files in the new folder ``dest`` of the store: a clone of its whole ``layer``
    where that is a subvolume (``volume.clone_layer``: a few ms whatever the files, no data or metadata
    copied), else a reflink copy of its overlay's ``upper`` folder (``cp -a --reflink=auto``)."""
    remove([dest])
    if volume.can_clone(layer, dest):
        volume.clone_layer(layer, dest, None)
    else:
        copy_tree(upper, dest)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def owner() -> list[int]:
    """This process as an owner of work in progress: [pid, start time], a name no later process gets."""
    pid = os.getpid()
    return [pid, proc_start_time(pid)]


def owner_alive(who: Any) -> bool:
    """True while the process ``owner()`` named then still runs."""
    if not isinstance(who, list | tuple) or len(who) != 2:
        return False
    try:
        return proc_start_time(int(who[0])) == int(who[1])
    except (ProcessLookupError, ValueError):
        return False


def tmp_folder(snapshot_id: str, pid: int | None = None) -> Path:
    return paths().snapshots / f".tmp-{snapshot_id}-{os.getpid() if pid is None else pid}"


def files_of(folder: Path) -> Path:
    """Where the files of the snapshot being written in ``folder`` (a ``.tmp-`` folder of the store) go."""
    return paths().snapshot_files / folder.name


_FULL_FIX = "delete snapshots (agentenv snapshots rm / gc), or raise the store's limit (agentenv serve --max-store)"


@contextlib.contextmanager
def writing(snapshot_id: str) -> Iterator[Path]:
    """Yield a private folder to build a snapshot in (meta.json, criu/; its files go in ``files_of(folder)``);
    publish it atomically on success.

    On any error (ENOSPC, EDQUOT and the store's limit included) the folders are removed and nothing is listed.
    """
    p = paths()
    p.snapshots.mkdir(parents=True, exist_ok=True)
    p.snapshot_files.mkdir(parents=True, exist_ok=True)
    cap = limit()
    if cap is not None and (used := usage()) >= cap:
        raise StoreFullError(f"the snapshot store is full: {used} of its {cap} bytes are used; nothing was kept",
                             fix=_FULL_FIX)
    tmp = tmp_folder(snapshot_id)
    tmp.mkdir(mode=PRIVATE_DIR)  # the gate of its range once the snapshot holds it (userns.hold)
    files_of(tmp).mkdir(mode=PRIVATE_DIR)
    try:
        yield tmp
        publish(tmp, snapshot_id, check=True)
    except OSError as e:
        discard(tmp)
        if e.errno in (errno.ENOSPC, errno.EDQUOT) and not isinstance(e, StoreFullError):
            raise StoreFullError(f"the snapshot store is out of space ({e}); nothing was kept", fix=_FULL_FIX) from e
        raise
    except CheckpointError as e:
        discard(tmp)
        if "No space left" in str(e) or "quota exceeded" in str(e).lower():
            raise StoreFullError(f"the snapshot store is out of space: {e}; nothing was kept", fix=_FULL_FIX) from e
        raise
    except BaseException:
        discard(tmp)
        raise


def discard(tmp: Path) -> None:
    """Remove a ``.tmp-`` folder of the store and its files."""
    remove([files_of(tmp), tmp])


def size_of(tmp: Path) -> int:
    """Bytes a snapshot being written in ``tmp`` takes (its files included).

    Its files, where they are a cloned layer, are counted by their quota group (``volume.referenced``: what
    the clone refers to, data and metadata, exact right after the clone), in microseconds whatever the
    number of files; only a copy (no volume) is walked file by file. The few files of ``tmp`` itself
    (meta.json, CRIU's images) are walked."""
    files = files_of(tmp)
    counted = volume.referenced(files)
    return volume.disk_usage(tmp) + (volume.disk_usage(files) if counted is None else counted)


def publish(tmp: Path, snapshot_id: str, check: bool = False) -> None:
    """Rename a finished ``.tmp-`` folder (and its files) into place, the files first; with ``check``,
    StoreFullError if that would take the store past its limit (checked and renamed under the store's
    lock, so two writers cannot both pass)."""
    p = paths()
    cap = limit() if check else None
    fd = os.open(p.snapshots / ".lock", os.O_CREAT | os.O_RDWR, 0o600) if cap is not None else None
    try:
        if fd is not None and cap is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
            size, used = size_of(tmp), usage()
            if used + size > cap:
                raise StoreFullError(f"a snapshot of {size} bytes does not fit in the snapshot store ({used} of "
                                     f"its {cap} bytes are used); nothing was kept", fix=_FULL_FIX)
        with contextlib.suppress(FileNotFoundError):  # none for a snapshot written before the volume
            os.rename(files_of(tmp), p.snapshot_files / snapshot_id)
        os.rename(tmp, p.snapshots / snapshot_id)
    finally:
        if fd is not None:
            os.close(fd)


def limit() -> int | None:
    """The store's limit in bytes (``set_limit``), or None."""
    try:
        return int(paths().store_limit.read_text())
    except (FileNotFoundError, ValueError):
        return None


def set_limit(size: str | int | None) -> None:
    """Limit the bytes the store's snapshots may take together (None: no limit but the volume's size)."""
    nbytes = None if size is None else parse_size(size)
    v = volume.ensure()
    if v.quotas:
        volume.limit_store(nbytes)
    if nbytes is None:
        paths().store_limit.unlink(missing_ok=True)
    else:
        write_private(paths().store_limit, str(nbytes))


def usage() -> int:
    """Bytes the store's snapshots take together (their ``size_bytes``)."""
    return sum(s.size_bytes for s in Snapshot.list())


def write_meta(folder: Path, snap: Snapshot) -> None:
    """Write meta.json last: a folder without it is never a snapshot. 0600: its spec holds the sandbox's env."""
    write_private(folder / "meta.json", json.dumps(asdict(snap)))


def pid_alive(pid: int) -> bool:
    """Whether a process of this pid runs (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pausing() -> set[str]:
    """The snapshots that pauses in progress (or interrupted, for recovery to finish) are writing."""
    found = set()
    for rec in paths().sandboxes.glob("*/sandbox.json"):
        with contextlib.suppress(OSError, ValueError):
            snap_id = json.loads(rec.read_text()).get("pausing")
            if isinstance(snap_id, str):
                found.add(snap_id)
    return found


def orphaned_forks() -> list[Snapshot]:
    """The snapshots of forks and post-copy migrations whose process died before it deleted them."""
    return [s for s in Snapshot.list()
            if s.labels.get("agentenv.kind") in (FORK_KIND, MIGRATE_KIND) and not owner_alive(s.owner)]


def gc(max_age: float | None = None) -> list[str]:
    """Remove leftovers of crashed writers (but not an interrupted pause's folders: recovery finishes or rolls
    back that pause), files whose snapshot is gone, the snapshots of forks whose process died, and (with
    ``max_age`` seconds) snapshots older than that. Returns the names removed.
    """
    p = paths()
    removed: list[str] = []
    now = time.time()
    keep = pausing()
    for root in (p.snapshots, p.snapshot_files, exports()):  # the folders with meta.json first: files may follow
        try:
            entries = list(root.iterdir())
        except FileNotFoundError:
            continue
        for d in entries:
            if d.name.startswith((".tmp-", ".del-")):
                head, _, tail = d.name.rpartition("-")
                pid = int(tail) if tail.isdigit() else 0
                if (d.name.startswith(".tmp-") and head[len(".tmp-"):] in keep) or pid_alive(pid):
                    continue
            elif root == exports() and not d.name.startswith("."):  # an archive of a snapshot gone since
                if (p.snapshots / d.name).exists():
                    continue
            elif root == p.snapshot_files and not d.name.startswith("."):
                # files without their snapshot: a crash between the two renames of a publish, or of a delete
                if d.name in keep or (p.snapshots / d.name).exists() or any(p.snapshots.glob(f".tmp-{d.name}-*")):
                    continue
            else:
                continue
            remove([d])
            removed.append(d.name)
    for snap in orphaned_forks():
        with contextlib.suppress(SnapshotNotFound):
            snap.delete()
            removed.append(snap.id)
    if max_age is not None:
        for snap in Snapshot.list():
            if now - snap.created_at > max_age:
                with contextlib.suppress(SnapshotNotFound):
                    snap.delete()
                    removed.append(snap.id)
    return removed
