"""What an imported snapshot's archive may hold: its members checked one by one as its bytes stream to tar, each
header before tar sees it (issue 40: an archive is whatever its sender, or a writer of the shared store, made).

An archive has two parts (``agentenv.snapshot.transfer``). ``Record``: the snapshot's record and CRIU's images, which
root unpacks as root's files. Regular files and folders only, named ``meta.json``, ``criu`` or below ``criu/`` (not
the folder they unpack in, whose mode is the receiver's), owned by 0, without a setuid, setgid or sticky bit.

``Files``: what the sandbox's overlay upper folder held, unpacked by a process of the snapshot's new uid range inside
that range's user namespace (so every owner is one of the range's ids, and the kernel refuses the rest too):

- regular files, folders, symbolic links (any target: it resolves inside the sandbox), hard links to a file earlier
  in the archive, FIFOs, and overlay's whiteouts (character device 0/0). No other device node: a sandbox cannot
  make one (it has no CAP_MKNOD, and its devices are the runtime's), so only an attacker sends one;
- names relative, without ``..``, and never below a symbolic link of the archive;
- owners 0..65535: the sandbox's own ids, unpacked as the new range's. A setuid or setgid file is then the sandbox's
  root's at most, which the sandbox itself can make (an image's ``sudo`` copied up); one of the host's root, or of
  any other host id, cannot be written, and an id past 65535 is refused;
- extended attributes: ``user.*``; ``security.capability`` (written inside the namespace, the kernel ties the
  capabilities to the range's root: none hold on the host); ``trusted.overlay.opaque`` = ``y`` on a folder (root
  sets it after the unpack: ``opaque``); overlay's records of the sender's own layers (``trusted.overlay.origin``,
  ``impure``, ``uuid``: handles of the sender's filesystems, which overlay makes again here), not carried. Nothing
  else.

Both: the POSIX format GNU tar writes (ustar headers and pax extended headers), ending in two zero blocks and zero
padding. GNU long names, old GNU sparse headers, global headers, pax records tar would act on that agentenv never
writes, and anything after the end are refused.
"""

from __future__ import annotations

import tarfile
from dataclasses import dataclass, field

from agentenv.errors import UntrustedSnapshot

BLOCK = 512
MAX_PAX = 1 << 20  # bytes of one pax extended header
IDS = 1 << 16  # the sandbox's ids: 0..65535 (agentenv.host.userns.SIZE)
OPAQUE = "trusted.overlay.opaque"
_DROPPED = frozenset({"trusted.overlay.origin", "trusted.overlay.impure", "trusted.overlay.uuid"})
_PAX = frozenset({"path", "linkpath", "size", "uid", "gid", "uname", "gname", "mtime", "atime", "ctime",
                  "hdrcharset", "charset", "comment"})
_REG, _AREG, _LNK, _SYM, _CHR, _BLK, _DIR, _FIFO = (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.LNKTYPE,
                                                    tarfile.SYMTYPE, tarfile.CHRTYPE, tarfile.BLKTYPE,
                                                    tarfile.DIRTYPE, tarfile.FIFOTYPE)
_KINDS = {_REG: "file", _AREG: "file", _LNK: "hard link", _SYM: "symbolic link", _CHR: "character device",
          _BLK: "block device", _DIR: "folder", _FIFO: "FIFO"}
_FIX = ("an agentenv server never packs that: the archive was made or changed by someone else; take the snapshot "
        "again on a server that has it")


@dataclass
class Member:
    """One member of the archive, its pax records applied."""

    name: str
    kind: bytes
    mode: int
    uid: int
    gid: int
    size: int
    link: str
    dev: tuple[int, int]
    xattrs: dict[str, bytes] = field(default_factory=dict)


class Archive:
    """A tar stream fed in pieces (``feed``, then ``close``), parsed header by header: ``member`` judges each one."""

    part = "archive"

    def __init__(self, snapshot_id: str) -> None:
        self.sid = snapshot_id
        self._carry = b""  # an incomplete header (or pax header) waiting for the next piece
        self._skip = 0  # bytes of the current member's data still to pass
        self._pax: dict[str, bytes] = {}
        self._zeros = 0  # zero blocks in a row: two end the archive

    def refuse(self, what: str) -> UntrustedSnapshot:
        return UntrustedSnapshot(f"the {self.part} of snapshot {self.sid} holds {what}; it was refused and nothing "
                                 "was kept", fix=_FIX)

    def member(self, m: Member) -> None:
        raise NotImplementedError

    def feed(self, data: bytes) -> None:
        """Check the next bytes of the stream; UntrustedSnapshot at the first member refused (before the caller
        hands tar the piece that completes its header)."""
        buf = self._carry + data if self._carry else data
        pos, end = 0, len(buf)
        while pos < end:
            if self._skip:
                n = min(self._skip, end - pos)
                pos, self._skip = pos + n, self._skip - n
                continue
            if self._zeros == 2:
                if buf[pos:].strip(b"\0"):
                    raise self.refuse("data after the archive's end")
                pos = end
                break
            if end - pos < BLOCK:
                break
            block = buf[pos:pos + BLOCK]
            if not block.strip(b"\0"):
                self._zeros, pos = self._zeros + 1, pos + BLOCK
                continue
            if self._zeros:
                raise self.refuse("a lone zero block amid its members")
            used = self._header(block, buf, pos, end)
            if used == 0:
                break  # a pax header whose records are not all here yet
            pos += used
        self._carry = buf[pos:]

    def _header(self, block: bytes, buf: bytes, pos: int, end: int) -> int:
        """Take the header at ``pos``: bytes used (0: wait for more); its data is skipped after."""
        try:
            info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
        except tarfile.HeaderError as e:
            raise self.refuse(f"a header tar cannot read ({e})") from None
        if info.type == tarfile.XHDTYPE:
            if info.size > MAX_PAX:
                raise self.refuse(f"a pax header of {info.size} bytes")
            used = BLOCK + _padded(info.size)
            if end - pos < used:
                return 0
            self._pax.update(self._records(buf[pos + BLOCK:pos + BLOCK + info.size]))
            return used
        m = self._apply(info)
        self._pax = {}
        self.member(m)
        self._skip = _padded(m.size)
        return BLOCK

    def _records(self, data: bytes) -> dict[str, bytes]:
        """A pax header's records ("<length> <key>=<value>\\n")."""
        out: dict[str, bytes] = {}
        pos = 0
        while pos < len(data):
            space = data.find(b" ", pos)
            try:
                length = int(data[pos:space]) if space > pos else 0
            except ValueError:
                length = 0
            record = data[space + 1:pos + length] if length > space - pos + 1 else b""
            key, eq, value = record[:-1].partition(b"=")
            if not record.endswith(b"\n") or not eq:
                raise self.refuse("a malformed pax header")
            out[key.decode("utf-8", "surrogateescape")] = value
            pos += length
        return out

    def _apply(self, info: tarfile.TarInfo) -> Member:
        """The member a header stands for, with the pax records before it (refused: one tar acts on that agentenv
        never writes)."""
        pax, xattrs = self._pax, {}
        for key, value in pax.items():
            if key.startswith("SCHILY.xattr."):
                xattrs[key.removeprefix("SCHILY.xattr.")] = value
            elif key not in _PAX and not key.startswith("GNU.sparse."):
                raise self.refuse(f"a pax record {key!r}")

        def text(key: str, default: str) -> str:
            return pax[key].decode("utf-8", "surrogateescape") if key in pax else default

        def number(key: str, default: int) -> int:
            try:
                return int(pax[key]) if key in pax else default
            except ValueError:
                raise self.refuse(f"a pax record {key}={pax[key]!r}") from None

        name = text("GNU.sparse.name", text("path", info.name))
        return Member(name=name, kind=info.type, mode=info.mode, uid=number("uid", info.uid),
                      gid=number("gid", info.gid), size=number("size", info.size), link=text("linkpath", info.linkname),
                      dev=(info.devmajor, info.devminor), xattrs=xattrs)

    def close(self) -> None:
        """UntrustedSnapshot unless the stream ended as a complete archive."""
        if self._zeros < 2 or self._skip or self._carry.strip(b"\0"):
            raise self.refuse("no end: it stops inside a member")

    def path(self, m: Member, name: str | None = None) -> tuple[str, ...]:
        """A member's name (or ``name``) as its parts below the folder it unpacks in: relative, without '..'."""
        text = m.name if name is None else name
        if text.startswith("/"):
            raise self.refuse(f"an absolute name {text!r}")
        parts = tuple(p for p in text.split("/") if p not in ("", "."))
        if ".." in parts:
            raise self.refuse(f"a name going up a folder {text!r}")
        if m.mode & ~0o7777 or m.size < 0:
            raise self.refuse(f"{text!r} with a mode or size tar cannot mean")
        return parts


def _padded(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


class Record(Archive):
    """The record part: meta.json and CRIU's images (see the module doc)."""

    part = "record"

    def member(self, m: Member) -> None:
        parts = self.path(m)
        kind = _REG if m.kind == _AREG else m.kind
        # not the folder itself: its mode is the receiver's to set
        where = parts == ("meta.json",) and kind == _REG or parts[:1] == ("criu",)
        if kind not in (_REG, _DIR) or not where:
            raise self.refuse(f"a {_KINDS.get(kind, 'member of type ' + repr(kind))} {m.name!r}: only meta.json and "
                              "CRIU's images (files and folders) belong there")
        if m.mode & 0o7000 or (m.uid, m.gid) != (0, 0) or m.xattrs:
            raise self.refuse(f"{m.name!r} with a setuid, setgid or sticky bit, an owner or extended attributes "
                              "(the record's files are the server's own)")


class Files(Archive):
    """The sandbox's files (see the module doc); ``opaque``: the folders overlay must see as opaque."""

    part = "files"

    def __init__(self, snapshot_id: str) -> None:
        super().__init__(snapshot_id)
        self.opaque: list[tuple[str, ...]] = []
        self._files: set[tuple[str, ...]] = set()  # regular files so far: what a hard link may name
        self._links: set[tuple[str, ...]] = set()  # symbolic links so far: nothing may go below one

    def member(self, m: Member) -> None:
        parts = self.path(m)
        kind = _REG if m.kind == _AREG else m.kind
        if kind == _CHR and m.dev != (0, 0) or kind == _BLK:
            raise self.refuse(f"a device node {m.name!r} ({m.dev[0]}:{m.dev[1]}): a sandbox cannot make one")
        if kind not in (_REG, _DIR, _SYM, _LNK, _FIFO, _CHR) or not parts and kind != _DIR:
            raise self.refuse(f"a member {m.name!r} of type {kind!r}, which a sandbox's files never hold")
        if not (0 <= m.uid < IDS and 0 <= m.gid < IDS):
            raise self.refuse(f"{m.name!r} whose owner {m.uid}:{m.gid} is none of the sandbox's ids (0..{IDS - 1})")
        self._below_link(parts, m.name)
        if kind == _LNK:
            target = self.path(m, m.link)
            self._below_link(target, m.link)
            if target not in self._files:
                raise self.refuse(f"a hard link {m.name!r} to {m.link!r}, which is no file earlier in the archive")
        elif kind != _REG and m.size:
            raise self.refuse(f"a {_KINDS[kind]} {m.name!r} with data")
        for key, value in m.xattrs.items():
            if key == OPAQUE and value == b"y" and kind == _DIR:
                self.opaque.append(parts)
            elif not (key.startswith("user.") or key == "security.capability" or key in _DROPPED):
                raise self.refuse(f"{m.name!r} with the extended attribute {key!r}")
        (self._files.add if kind == _REG else self._files.discard)(parts)
        if kind == _SYM:
            self._links.add(parts)

    def _below_link(self, parts: tuple[str, ...], name: str) -> None:
        if any(parts[:i] in self._links for i in range(1, len(parts))):
            raise self.refuse(f"{name!r} below a symbolic link of the archive")
