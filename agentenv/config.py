"""Where agentenv keeps its state, the parsing of user-facing sizes, the crash points of the tests, and the one way
every package writes a file whole (``replacing``, ``write_atomic``, ``write_json``; ``write_private`` for a file of
the home that is its owner's alone)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, BinaryIO, Literal, TextIO, overload

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: str | int) -> int:
    """Parse '512m', '1g', '1.5GiB' or a byte count; raise ValueError on anything else."""
    if isinstance(value, bool):
        raise ValueError(f"invalid size {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"size must be positive, got {value}")
        return value
    m = _SIZE.match(str(value))
    if not m:
        raise ValueError(f"invalid size {value!r}: use a number with an optional unit k, m, g or t (e.g. '1g')")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"size must be positive, got {value!r}")
    return n


MIN_DISK = 16 << 20


def parse_disk(value: str | int | None) -> int | None:
    """A disk limit: a size of at least 16 MiB ('10g', bytes), or None for no limit."""
    if value is None:
        return None
    n = parse_size(value)
    if n < MIN_DISK:
        raise ValueError(f"disk must be at least 16m, got {value!r}")
    return n


PRIVATE_DIR, PRIVATE_FILE = 0o700, 0o600  # what agentenv makes under the home: its owner's (root's) alone
PASSABLE = 0o711  # the home, sandboxes/, snapshots/, agents/: anyone may pass (never list), to reach a gate below
GATE = 0o710  # a holder (a sandbox's bundle, a snapshot's folder): root's, and its uid range's root group may pass


@dataclass(frozen=True)
class Paths:
    """The on-disk layout under the home (see ``agentenv.host.volume`` for the volume)::

        sandboxes/<id>/     each sandbox's record, OCI bundle, rootfs mount point and logs (host filesystem)
        snapshots/<id>/     the snapshot store: meta.json and criu/, the processes' images (host filesystem,
                            which writes them several times faster than btrfs does)
        runc/, tmp/         runc's state; scratch
        uids/               the leases of the sandboxes' uid ranges (``agentenv.host.userns``)
        agents/             the keeper (PID 1 of every sandbox), its parts joined, one file by content (bind-mounted read-only)
        exports/, imports/  snapshots packed for, and coming from, other servers (``agentenv.snapshot.transfer``)
        e2b-templates/      the E2B templates (``agentenv.server.e2b.template_store``)
        image-uses/         when each Docker image last started a sandbox (``agentenv.host.image_store``)
        volume.img          the sparse btrfs image of the volume (when agentenv made it); volume.lock
        store-limit         the snapshot store's limit (``agentenv.snapshot.store.set_limit``)
        volume/             the volume: what sandboxes write, and the files of snapshots (one filesystem, so
                            that a snapshot's files are reflinks of the sandbox's, and a restore's of the snapshot's)
          layers/<id>/      a sandbox's overlay upper and work folders: one subvolume, its disk limit
          snapshots/<id>/   a snapshot's files (what fs/ of the store held): a subvolume, the store's limit

    Who may reach what: every folder and file is root's alone (0700, 0600), made so (never opened, then closed),
    except the folders a sandbox's root must pass through: a sandbox runs as an unprivileged host uid range
    (``agentenv.host.userns``) whose root must reach its bundle's ``rootfs`` (runc mounts it from inside the
    sandbox's user namespace), a restore's CRIU images (CRIU reads them as that root) and the keeper's file (a
    restore's CRIU binds it there). The home, ``sandboxes/`` and ``snapshots/`` let anyone pass (0711: the names
    there cannot be listed), and each folder in those two is a *gate* (``gate``): root's, mode 0710, its group the
    gid of its sandbox's root (the range's base), so only that range and root get in. ``agents/`` (0711) holds
    the keeper alone, agentenv's own code (0644), nothing of a sandbox. Other host users reach nothing else below
    the home, and a sandbox's root reaches only its own family's folders, where the records are 0600 root's.
    """

    home: Path

    @property
    def sandboxes(self) -> Path:
        return self.home / "sandboxes"

    @property
    def volume(self) -> Path:
        return self.home / "volume"

    @property
    def volume_image(self) -> Path:
        return self.home / "volume.img"

    @property
    def volume_lock(self) -> Path:
        return self.home / "volume.lock"

    @property
    def store_limit(self) -> Path:
        return self.home / "store-limit"

    @property
    def layers(self) -> Path:
        return self.volume / "layers"

    @property
    def snapshots(self) -> Path:
        return self.home / "snapshots"

    @property
    def snapshot_files(self) -> Path:
        return self.volume / "snapshots"

    @property
    def agents(self) -> Path:
        return self.home / "agents"

    @property
    def runc_root(self) -> Path:
        return self.home / "runc"

    @property
    def uids(self) -> Path:
        return self.home / "uids"

    @property
    def exports(self) -> Path:
        return self.home / "exports"

    @property
    def imports(self) -> Path:
        return self.home / "imports"

    @property
    def templates(self) -> Path:
        return self.home / "e2b-templates"

    @property
    def image_uses(self) -> Path:
        return self.home / "image-uses"

    @property
    def tmp(self) -> Path:
        return self.home / "tmp"

    def folders(self) -> dict[Path, int]:
        """The home's own folders and their modes, the home first and ``tmp`` last."""
        passable = (self.home, self.sandboxes, self.snapshots, self.agents)
        private = (self.runc_root, self.uids, self.exports, self.imports, self.templates, self.image_uses,
                   self.volume, self.tmp)
        return {**{d: PASSABLE for d in passable}, **{d: PRIVATE_DIR for d in private}}

    def private_files(self) -> tuple[Path, ...]:
        """The files right in the home (reachable by name through it): each 0600."""
        return self.volume_image, self.store_limit, self.volume_lock


_laid_out: set[Path] = set()


def where() -> Paths:
    """The layout under $AGENTENV_HOME, as it is: nothing made (what a process that must not bring a removed home
    back looks at; ``paths`` makes it)."""
    return Paths(Path(os.environ.get("AGENTENV_HOME", "/var/lib/agentenv")))


def paths() -> Paths:
    """The layout under $AGENTENV_HOME (default /var/lib/agentenv), made on first use (the volume's folders are
    made by ``agentenv.host.volume.ensure``, which may mount the volume there first); a home an older agentenv
    made is closed to other users once a process uses it (``lay_out``)."""
    p = where()
    if p.home not in _laid_out or not p.tmp.is_dir():  # one stat a call once made (a start asks ~10 times)
        lay_out(p)
        _laid_out.add(p.home)
    return p


def lay_out(p: Paths) -> None:
    """Make the home's folders with their modes (``Paths.folders``), and set the modes an older agentenv left open
    (it made everything 0755 / 0644 and let anyone reach a sandbox's files): the home's folders and files, and
    every sandbox bundle and snapshot folder still open to others, which becomes the gate of its range (from its
    record's ``spec.uids``), its records 0600. Idempotent; a home this code made has nothing to change (one stat
    per folder of ``sandboxes/`` and ``snapshots/``, once a process). A home of another user (a client on its
    server's host, say) is left as it is."""
    p.home.mkdir(mode=PASSABLE, parents=True, exist_ok=True)
    if p.home.stat().st_uid != os.geteuid():
        return
    for d, mode in p.folders().items():
        d.mkdir(mode=mode, exist_ok=True)  # a mode the umask cannot widen: it only takes bits away
        if (d.stat().st_mode & 0o7777) != mode:
            os.chmod(d, mode)
    for f in p.private_files():
        _close(f)
    for folder, record in ((p.sandboxes, "sandbox.json"), (p.snapshots, "meta.json")):
        for entry in os.scandir(folder):
            with contextlib.suppress(FileNotFoundError):  # removed meanwhile (a close, a gc)
                if entry.is_dir(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_mode & 0o007:
                    _close_holder(Path(entry.path), record)


def _close_holder(holder: Path, record: str) -> None:
    """A sandbox bundle or snapshot folder an older agentenv made: its gate, its records 0600."""
    try:
        uids = json.loads((holder / record).read_text())["spec"]["uids"]
    except (OSError, ValueError, KeyError, TypeError):
        uids = None  # being made or removed, or from before user namespaces: root's alone
    for name in (record, "link.json", "criu/runc-state.json", "criu/descriptors.json"):
        _close(holder / name)
    if isinstance(uids, int):
        gate(holder, uids)
    else:
        os.chmod(holder, PRIVATE_DIR)


def _close(path: Path) -> None:
    """Make a file 0600 where it is a file (a missing one is left missing)."""
    with contextlib.suppress(FileNotFoundError):
        st = os.stat(path, follow_symlinks=False)
        if stat.S_ISREG(st.st_mode) and st.st_mode & 0o077:
            os.chmod(path, PRIVATE_FILE)


def gate(folder: Path, gid: int) -> None:
    """Make ``folder`` (root's, made 0700) a gate: group ``gid`` (a sandbox's root group, its range's base on the
    host) may pass, nobody else but root (``GATE``). Owner and group are set before the mode opens to the group."""
    st = folder.stat()
    if (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (0, gid, GATE):
        return
    if st.st_mode & 0o077:
        os.chmod(folder, PRIVATE_DIR)
    os.chown(folder, 0, gid)
    os.chmod(folder, GATE)


def _temporary(path: Path) -> Path:
    """A fresh hidden name beside ``path`` (random: writers of one file in several threads or processes never meet;
    the name's start kept short enough for any file system)."""
    return path.with_name(f".{path.name[:200]}.{os.urandom(8).hex()}.tmp")


@overload
def replacing(path: str | os.PathLike[str], *, mode: int | None = ..., fsync: bool = ...,
              text: Literal[False] = ...) -> contextlib.AbstractContextManager[BinaryIO]: ...


@overload
def replacing(path: str | os.PathLike[str], *, mode: int | None = ..., fsync: bool = ...,
              text: Literal[True]) -> contextlib.AbstractContextManager[TextIO]: ...


def replacing(path: str | os.PathLike[str], *, mode: int | None = None, fsync: bool = False,
              text: bool = False) -> contextlib.AbstractContextManager[IO[Any]]:
    """Write ``path`` whole or not at all: the block writes a new temporary file beside it (binary, or UTF-8 text
    with ``text``), renamed over ``path`` when the block ends (a reader sees the old file or the new one, never a
    part) and removed if it raises. ``f.name`` is the temporary file's path, for a writer that takes only a path
    (one that makes the file there anew gives it its own mode).

    The temporary file is made with ``O_CREAT | O_EXCL | O_NOFOLLOW``: a new file, never one already there nor
    what a symlink planted at its name points to. Its mode by default is what ``open`` gives (``0o666`` less the
    umask); a ``mode`` given is the file's exactly, from its creation: made with it (the umask can take bits off,
    never add one) and, where the umask took some, set on the open file before a byte is written, so a file made
    ``PRIVATE_FILE`` is never readable by others at any moment. With ``fsync`` the data is on the disk before the
    rename; syncing the folder, where the rename itself must survive a crash, is the caller's.
    """
    return _replacing(Path(path), mode, fsync, text)


@contextlib.contextmanager
def _replacing(path: Path, mode: int | None, fsync: bool, text: bool) -> Iterator[IO[Any]]:
    tmp = _temporary(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o666 if mode is None else mode)
    try:
        try:
            if mode is not None and stat.S_IMODE(os.fstat(fd).st_mode) != mode:
                os.fchmod(fd, mode)  # the umask narrowed it: still empty, and never wider than ``mode``
        except BaseException:
            os.close(fd)
            raise
        # the file just made, named by its path (``open`` owns the descriptor from here, and closes it on a failure)
        with open(tmp, "w" if text else "wb", encoding="utf-8" if text else None, opener=lambda _p, _f: fd) as f:
            yield f
        if fsync:  # by its name: a writer given ``f.name`` may have made the file there anew (safetensors does)
            synced = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.fsync(synced)
            finally:
                os.close(synced)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_atomic(path: str | os.PathLike[str], data: str | bytes, *, mode: int | None = None,
                 fsync: bool = False) -> None:
    """Write ``data`` (a str as UTF-8) to ``path`` whole or not at all (``replacing``: the same ``mode`` and
    ``fsync``)."""
    with replacing(path, mode=mode, fsync=fsync) as f:
        f.write(data.encode() if isinstance(data, str) else data)


def write_json(path: str | os.PathLike[str], obj: object, *, mode: int | None = None, fsync: bool = False,
               indent: int | None = None, sort_keys: bool = False,
               default: Callable[[object], object] | None = None) -> None:
    """Write ``obj`` as JSON (``json.dumps(obj, indent=, sort_keys=, default=)``) to ``path`` whole or not at all
    (``write_atomic``). A value the encoder refuses raises before any file is made."""
    write_atomic(path, json.dumps(obj, indent=indent, sort_keys=sort_keys, default=default), mode=mode, fsync=fsync)


def write_private(path: Path, data: str | bytes) -> None:
    """Write ``path`` whole, by rename, 0600 from its creation (``write_atomic``). The temporary name an agentenv
    before the shared writer used (``<name>.tmp``) goes too: a crash's leftover, perhaps made open to all."""
    write_atomic(path, data, mode=PRIVATE_FILE)
    path.with_name(f"{path.name}.tmp").unlink(missing_ok=True)


CRASH_ENV = "AGENTENV_CRASH_AT"


def crash_point(name: str) -> None:
    """A test hook: with ``$AGENTENV_CRASH_AT`` = ``name``, this process kills itself with SIGKILL here, as a
    ``kill -9`` from outside would. Nothing happens otherwise. (A kill in the middle of a CRIU dump is a CRIU that
    kills its caller: ``tests/integration/test_hostile_restart.py``.)"""
    if os.environ.get(CRASH_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)
