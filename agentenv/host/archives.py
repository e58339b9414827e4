"""Archives from outside (template uploads, sdists, ``git archive`` output) checked member by member before
anything of them is unpacked: rules of our own, the same on every Python (Debian 12's 3.11.2 has no ``tarfile``
extraction filters, and the ``tar`` filter of later ones lets a hard link reach any host file).

A member may be a regular file, a folder, a symlink, or a hard link to an earlier regular file of the same
archive. ``checked`` refuses, with ``UnsafeArchive`` naming the member:

- absolute names and names with a ``..`` part (nothing lands outside the folder it is unpacked in);
- device nodes, fifos and every other kind of member;
- hard links to anything but an earlier regular file of the archive (a link to a host file reads, writes and
  chmods that file when unpacked as root);
- members below a symlink of the archive, and a name given twice where one of them is a link (the second would
  be written through the first);
- symlinks whose target leaves the archive (absolute, or climbing out through ``..`` and the archive's own
  symlinks), unless the caller unpacks where a link cannot reach the host (``outward_symlinks``: a template's
  files are unpacked inside its build sandbox, whose root is all a link there can name, and E2B copies such
  links as they are).

``extract`` unpacks the checked members on the host as the caller's own files: owners are never taken from the
archive, and setuid, setgid, sticky and group/other write bits are dropped.
"""

from __future__ import annotations

import copy
import os
import tarfile
from collections import deque
from pathlib import Path

from agentenv.errors import AgentEnvError

MAX_HOPS = 40  # symlinks followed at most while resolving one target (the kernel's limit)
_FIX = ("make the archive of plain files, folders and links that stay inside it (no absolute or '..' names, no "
        "devices or fifos, hard links only to files of the archive)")


class UnsafeArchive(AgentEnvError, ValueError):
    """An archive member that is refused; ``member`` is its name as the archive gives it."""

    def __init__(self, member: str, why: str, fix: str = _FIX) -> None:
        self.member = member
        super().__init__(f"the archive's member {member!r} {why}", fix=fix)


def normal(name: str, member: str | None = None, what: str = "its name") -> str:
    """``name`` normalised (no ``.`` parts, no trailing slash), as ``checked`` compares names; UnsafeArchive (naming
    ``member``, else ``name``) for an absolute or ``..`` one."""
    member = name if member is None else member
    if not name or "\0" in name:
        raise UnsafeArchive(member, f"has an empty or NUL-holding {what}")
    if name.startswith("/"):
        raise UnsafeArchive(member, f"has an absolute {what} ({name!r}): it would land outside the folder")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise UnsafeArchive(member, f"has a '..' in {what} ({name!r}): it would land outside the folder")
    return "/".join(parts)


def _inside(name: str, target: str, symlinks: dict[str, str]) -> bool:
    """Whether the symlink ``name`` -> ``target`` resolves inside the archive's folder, through the archive's own
    symlinks (``symlinks``: normalised name -> target) as the kernel would once they are all unpacked."""
    if target.startswith("/"):
        return False
    todo = deque(name.split("/")[:-1] + target.split("/"))
    resolved: list[str] = []
    hops = 0
    while todo:
        part = todo.popleft()
        if part in ("", "."):
            continue
        if part == "..":
            if not resolved:
                return False
            resolved.pop()
            continue
        resolved.append(part)
        link = symlinks.get("/".join(resolved))
        if link is not None:
            hops += 1
            if hops > MAX_HOPS or link.startswith("/"):
                return False
            resolved.pop()
            todo.extendleft(reversed(link.split("/")))
    return True


def checked(tar: tarfile.TarFile, *, outward_symlinks: bool = False) -> list[tarfile.TarInfo]:
    """Every member of ``tar``, in order, once each passed the rules above; UnsafeArchive names the first that
    does not."""
    members = tar.getmembers()
    names = [normal(m.name) for m in members]
    symlinks = {n: m.linkname for n, m in zip(names, members, strict=True) if m.issym()}
    seen: dict[str, tarfile.TarInfo] = {}
    for name, m in zip(names, members, strict=True):
        if m.ischr() or m.isblk() or m.isfifo():
            raise UnsafeArchive(m.name, "is a device node or fifo: only files, folders and links are unpacked")
        if not (m.isreg() or m.isdir() or m.issym() or m.islnk()):
            raise UnsafeArchive(m.name, f"is of a kind that is not unpacked (tar type {m.type!r})")
        parts = name.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in symlinks:
                raise UnsafeArchive(m.name, f"lies below {'/'.join(parts[:i])!r}, a symlink of the archive: it "
                                            "would be written wherever that link points")
        earlier = seen.get(name)
        if earlier is not None and not ((earlier.isreg() and m.isreg()) or (earlier.isdir() and m.isdir())):
            raise UnsafeArchive(m.name, "is given twice, once as a link or as another kind of member: the second "
                                        "would be written through the first")
        if m.islnk():
            target = normal(m.linkname, m.name, "hard link target")
            if target not in seen or not seen[target].isreg():
                raise UnsafeArchive(m.name, f"is a hard link to {m.linkname!r}, which is not an earlier file of the "
                                            "archive: a hard link may only join two files of the archive")
        if m.issym() and not outward_symlinks and not _inside(name, m.linkname, symlinks):
            raise UnsafeArchive(m.name, f"is a symlink to {m.linkname!r}, which leaves the archive",
                                fix="make the link relative and inside the archive, or leave it out")
        seen[name] = m
    return members


def _as_ours(member: tarfile.TarInfo) -> tarfile.TarInfo:
    """A copy of ``member`` owned by this process, without setuid, setgid, sticky or group/other write bits."""
    m = copy.copy(member)
    m.uid, m.gid, m.uname, m.gname = os.getuid(), os.getgid(), "", ""
    m.mode = member.mode & 0o755
    return m


def _as_checked(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo:
    """The extraction filter of Pythons that have them: the members were checked already (``checked``)."""
    return member


def extract(tar: tarfile.TarFile, dest: Path, *, outward_symlinks: bool = False) -> None:
    """Unpack ``tar`` into the new (or empty) folder ``dest`` once every member passed ``checked``; the files are
    this process's own (see the module docstring)."""
    members = [_as_ours(m) for m in checked(tar, outward_symlinks=outward_symlinks)]
    dest.mkdir(parents=True, exist_ok=True)
    if any(dest.iterdir()):
        raise ValueError(f"{dest} is not empty: an archive is unpacked into a folder of its own")
    tar.extraction_filter = _as_checked  # 3.12+ (and 3.11.4+): ours, the members being checked; 3.11.2 has none
    tar.extractall(dest, members=members, numeric_owner=True)
