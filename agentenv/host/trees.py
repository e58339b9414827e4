"""Copying a folder tree (``copy_tree``), and deleting one without ever deleting through a mount inside it.

A sandbox's bundle holds mounts for moments: while its root is assembled, each image layer is bind-mounted (an
idmapped mount) under ``bundle/lower/<i>`` until the overlay over them is made. A start killed in that window, or a
close racing with one, leaves such a mount there, and ``shutil.rmtree`` of the bundle then walks into it and deletes
the *image's* layer files on the Docker host: every later sandbox of that image finds no ``python3``. Bind mounts of
one filesystem share its device number, so ``os.path.ismount`` and ``st_dev`` cannot see them; the kernel's mount
id can (``/proc/self/fdinfo``). ``remove_tree`` descends only through directories it has opened and found on the
tree's own mount, and works from those descriptors, so a mount made under a path after the check is never entered.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import subprocess
from pathlib import Path

from agentenv.errors import SandboxError
from agentenv.host.hostcalls import umount

log = logging.getLogger(__name__)
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def mount_id(fd: int) -> int:
    """The kernel's id of the mount an open file is on (Linux 3.15+)."""
    with open(f"/proc/self/fdinfo/{fd}") as f:
        for line in f:
            if line.startswith("mnt_id:"):
                return int(line.split()[1])
    raise OSError(f"no mnt_id in /proc/self/fdinfo/{fd}")


def remove_tree(path: Path) -> list[Path]:
    """Delete ``path`` and what is under it on its own mount; best effort, like ``rmtree(ignore_errors=True)``.
    A mount found inside is lazily unmounted and its mount point removed; one that cannot be is left, never
    entered, and returned (and logged)."""
    try:
        fd = os.open(path, _DIR)
    except FileNotFoundError:
        return []
    except OSError:  # a file or a symlink: not a tree
        with contextlib.suppress(OSError):
            os.unlink(path)
        return []
    kept: list[Path] = []
    try:
        _empty(fd, path, mount_id(fd), kept)
    finally:
        os.close(fd)
    with contextlib.suppress(OSError):
        os.rmdir(path)
    for m in kept:
        log.warning("left the mount %s in place: it is not deleted through (it may be an image's layer)", m)
    return kept


def _empty(fd: int, where: Path, mnt: int, kept: list[Path]) -> None:
    """Delete every entry of the open directory ``fd`` (at ``where``) that is on the mount ``mnt``."""
    with contextlib.suppress(OSError), os.scandir(fd) as it:
        entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
    for name, is_dir in entries:
        if not is_dir:
            _unlink(fd, name, where / name)
            continue
        child, foreign = _open_on(fd, name, where / name, mnt)
        if foreign:
            kept.append(where / name)
            continue
        if child is not None:
            try:
                _empty(child, where / name, mnt, kept)
            finally:
                os.close(child)
        with contextlib.suppress(OSError):
            os.rmdir(name, dir_fd=fd)


def _unlink(fd: int, name: str, path: Path) -> None:
    """Remove the file ``name``; one that is a mount point (a namespace bound to a file, say) is unmounted
    (lazily) first, which never reaches the file mounted there."""
    try:
        os.unlink(name, dir_fd=fd)
    except OSError as e:
        if e.errno != errno.EBUSY:
            return
        with contextlib.suppress(OSError):
            umount(path, lazy=True)
            os.unlink(name, dir_fd=fd)


def _open_on(fd: int, name: str, path: Path, mnt: int) -> tuple[int | None, bool]:
    """The child directory ``name`` opened if it is on the mount ``mnt``, and whether it is another mount (one
    found there is lazily unmounted first, once). (None, False) if it cannot be opened."""
    for attempt in range(2):
        try:
            child = os.open(name, _DIR, dir_fd=fd)
        except OSError:
            return None, False
        if mount_id(child) == mnt:
            return child, False
        os.close(child)
        if attempt == 0:
            with contextlib.suppress(OSError):
                umount(path, lazy=True)
    return None, True


def copy_tree(src: Path, dst: Path) -> None:
    """Copy a folder's content with owners, modes, xattrs and overlay whiteouts (``cp -a``)."""
    dst.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["cp", "-a", "--reflink=auto", f"{src}/.", str(dst)], capture_output=True, text=True,
                       check=False)
    if r.returncode != 0:
        msg = r.stderr.strip()
        if "No space left" in msg:
            raise OSError(errno.ENOSPC, f"no space left copying to {dst}: {msg}")
        if "quota exceeded" in msg.lower():
            raise OSError(errno.EDQUOT, f"disk quota exceeded copying to {dst}: {msg}")
        raise SandboxError(f"copying {src} failed: {msg}")
