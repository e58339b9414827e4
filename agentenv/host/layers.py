"""A sandbox's files as a Docker image: its overlay upper folder made a layer, and ``docker load`` of an image
that is a base image plus that layer (how a template built in agentenv's own sandboxes becomes an image that
``images.resolve`` and every sandbox can use).

The layer (``write_layer``) is the upper folder of a stopped sandbox (a snapshot's copy of it, which no process
writes), walked by file descriptors without following a link, as a tar in the form Docker's layers take: owners
mapped back from the sandbox's uid range to the image's ids, overlay whiteouts (0:0 character devices) as
``.wh.NAME`` files and opaque folders (``trusted.overlay.opaque``) with a ``.wh..wh..opq`` file, hard links as
links. The keeper's own mount point (``/.agentenv``) is left out, and so are sockets (as Docker does); a name
Docker would take for a whiteout, a device node, or an owner outside the range is refused.

The image (``load``): a ``docker load`` archive of ``manifest.json``, the image config (the base's, with the
given env, working folder, user and labels, ``rootfs.diff_ids`` the base's plus the layer's) and only the new
layer's tar: for every layer it already has (by chain id), the engine reads nothing (moby's
``image/tarexport/load.go``), so the base's layers are named but never sent.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

from agentenv.errors import AgentEnvError
from agentenv.host import images
from agentenv.host.keeper_start import KEEPER_DEST

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
_SKIPPED = {KEEPER_DEST.strip("/").split("/")[0]}  # top-level names that are the runtime's, not the sandbox's
_OVERLAY_PARAMS = Path("/sys/module/overlay/parameters")


class LayerError(AgentEnvError):
    """The sandbox's files cannot be made a layer (the message names the file and why)."""


@dataclass(frozen=True)
class Layer:
    """A layer tar on disk: its path, its diff id (``sha256:`` of the tar) and how many entries it holds."""

    path: Path
    diff_id: str
    entries: int


class _Hashing:
    """A write-only file that hashes what goes through it."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f, self.sha = f, hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        return self.f.write(data)


def _check_overlay() -> None:
    """Refuse a host whose overlayfs keeps metadata-only copies or redirects (their upper folder is not the files)."""
    for name in ("metacopy", "redirect_dir"):
        try:
            value = (_OVERLAY_PARAMS / name).read_text().strip()
        except OSError:
            continue
        if value not in ("N", "off", "nofollow"):
            raise LayerError(f"this host's overlayfs has {name}={value}: a sandbox's upper folder then does not hold "
                             "its files whole, so it cannot be made an image layer",
                             fix=f"load the overlay module with {name}=off (modprobe overlay {name}=N)")


@dataclass
class _Entry:
    """A tar entry of the layer; a regular file's open descriptor (the writer closes it) and inode, when it has
    more names than one (a hard link's later names are written as links)."""

    info: tarfile.TarInfo
    fd: int | None = None
    inode: int | None = None


def _entries(top: int, prefix: str, uids: int, size: int) -> Iterator[_Entry]:
    """The entries under the folder ``top`` (an open descriptor), in name order."""
    for name in sorted(os.listdir(top)):
        path = prefix + name
        if not prefix and name in _SKIPPED:
            continue
        if name.startswith(WHITEOUT):
            raise LayerError(f"/{path}: a file named {WHITEOUT}* would be read as a deletion in an image layer",
                             fix="rename or remove it in a build step")
        st = os.stat(name, dir_fd=top, follow_symlinks=False)
        info = tarfile.TarInfo(path)
        info.mtime, info.mode = int(st.st_mtime), stat.S_IMODE(st.st_mode)
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:  # an overlay whiteout: the name was deleted
            white = tarfile.TarInfo(prefix + WHITEOUT + name)
            white.mtime = info.mtime
            yield _Entry(white)
            continue
        if not uids <= st.st_uid < uids + size or not uids <= st.st_gid < uids + size:
            raise LayerError(f"/{path} is owned by host ids {st.st_uid}:{st.st_gid}, outside the sandbox's range")
        info.uid, info.gid = st.st_uid - uids, st.st_gid - uids
        if stat.S_ISDIR(st.st_mode):
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=top)
            try:
                info.type = tarfile.DIRTYPE
                yield _Entry(info)
                try:
                    opaque = os.getxattr(fd, "trusted.overlay.opaque") == b"y"
                except OSError:
                    opaque = False
                if opaque:  # the folder replaced one of a lower layer: nothing below shows through
                    white = tarfile.TarInfo(f"{path}/{OPAQUE}")
                    white.mtime = info.mtime
                    yield _Entry(white)
                yield from _entries(fd, path + "/", uids, size)
            finally:
                os.close(fd)
        elif stat.S_ISREG(st.st_mode):
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=top)
            info.size = os.fstat(fd).st_size
            yield _Entry(info, fd, st.st_ino if st.st_nlink > 1 else None)
        elif stat.S_ISLNK(st.st_mode):
            info.type, info.linkname = tarfile.SYMTYPE, os.readlink(name, dir_fd=top)
            yield _Entry(info)
        elif stat.S_ISFIFO(st.st_mode):
            info.type = tarfile.FIFOTYPE
            yield _Entry(info)
        elif not stat.S_ISSOCK(st.st_mode):  # a socket means nothing in an image (Docker leaves them out too)
            raise LayerError(f"/{path} is a device node: an image layer made from a sandbox holds none")


def write_layer(upper: Path, uids: int, size: int, dest: Path, limit: int | None = None) -> Layer:
    """The layer tar of the sandbox files in ``upper`` (whose root is host uid ``uids``, for ``size`` ids) at
    ``dest``; LayerError once its files hold more than ``limit`` bytes (a sparse file counts whole: a layer
    holds every byte of it)."""
    _check_overlay()
    first: dict[int, str] = {}  # inode -> the name it was first written under (later names are hard links)
    count = total = 0
    top = os.open(upper, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        with open(dest, "wb") as raw:
            out = _Hashing(raw)
            with tarfile.open(fileobj=cast(IO[bytes], out), mode="w|", format=tarfile.PAX_FORMAT) as tar:
                for entry in _entries(top, "", uids, size):
                    count += 1
                    info, fd = entry.info, entry.fd
                    if fd is None:
                        tar.addfile(info)
                        continue
                    try:
                        if entry.inode is not None and entry.inode in first:
                            info.type, info.linkname, info.size = tarfile.LNKTYPE, first[entry.inode], 0
                            tar.addfile(info)
                        else:
                            if entry.inode is not None:
                                first[entry.inode] = info.name
                            total += info.size
                            if limit is not None and total > limit:
                                raise LayerError(f"the build's files hold more than {limit} bytes, its disk limit "
                                                 "(a sparse file counts whole in an image layer)",
                                                 fix="remove what the image does not need in the build's steps")
                            with os.fdopen(os.dup(fd), "rb") as data:
                                tar.addfile(info, data)
                    finally:
                        os.close(fd)
    finally:
        os.close(top)
    return Layer(dest, "sha256:" + out.sha.hexdigest(), count)


def load(base: str, layer: Layer | None, tag: str, *, env: list[str], workdir: str, user: str | None,
         labels: dict[str, str], history: str) -> str:
    """``docker load`` the image ``tag``: ``base`` plus ``layer`` (None: no files changed), its config's env,
    working folder, user (None: the base's) and labels replaced; its image id."""
    attrs = images.inspect(base)
    config: dict[str, Any] = dict(attrs.get("Config") or {})
    config.update(Env=env, WorkingDir=workdir, Labels={**(config.get("Labels") or {}), **labels})
    if user is not None:
        config["User"] = user
    diff_ids = list((attrs.get("RootFS") or {}).get("Layers") or [])
    if layer is not None:
        diff_ids.append(layer.diff_id)
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    image = {"architecture": attrs.get("Architecture") or "amd64", "os": attrs.get("Os") or "linux",
             "created": now, "config": config, "rootfs": {"type": "layers", "diff_ids": diff_ids},
             "history": [{"created": now, "created_by": history, "empty_layer": layer is None}]}
    if attrs.get("Variant"):
        image["variant"] = attrs["Variant"]
    blob = json.dumps(image, sort_keys=True).encode()
    name = hashlib.sha256(blob).hexdigest() + ".json"
    paths = [f"base-{i}/layer.tar" for i in range(len(diff_ids) - (layer is not None))]  # never read (see above)
    if layer is not None:
        paths.append("layer/layer.tar")
    manifest = json.dumps([{"Config": name, "RepoTags": [tag], "Layers": paths}]).encode()
    with tempfile.TemporaryFile(dir=layer.path.parent if layer else None) as f:
        with tarfile.open(fileobj=f, mode="w") as archive:
            for member, data in ((name, blob), ("manifest.json", manifest)):
                info = tarfile.TarInfo(member)
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
            if layer is not None:
                archive.add(layer.path, arcname="layer/layer.tar")
        f.seek(0)
        return images.load(f, tag)

