"""The volume: what sandboxes write, and the snapshot store, on one btrfs filesystem with quotas.

A sandbox's writable layer (its overlay's upper and work folders) is a btrfs subvolume,
``<home>/volume/layers/<id>``, whose quota group is limited to the sandbox's ``disk=``: past it the kernel
fails the writer's writes with EDQUOT ("Disk quota exceeded") and nothing else notices. The snapshot store
keeps the files of snapshots in a subvolume too (``<home>/volume/snapshots``), limited by ``store.set_limit``.
Both are on one filesystem, so a snapshot copies files by reflink (``cp --reflink``): the copy shares the
data and costs the metadata only, whatever the size of the files. A fork of the files alone goes further:
each child's layer is a btrfs snapshot of the parent's (``clone_layer``), a few milliseconds whatever the
layer holds, with not even the metadata copied. (CRIU's images of the processes stay on
the host's filesystem, in ``<home>/snapshots``: btrfs writes them several times slower, and they share
nothing.)

The volume is what is mounted on ``<home>/volume`` when that is btrfs. Otherwise agentenv makes it on first
use: a sparse image ``<home>/volume.img`` (``$AGENTENV_VOLUME_SIZE``, by default half the free space of the
home's filesystem), formatted btrfs and mounted there through a loop device (mounted again after a reboot).
The image is root's alone (0600: reading it reads every sandbox's files, whatever their modes), so is the
volume's root folder (0700), and the volume is mounted ``nosuid,nodev``, one agentenv did not mount too.
Where that cannot be done (no btrfs-progs, no loop devices, not root, or ``$AGENTENV_VOLUME=off``) the
volume is a plain folder: sandboxes run with ``disk=None`` (no limit), and asking for a limit raises
DiskLimitUnsupported, which says why and what to do.

Why btrfs: the kernels this runs on (6.18 here) are built without XFS quotas (CONFIG_XFS_QUOTA) and without
the quota format ext4's project quotas need (CONFIG_QFMT_V2); btrfs quota groups are what is left that
limits what a folder holds, and reflinks come with them. Reflinked data does not count against a quota
group when it is cloned (only when it is written), so the store's limit is also checked by the store
itself, from the snapshots' sizes. The calls to btrfs (ioctls, not btrfs-progs) are ``btrfs.py``'s.

Why simple quotas (squota, Linux 6.7+), on a new volume where the kernel has them: full quota groups find,
for every shared block a write or a deleted snapshot touches, every subvolume that refers to it (a backref
walk). With a layer of 50,000 files and its snapshots coming and going, each snapshot took 0.2 to 5 s and
the kernel's cleaner kept a core busy; with simple quotas a group counts what its own subvolume wrote, and
the same snapshot costs what it costs with no quotas at all (``bench.snapshot_scale``). A clone begins with
blocks its group never counts, so they are noted beside its folders and taken off its limit
(``_begin_with``): the limit still bounds what a layer holds. What changes: deleting inherited files gives
no room back, and a layer's count keeps blocks it rewrote while a snapshot or fork of it still holds the old
ones. ``AGENTENV_QUOTAS=full`` makes a new volume with full quota groups; a volume keeps the mode it has.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from agentenv.config import PRIVATE_DIR, PRIVATE_FILE, Paths, parse_size, paths, write_atomic
from agentenv.errors import DiskLimitUnsupported, SandboxError
from agentenv.host import btrfs
from agentenv.host.btrfs import is_subvolume
from agentenv.host.hostcalls import mountinfo, seal_mount
from agentenv.host.trees import remove_tree

log = logging.getLogger("agentenv")

VOLUME_ENV = "AGENTENV_VOLUME"  # "off": never make a volume (sandboxes then need disk=None)
QUOTAS_ENV = "AGENTENV_QUOTAS"  # "full": full quota groups on a new volume (default: simple ones where possible)
SIZE_ENV = "AGENTENV_VOLUME_SIZE"  # the size of a volume agentenv makes, e.g. "200g"
MIN_SIZE = 1 << 30
INHERITED = "inherited"  # in a layer's folder (beside upper/ and work/), with simple quotas: the bytes it began with


@dataclass(frozen=True)
class Volume:
    """Where sandboxes' layers and the store live, and whether disk limits hold there (``reason``: why not)."""

    path: Path
    quotas: bool
    reason: str | None = None
    simple: bool = False  # btrfs's simple quotas (squota): a layer's group counts what it wrote itself

    def require(self, disk: int | None) -> None:
        """DiskLimitUnsupported if ``disk`` is a limit and this volume cannot enforce it."""
        if disk is not None and not self.quotas:
            raise DiskLimitUnsupported(
                f"this host cannot enforce a disk limit (disk={disk} bytes): {self.reason}",
                fix="run scripts/bootstrap.sh (it installs btrfs-progs; agentenv then makes a btrfs volume with "
                    f"quotas at {self.path} on first use), or pass disk=None to run without a disk limit")


_cache: dict[str, Volume] = {}
_cache_lock = threading.Lock()


def ensure() -> Volume:
    """The volume of this home, mounted (and made) on first use; cached for the life of the process."""
    p = paths()
    key = str(p.home)
    v = _cache.get(key)
    if v is None or (v.quotas and not os.path.ismount(v.path)):  # new, or unmounted since (``unmount``)
        with _cache_lock:
            v = _cache.get(key)
            if v is None or (v.quotas and not os.path.ismount(v.path)):
                v = _cache[key] = _ensure(p)
    return v


def unmount(idle: Callable[[], bool]) -> bool:
    """Unmount this home's volume if it is mounted and, checked under the volume's lock, ``idle()`` (nothing of the
    home is left on it); its image file stays, and the next ``ensure`` (in any process) mounts it again. Whether
    it was unmounted; OSError if the kernel refused (something still uses it)."""
    p = paths()
    with _flock(p.volume_lock):
        if not os.path.ismount(p.volume) or not idle():
            return False
        r = subprocess.run(["umount", str(p.volume)], capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise OSError(f"umount {p.volume}: {r.stderr.strip()}")
    forget()
    return True


def forget() -> None:
    """Drop what this process knows of volumes (the next ``ensure`` looks again)."""
    with _cache_lock:
        _cache.clear()


def _ensure(p: Paths) -> Volume:
    vol = p.volume
    with _flock(p.volume_lock):
        reason = None if os.path.ismount(vol) else _provision(p)
        if reason is None:
            _seal(vol)
            fstype = _fstype(vol)
            if fstype != "btrfs":
                reason = f"{vol} is a mounted {fstype} filesystem, not btrfs"
            else:
                try:
                    simple = btrfs.enable_quotas(vol, simple=os.path.exists("/sys/fs/btrfs/features/simple_quota")
                                                 and os.environ.get(QUOTAS_ENV, "").strip().lower() != "full")
                    _make_dirs(p, subvolumes=True)
                except OSError as e:
                    reason = f"could not turn btrfs quotas on at {vol}: {e}"
                else:
                    return Volume(vol, True, simple=simple)
        _make_dirs(p, subvolumes=False)
    log.warning("sandboxes here run without disk limits: %s", reason)
    return Volume(vol, False, reason)


def _provision(p: Paths) -> str | None:
    """Mount the volume on ``p.volume``, making its image first if there is none; None when done, else why not."""
    if os.environ.get(VOLUME_ENV, "").strip().lower() in ("off", "0", "no", "none", "false"):
        return f"${VOLUME_ENV} is off"
    if not _unused(p.volume):
        return (f"{p.volume} already holds files written without a volume (delete them, or use a fresh "
                "AGENTENV_HOME, to get one)")
    if os.geteuid() != 0:
        return "making the volume needs root"
    image = p.volume_image
    if not image.exists():
        mkfs = shutil.which("mkfs.btrfs")
        if mkfs is None:
            return "mkfs.btrfs is not installed (Debian package btrfs-progs)"
        size = volume_size(p.home)
        tmp = image.with_name(f"{image.name}.{os.getpid()}.tmp")
        try:
            # 0600: whoever reads the image reads every sandbox's files, whatever their own modes
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, PRIVATE_FILE), "wb") as f:
                f.truncate(size)  # sparse: the host's disk is used as the volume fills
            r = subprocess.run([mkfs, "-q", "-f", "-L", "agentenv", str(tmp)], capture_output=True, text=True,
                               check=False)
            if r.returncode != 0:
                return f"mkfs.btrfs failed: {r.stderr.strip()[:300]}"
            os.rename(tmp, image)
        finally:
            tmp.unlink(missing_ok=True)
    p.volume.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-o", "loop,noatime,nosuid,nodev", str(image), str(p.volume)], capture_output=True,
                       text=True, check=False)
    if r.returncode != 0:
        return f"could not mount {image} on {p.volume} (needs loop devices and btrfs): {r.stderr.strip()[:300]}"
    log.info("mounted the sandbox volume %s on %s", image, p.volume)
    return None


def _seal(vol: Path) -> None:
    """Close the mounted volume to the host's users: its root 0700, the mount ``nosuid,nodev`` (a volume mounted by
    an older agentenv, or by hand, gets them now; a sandbox's setuid file or device node does nothing on the host)."""
    if os.stat(vol).st_mode & 0o7777 != PRIVATE_DIR:
        os.chmod(vol, PRIVATE_DIR)
    if os.statvfs(vol).f_flag & (os.ST_NOSUID | os.ST_NODEV) != os.ST_NOSUID | os.ST_NODEV:
        try:
            seal_mount(vol)
        except OSError as e:
            raise SandboxError(f"could not make the volume {vol} nosuid,nodev: {e}",
                               fix=f"mount -o remount,nosuid,nodev {vol}") from e


def volume_size(home: Path) -> int:
    """The size of a new volume: ``$AGENTENV_VOLUME_SIZE``, else half the free space where the home is."""
    if os.environ.get(SIZE_ENV):
        return max(MIN_SIZE, parse_size(os.environ[SIZE_ENV]))
    st = os.statvfs(home)
    return max(MIN_SIZE, (st.f_bavail * st.f_frsize // 2) >> 20 << 20)


def _unused(folder: Path) -> bool:
    """True if nothing but empty ``layers`` and ``snapshots`` folders is in ``folder`` (or it does not exist)."""
    try:
        entries = list(folder.iterdir())
    except FileNotFoundError:
        return True
    return all(e.name in ("layers", "snapshots") and e.is_dir() and not any(e.iterdir()) for e in entries)


def _make_dirs(p: Paths, subvolumes: bool) -> None:
    p.layers.mkdir(parents=True, exist_ok=True)
    files = p.snapshot_files
    if not subvolumes:
        files.mkdir(parents=True, exist_ok=True)
        return
    if files.exists() and not is_subvolume(files):
        with contextlib.suppress(OSError):
            files.rmdir()  # an empty plain folder left from before the volume was there
    if not files.exists():
        btrfs.create_subvolume(files)


def _fstype(mountpoint: Path) -> str | None:
    """The filesystem type mounted on ``mountpoint`` (the top one), from /proc/self/mountinfo."""
    found = [m.fstype for m in mountinfo() if m.point == str(mountpoint)]
    return found[-1] if found else None


@contextlib.contextmanager
def _flock(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def make_layer(path: Path, disk: int | None) -> None:
    """Make a sandbox's layer folder: a subvolume limited to ``disk`` bytes where the volume has quotas, else
    a plain folder (DiskLimitUnsupported if ``disk`` is a limit then)."""
    v = ensure()
    v.require(disk)
    if not v.quotas:
        path.mkdir(parents=True)
        return
    try:
        btrfs.create_subvolume(path)
    except OSError as e:
        raise SandboxError(f"could not create the sandbox's subvolume {path}: {e}") from e
    if disk is not None:
        try:
            btrfs.set_limit(path, disk)
        except OSError as e:
            drop_layer(path)
            raise SandboxError(f"could not set the disk limit of {path}: {e}",
                               fix="check that btrfs quotas are on: btrfs qgroup show " + str(v.path)) from e


def can_clone(src: Path, dst: Path) -> bool:
    """True if ``clone_layer`` can copy the layer ``src`` to ``dst``: ``src`` is a subvolume of a volume with
    quotas, and ``dst`` is on that volume too."""
    v = ensure()
    root = v.path.resolve()
    return (v.quotas and is_subvolume(src) and src.resolve().is_relative_to(root)
            and dst.resolve().is_relative_to(root))


def clone_layer(src: Path, dst: Path, disk: int | None) -> None:
    """Make the layer ``dst`` a copy of the layer ``src`` (where ``can_clone``) by a btrfs snapshot.

    The copy shares every block with ``src`` until one of them writes it, and takes a few milliseconds
    whatever the layer holds: no file is read or copied (what ``src``'s processes wrote and the kernel had
    not yet written out is flushed first, as a reflink copy would). Its work folder starts empty (it is the
    overlay's scratch, not the sandbox's files) and its quota group is limited to ``disk`` bytes; it counts
    what it inherited at once. OSError (ENOSPC, EDQUOT) when the volume is full, SandboxError if btrfs
    refuses otherwise; nothing of ``dst`` is left then.
    """
    try:
        btrfs.snapshot_subvolume(src, dst)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):  # out of space: an OSError, as from a copy (the store says so)
            raise
        raise SandboxError(f"could not snapshot the layer {src} to {dst}: {e}",
                           fix=f"check the volume: btrfs filesystem usage {ensure().path}") from e
    try:
        btrfs.set_limit(dst, None)  # a snapshot keeps its source's limit, which may leave no room for the work folder
        reset_work(dst)
        if ensure().simple:  # the clone's group counts what it writes from now on: note what it begins with
            held = referenced(src)
            _begin_with(dst, disk_usage(src) if held is None else held, disk)
        elif disk is not None:
            btrfs.set_limit(dst, disk)
    except BaseException as e:
        drop_layer(dst)
        if isinstance(e, OSError):
            raise SandboxError(f"could not prepare the layer {dst}: {e}") from e
        raise


def reset_work(layer: Path) -> None:
    """Empty the overlay's scratch folder of ``layer``: a ``volatile`` overlay refuses a work folder that another
    one used (it leaves ``work/incompat/volatile`` behind on purpose)."""
    shutil.rmtree(layer / "work", ignore_errors=True)
    (layer / "work").mkdir()


def _begin_with(layer: Path, inherited: int, disk: int | None) -> None:
    """With simple quotas: the layer ``layer`` begins with ``inherited`` bytes it did not write (a clone's, a
    copy's reflinks), which its group never counts. They are noted (``INHERITED``, for ``referenced``) and
    taken off its limit, so that ``disk`` bounds what it holds, as with full quota groups; but deleting them
    gives no room back (their blocks stay where they came from)."""
    write_atomic(layer / INHERITED, str(inherited))
    if disk is not None:
        btrfs.set_limit(layer, max(disk - inherited, 0))


def account_copy(path: Path, disk: int | None) -> int | None:
    """Have what was just copied into the layer ``path`` (a restore's reflinks) count against its limit ``disk``.

    With full quota groups that takes a commit: one is started now, without waiting for it, and its
    transaction id returned for ``wait_accounted`` (btrfs commits every 30 s by itself). With simple ones the
    copy is walked (``_begin_with``), and None returned, as where there is no subvolume."""
    if not is_subvolume(path):
        return None
    if ensure().simple:
        _begin_with(path, disk_usage(path / "upper"), disk)
        return None
    if disk is None:
        return None
    try:
        return btrfs.start_sync(path)
    except OSError:
        return None


def wait_accounted(path: Path, transid: int | None) -> None:
    """Wait for the commit ``account_copy`` started (usually long done by then). Best effort."""
    if transid is None:
        return
    with contextlib.suppress(OSError):
        btrfs.wait_sync(path, transid)


def referenced(path: Path) -> int | None:
    """The bytes the subvolume at ``path`` refers to (data and its tree's metadata, shared blocks included),
    from its quota group: a few syscalls whatever it holds. None where that count is not exact now (no
    subvolume or no quotas, a rescan running, or inconsistent): then walk the files instead.

    The count is the kernel's as of the last commit; a btrfs snapshot commits, and counts what it inherited
    in that commit, so right after ``clone_layer`` the clone's count is exact. With simple quotas a group
    counts what its subvolume wrote (including blocks it no longer sees that a snapshot of it still holds),
    and what it began with is added (``_begin_with``): an upper bound of what it refers to."""
    if not is_subvolume(path):
        return None
    got = btrfs.group_count(path)
    if got is None:
        return None
    counted, simple = got
    if simple:
        try:
            counted += int((path / INHERITED).read_text())
        except FileNotFoundError:  # a layer made empty
            pass
        except (OSError, ValueError):
            return None
    return counted


def disk_usage(folder: Path) -> int:
    """Bytes used by the files under a folder (sparse-aware), walked file by file."""
    total = 0
    for dirpath, _, files in os.walk(folder):
        for f in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
    return total


def drop_layer(path: Path) -> None:
    """Remove a layer folder and everything in it (a subvolume goes at once; the kernel frees it behind)."""
    if is_subvolume(path):
        try:
            btrfs.delete_subvolume(path)
            return
        except OSError as e:
            log.warning("could not delete the subvolume %s (%s); removing its files", path, e)
    remove_tree(path)


def limit_store(nbytes: int | None) -> None:
    """Set (None: lift) the kernel's limit on what the snapshot store holds."""
    v = ensure()
    v.require(nbytes)
    if v.quotas and is_subvolume(paths().snapshot_files):
        btrfs.set_limit(paths().snapshot_files, nbytes)
