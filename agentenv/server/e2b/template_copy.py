"""A template's COPY step: what of the SDK's upload it copies, as a tar that a process inside the build sandbox
places (``agentenv.inside.unpack``). Nothing of the upload is ever unpacked on the host.

The upload is checked first (``agentenv.host.archives``: no device, no name out of it, no hard link but to one of
its own files; its symlinks are kept as written, since they resolve inside the sandbox). The step's ``src`` is
matched against the upload's members, as Docker's COPY matches its context: a folder copies its contents into the
destination, a file is copied by its name; a glob (``*``, ``?``, ``[...]``, per path part; ``**`` for any number
of parts) copies every match so, into the destination as a folder. The tar names the files relative to the
destination, owners 0 (the step's user is applied inside, from the image's accounts), the step's mode on its
files, and every hard link made a file of its own. What it holds is bounded by the build's disk limit before a
byte of it is written: a hard link made a file, or a compressed upload, could otherwise fill the host's disk with
a small archive.
"""

from __future__ import annotations

import copy
import fnmatch
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from agentenv.host import archives


class NothingToCopy(LookupError):
    """The step's ``src`` matches nothing in its upload."""


class TooLarge(ValueError):
    """What a COPY step would place is more than the build's disk may hold."""


@dataclass(frozen=True)
class Selection:
    """What a COPY step writes: ``members`` (archive member, name under the destination) and whether it is one
    file (``single``: the destination may be its path) or the contents of a folder or of glob matches."""

    members: list[tuple[tarfile.TarInfo, str]]
    single: bool


def is_glob(src: str) -> bool:
    return any(c in src for c in "*?[")


def _matches(pattern: list[str], name: list[str]) -> bool:
    """Whether the path parts ``name`` match the glob parts ``pattern`` (``**``: any number of parts)."""
    if not pattern:
        return not name
    if pattern[0] == "**":
        return any(_matches(pattern[1:], name[i:]) for i in range(len(name) + 1))
    return bool(name) and fnmatch.fnmatchcase(name[0], pattern[0]) and _matches(pattern[1:], name[1:])


def select(members: list[tarfile.TarInfo], src: str) -> Selection:
    """The members a COPY of ``src`` takes from the (checked) upload ``members``; NothingToCopy if none."""
    by_name = {archives.normal(m.name): m for m in members}
    names = list(by_name)
    want = "/".join(p for p in src.split("/") if p not in ("", "."))

    def contents(folder: str) -> list[tuple[tarfile.TarInfo, str]]:
        prefix = folder + "/" if folder else ""
        return [(by_name[n], n[len(prefix):]) for n in names if n.startswith(prefix) and n != folder]

    if is_glob(want):
        pattern = want.split("/")
        found = sorted(n for n in names if _matches(pattern, n.split("/")))
        taken: list[tuple[tarfile.TarInfo, str]] = []
        for n in found:
            inner = contents(n)
            taken += inner if by_name[n].isdir() or inner else [(by_name[n], n.rsplit("/", 1)[-1])]
        if not found:
            raise NothingToCopy(f"no files match '{src}'")
        return Selection(taken, single=False)
    inner = contents(want)
    if not want or inner or (want in by_name and by_name[want].isdir()):
        return Selection(inner, single=False)
    if want in by_name:
        return Selection([(by_name[want], want.rsplit("/", 1)[-1])], single=True)
    raise NothingToCopy(f"'{src}' is not in the files uploaded for it")


def write(upload: Path, src: str, mode: int | None, out: IO[bytes], limit: int) -> bool:
    """Write to ``out`` the tar that places what a COPY of ``src`` takes from the archive ``upload`` (the step's
    ``mode`` on its files); returns whether it is a single file. UnsafeArchive, NothingToCopy, and TooLarge when
    its files hold more than ``limit`` bytes (the build's disk), found before anything is written."""
    with tarfile.open(upload) as tar:
        members = archives.checked(tar, outward_symlinks=True)
        files = {archives.normal(m.name): m for m in members if m.isreg()}
        chosen = select(members, src)
        size = sum(files[archives.normal(m.linkname)].size if m.islnk() else m.size
                   for m, _ in chosen.members if m.isreg() or m.islnk())
        if size > limit:
            raise TooLarge(f"its files hold {size} bytes (hard links counted as the copies they become), more than "
                           f"the build's disk of {limit} bytes")
        with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as placed:
            for member, name in chosen.members:
                m = copy.copy(member)
                m.name, m.uid, m.gid, m.uname, m.gname, m.pax_headers = name, 0, 0, "", "", {}
                data = None
                if member.isreg() or member.islnk():  # a hard link becomes a file holding its target's bytes
                    source = files[archives.normal(member.linkname)] if member.islnk() else member
                    data, m.size = tar.extractfile(source), source.size
                    m.type, m.linkname, m.sparse = tarfile.REGTYPE, "", None
                    if mode is not None:
                        m.mode = mode
                placed.addfile(m, data)
    return chosen.single
