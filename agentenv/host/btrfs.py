"""The btrfs calls the volume (``volume.py``) makes, as ioctls (``linux/btrfs.h``) rather than btrfs-progs: make,
snapshot and delete a subvolume, turn quotas on, limit a subvolume's quota group and read its count, start and
wait for a commit.

Apart from ``volume.py`` because this is the kernel's interface alone, with its structs and numbers; what a
sandbox's layer is, when a limit is set and what a count means are the volume's. Each call raises the ``OSError``
of its ioctl.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
from collections.abc import Iterator
from pathlib import Path

# btrfs ioctls (linux/btrfs.h): _IOW(0x94, 1/14/15, btrfs_ioctl_vol_args), _IOR(0x94, 43, qgroup_limit_args),
# _IOWR(0x94, 40, quota_ctl_args)
_SNAP_CREATE = 0x50009401  # _IOW(0x94, 1, btrfs_ioctl_vol_args): a snapshot of the subvolume whose fd is in args
_SUBVOL_CREATE = 0x5000940E
_SNAP_DESTROY = 0x5000940F
_QGROUP_LIMIT = 0x8030942B
_QUOTA_CTL = 0xC0109428
_TREE_SEARCH = 0xD0009411  # _IOWR(0x94, 17, btrfs_ioctl_search_args): items of a tree (here: the quota tree)
_INO_LOOKUP = 0xD0009412  # _IOWR(0x94, 18, btrfs_ioctl_ino_lookup_args): with objectid 256, the fd's subvolume id
_START_SYNC = 0x80089418  # _IOR(0x94, 24, __u64)
_WAIT_SYNC = 0x40089416  # _IOW(0x94, 22, __u64)
_QUOTA_ENABLE, _QUOTA_ENABLE_SIMPLE = 1, 4
_LIMIT_MAX_RFER = 1
_CLEAR = (1 << 64) - 1
_VOL_ARGS = 4096  # struct btrfs_ioctl_vol_args: __s64 fd; char name[4088]
_SUBVOL_INO = 256  # every subvolume's root folder has this inode number
_QUOTA_TREE = 8  # BTRFS_QUOTA_TREE_OBJECTID
_QGROUP_STATUS_KEY, _QGROUP_INFO_KEY = 240, 242
_QGROUP_INEXACT = 0b0110  # status flags RESCAN, INCONSISTENT: the counts are not (yet) exact
_QGROUP_SIMPLE = 0b1000  # status flag SIMPLE_MODE
_SEARCH_KEY = struct.Struct("=7Q4I4Q")  # btrfs_ioctl_search_key: tree, min/max objectid, offset, transid; ...
_SEARCH_HEADER = struct.Struct("=3Q2I")  # btrfs_ioctl_search_header: transid, objectid, offset, type, len


@contextlib.contextmanager
def _dir_fd(path: Path) -> Iterator[int]:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


def _vol_args(name: str) -> bytearray:
    raw = name.encode()
    if not raw or len(raw) >= _VOL_ARGS - 8 or b"/" in raw:
        raise ValueError(f"bad subvolume name {name!r}")
    args = bytearray(_VOL_ARGS)
    args[8:8 + len(raw)] = raw
    return args


def enable_quotas(vol: Path, simple: bool) -> bool:
    """Turn quotas on where they are off (``simple``: simple ones); a volume keeps the mode it has. True if its
    quotas are simple."""
    with _dir_fd(vol) as fd:
        flags = _quota_flags(fd)
        if flags is None:
            cmd = _QUOTA_ENABLE_SIMPLE if simple else _QUOTA_ENABLE
            fcntl.ioctl(fd, _QUOTA_CTL, bytearray(struct.pack("=QQ", cmd, 0)))
            flags = _quota_flags(fd)
        return bool((flags or 0) & _QGROUP_SIMPLE)


def _quota_flags(fd: int) -> int | None:
    """The quota status flags of the volume open at ``fd``; None while quotas are off."""
    try:
        status = _search_quota_tree(fd, _QGROUP_STATUS_KEY, 0)
    except FileNotFoundError:  # no quota tree
        return None
    return None if status is None else int(struct.unpack_from("=3Q", status)[2])


def create_subvolume(path: Path) -> None:
    with _dir_fd(path.parent) as fd:
        fcntl.ioctl(fd, _SUBVOL_CREATE, _vol_args(path.name))


def snapshot_subvolume(src: Path, dst: Path) -> None:
    """Make ``dst`` a btrfs snapshot of the subvolume ``src`` (sharing every block until either writes it)."""
    with _dir_fd(src) as sfd, _dir_fd(dst.parent) as pfd:
        args = _vol_args(dst.name)
        args[:8] = struct.pack("=q", sfd)
        fcntl.ioctl(pfd, _SNAP_CREATE, args)


def delete_subvolume(path: Path) -> None:
    """Delete the subvolume at ``path`` at once (the kernel frees its blocks behind)."""
    with _dir_fd(path.parent) as fd:
        fcntl.ioctl(fd, _SNAP_DESTROY, _vol_args(path.name))


def set_limit(path: Path, nbytes: int | None) -> None:
    """Limit what the subvolume at ``path`` refers to (its quota group's max_rfer); None lifts the limit."""
    with _dir_fd(path) as fd:
        args = struct.pack("=QQQQQQ", 0, _LIMIT_MAX_RFER, _CLEAR if nbytes is None else nbytes, 0, 0, 0)
        fcntl.ioctl(fd, _QGROUP_LIMIT, bytearray(args))


def is_subvolume(path: Path) -> bool:
    """True if ``path`` is the root folder of a btrfs subvolume."""
    try:
        st, parent = os.lstat(path), os.lstat(path.parent)
    except FileNotFoundError:
        return False
    return st.st_ino == _SUBVOL_INO and st.st_dev != parent.st_dev


def start_sync(path: Path) -> int:
    """Start a commit of the filesystem of ``path`` without waiting for it; its transaction id."""
    with _dir_fd(path) as fd:
        buf = bytearray(8)
        fcntl.ioctl(fd, _START_SYNC, buf)
        return int(struct.unpack("=Q", buf)[0])


def wait_sync(path: Path, transid: int) -> None:
    """Wait for the commit ``transid`` of the filesystem of ``path``."""
    with _dir_fd(path) as fd:
        fcntl.ioctl(fd, _WAIT_SYNC, bytearray(struct.pack("=Q", transid)))


def _search_quota_tree(fd: int, key_type: int, offset: int) -> bytes | None:
    """The one item (0, ``key_type``, ``offset``) of the quota tree, or None."""
    args = bytearray(_VOL_ARGS)
    _SEARCH_KEY.pack_into(args, 0, _QUOTA_TREE, 0, 0, offset, offset, 0, _CLEAR, key_type, key_type, 1, 0,
                          0, 0, 0, 0)
    fcntl.ioctl(fd, _TREE_SEARCH, args)
    if _SEARCH_KEY.unpack_from(args)[9] == 0:  # nr_items found
        return None
    _, objectid, found, kind, length = _SEARCH_HEADER.unpack_from(args, _SEARCH_KEY.size)
    if (objectid, found, kind) != (0, offset, key_type):
        return None
    start = _SEARCH_KEY.size + _SEARCH_HEADER.size
    return bytes(args[start:start + length])


def group_count(path: Path) -> tuple[int, bool] | None:
    """What the quota group of the subvolume at ``path`` counts (as of the last commit), and whether the volume's
    quotas are simple; None where the count is not exact now (quotas off, a rescan running, inconsistent) or
    btrfs refuses."""
    try:
        with _dir_fd(path) as fd:
            lookup = bytearray(_VOL_ARGS)
            struct.pack_into("=QQ", lookup, 0, 0, _SUBVOL_INO)
            fcntl.ioctl(fd, _INO_LOOKUP, lookup)
            subvol = struct.unpack_from("=Q", lookup)[0]
            flags = _quota_flags(fd)
            if flags is None or flags & _QGROUP_INEXACT:
                return None
            info = _search_quota_tree(fd, _QGROUP_INFO_KEY, subvol)
    except OSError:
        return None
    if info is None:
        return None
    return int(struct.unpack_from("=2Q", info)[1]), bool(flags & _QGROUP_SIMPLE)
