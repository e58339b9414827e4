"""The member checks of an imported archive (``agentenv.snapshot.tarcheck``), without Docker: what GNU tar packs of a
sandbox's files passes, in pieces of any size; each thing only an attacker sends is refused, naming the member,
at the byte that completes its header (so tar, fed after the check, never gets all of it)."""

from __future__ import annotations

import io
import os
import stat
import subprocess
import tarfile
from pathlib import Path

import pytest

from agentenv.errors import UntrustedSnapshot
from agentenv.snapshot import tarcheck


def gnu_tar(folder: Path) -> bytes:
    """``folder`` packed as the sending server packs a sandbox's files."""
    return subprocess.run(["tar", "--create", "--file=-", "--format=posix", "--sparse", "--numeric-owner", "--xattrs",
                           "--xattrs-include=*", "-C", str(folder), "."], capture_output=True, check=True).stdout


def feed(check: tarcheck.Archive, data: bytes, piece: int) -> None:
    for i in range(0, len(data), piece):
        check.feed(data[i:i + piece])
    check.close()


def test_what_a_sandbox_can_have_in_its_files_passes_in_pieces_of_any_size(tmp_path):
    root = tmp_path / "upper"
    (root / "usr/share/doc").mkdir(parents=True)
    (root / "usr/share/doc/new").write_text("x")
    (root / "etc").mkdir()
    (root / "etc/passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    os.link(root / "etc/passwd", root / "etc/passwd-")
    (root / "bin").mkdir()
    (root / "bin/sudo").write_bytes(b"\x7fELF")
    os.chmod(root / "bin/sudo", 0o4755)  # the sandbox's root's setuid file: it may have one
    os.symlink("/etc/passwd", root / "link")  # absolute: it resolves inside the sandbox
    os.mkfifo(root / "fifo")
    os.mknod(root / "opt", stat.S_IFCHR | 0o000, 0)  # overlay's whiteout
    os.setxattr(root / "usr/share/doc", "trusted.overlay.opaque", b"y")
    os.setxattr(root / "usr", "trusted.overlay.origin", b"\x00\xfb")  # the sender's layers: not carried
    os.setxattr(root / "etc/passwd", "user.note", b"kept")
    with open(root / "sparse", "wb") as f:
        f.truncate(1 << 20)
        f.write(b"end")
    data = gnu_tar(root)
    for piece in (1, 511, 512, 4096, len(data)):
        check = tarcheck.Files("snap-x")
        feed(check, data, piece)
        assert check.opaque == [("usr", "share", "doc")]


def member(name: str, kind: bytes = tarfile.REGTYPE, *, mode: int = 0o644, uid: int = 0, link: str = "",
           dev: tuple[int, int] = (0, 0), pax: dict[str, str] | None = None) -> tarfile.TarInfo:
    m = tarfile.TarInfo(name)
    m.type, m.mode, m.uid, m.gid, m.linkname = kind, mode, uid, uid, link
    m.devmajor, m.devminor = dev
    m.pax_headers = pax or {}
    return m


def archive(members: list[tarfile.TarInfo], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as t:
        for m in members:
            t.addfile(m, io.BytesIO(b"") if m.isreg() else None)
    return out.getvalue()


FILES_REFUSED = {
    "device node": ([member("./dev/mem", tarfile.CHRTYPE, dev=(1, 1))], "device node"),
    "block device": ([member("./sda", tarfile.BLKTYPE, dev=(8, 0))], "device node"),
    "owner outside": ([member("./far", mode=0o4755, uid=70_000)], "owner 70000"),
    "absolute name": ([member("/etc/shadow")], "absolute"),
    "up a folder": ([member("./a/../../etc/shadow")], "going up"),
    "hard link out": ([member("./x", tarfile.LNKTYPE, link="../../etc/shadow")], "going up"),
    "hard link to nothing": ([member("./x", tarfile.LNKTYPE, link="etc/shadow")], "no file earlier"),
    "below a link": ([member("./l", tarfile.SYMTYPE, link="/etc"), member("./l/shadow")], "below a symbolic link"),
    "hard link below a link": ([member("./f"), member("./l", tarfile.SYMTYPE, link="/"),
                                member("./x", tarfile.LNKTYPE, link="l/f")], "below a symbolic link"),
    "trusted attribute": ([member("./d", tarfile.DIRTYPE, mode=0o755,
                                  pax={"SCHILY.xattr.trusted.overlay.redirect": "/etc"})], "trusted.overlay.redirect"),
    "opaque file": ([member("./f", pax={"SCHILY.xattr.trusted.overlay.opaque": "y"})], "trusted.overlay.opaque"),
    "selinux label": ([member("./f", pax={"SCHILY.xattr.security.selinux": "x"})], "security.selinux"),
    "unknown pax record": ([member("./f", pax={"SCHILY.acl.access": "user::rwx"})], "SCHILY.acl.access"),
    "long gnu name": ([member("./" + "n" * 200)], "type"),
}


@pytest.mark.parametrize("what", list(FILES_REFUSED))
def test_what_only_an_attacker_sends_is_refused_at_its_header(what):
    members, says = FILES_REFUSED[what]
    data = archive(members, tarfile.GNU_FORMAT if what == "long gnu name" else tarfile.PAX_FORMAT)
    check = tarcheck.Files("snap-x")
    fed = 0
    with pytest.raises(UntrustedSnapshot, match=says) as e:
        for i in range(len(data)):
            check.feed(data[i:i + 1])
            fed += 1
        check.close()
    assert "files of snapshot snap-x" in str(e.value) and "nothing was kept" in str(e.value)
    assert fed % 512 == 511  # refused on the last byte of a header block: tar never had the whole header


def test_an_archive_cut_short_or_with_data_after_its_end_is_refused():
    data = archive([member("./f")])
    check = tarcheck.Files("snap-x")
    check.feed(data[:700])
    with pytest.raises(UntrustedSnapshot, match="no end"):
        check.close()
    with pytest.raises(UntrustedSnapshot, match="after the archive's end"):
        tarcheck.Files("snap-x").feed(data + b"more")
    out = io.BytesIO()  # a pax global header, which tar applies to every member after it
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT, pax_headers={"comment": "all"}) as t:
        t.addfile(member("./g"), io.BytesIO(b""))
    with pytest.raises(UntrustedSnapshot, match="of type b'g'"):
        feed(tarcheck.Files("snap-x"), out.getvalue(), 512)


RECORD_REFUSED = {
    "a symbolic link": member("./criu/x", tarfile.SYMTYPE, link="/etc/shadow"),
    "a name outside": member("./uids"),
    "a setuid record": member("./meta.json", mode=0o4755),
    "an owner": member("./criu/core-1.img", uid=1000),
    "a device": member("./criu/null", tarfile.CHRTYPE, dev=(1, 3)),
    "the folder itself": member(".", tarfile.DIRTYPE, mode=0o755),  # its mode is the receiver's
}


@pytest.mark.parametrize("what", list(RECORD_REFUSED))
def test_the_record_part_holds_meta_json_and_criu_images_alone(what):
    with pytest.raises(UntrustedSnapshot, match="record of snapshot snap-x"):
        feed(tarcheck.Record("snap-x"), archive([RECORD_REFUSED[what]]), 4096)
    feed(tarcheck.Record("snap-x"), archive([member("./meta.json"),
                                             member("./criu", tarfile.DIRTYPE, mode=0o700),
                                             member("./criu/pages-1.img")]), 4096)
