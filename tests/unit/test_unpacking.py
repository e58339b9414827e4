"""Unpacking archives on Debian 12's own Python (3.11.2, whose ``tarfile`` has no extraction filters): an sdist
unpacks, and a hostile one is refused, naming its member, before anything reaches a host file."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from agentenv.errors import AgentEnvError
from envs.images import extract_sdist


def _sdist(path: Path, members: list[tarfile.TarInfo], data: dict[str, bytes] | None = None) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for m in members:
            body = (data or {}).get(m.name, b"")
            if m.isreg():
                m.size = len(body)
            tar.addfile(m, io.BytesIO(body) if m.isreg() else None)
    return path


def _member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "", mode: int = 0o644) -> tarfile.TarInfo:
    m = tarfile.TarInfo(name)
    m.type, m.linkname, m.mode = kind, link, mode
    return m


def test_an_sdist_unpacks_on_this_interpreter(tmp_path: Path) -> None:
    archive = _sdist(tmp_path / "pkg-1.0.tar.gz", [
        _member("pkg-1.0", tarfile.DIRTYPE, mode=0o755), _member("pkg-1.0/setup.py"),
        _member("pkg-1.0/src", tarfile.DIRTYPE, mode=0o755), _member("pkg-1.0/src/m.py", mode=0o755),
        _member("pkg-1.0/alias.py", tarfile.SYMTYPE, "src/m.py"), _member("pkg-1.0/gone", tarfile.SYMTYPE, "nothing"),
        _member("pkg-1.0/copy.py", tarfile.LNKTYPE, "pkg-1.0/src/m.py", mode=0o755)],
        {"pkg-1.0/setup.py": b"print('setup')\n", "pkg-1.0/src/m.py": b"x = 1\n"})
    dest = extract_sdist(archive, tmp_path / "out")
    assert (dest / "setup.py").read_text() == "print('setup')\n"
    assert (dest / "alias.py").read_text() == (dest / "copy.py").read_text() == "x = 1\n"
    assert (dest / "src" / "m.py").stat().st_mode & 0o777 == 0o755
    assert not (dest / "gone").is_symlink()  # a dangling link is dropped (it would break a COPY)


@pytest.mark.parametrize("hostile, named", [
    ("hard link out", "pkg-1.0/shadow"), ("hard link up", "pkg-1.0/up"), ("symlink out", "pkg-1.0/etc"),
    ("absolute", "/pkg-1.0/abs"), ("dot-dot", "pkg-1.0/../../x"), ("device", "pkg-1.0/tty"),
    ("fifo", "pkg-1.0/pipe"), ("under a symlink", "pkg-1.0/here/file"), ("over a link", "pkg-1.0/note"),
])
def test_a_hostile_sdist_is_refused_naming_its_member(hostile: str, named: str, tmp_path: Path) -> None:
    victim = tmp_path / "scratch" / "victim"
    victim.parent.mkdir()
    victim.write_text("root-only")
    victim.chmod(0o600)
    top = [_member("pkg-1.0", tarfile.DIRTYPE, mode=0o755)]
    bad = {
        "hard link out": [_member(named, tarfile.LNKTYPE, str(victim))],
        "hard link up": [_member(named, tarfile.LNKTYPE, "pkg-1.0/../../scratch/victim")],
        "symlink out": [_member(named, tarfile.SYMTYPE, "/etc")],
        "absolute": [_member(named)],
        "dot-dot": [_member(named)],
        "device": [_member(named, tarfile.CHRTYPE)],
        "fifo": [_member(named, tarfile.FIFOTYPE)],
        "under a symlink": [_member("pkg-1.0/here", tarfile.SYMTYPE, "."), _member(named)],
        "over a link": [_member("pkg-1.0/real"), _member(named, tarfile.LNKTYPE, "pkg-1.0/real"), _member(named)],
    }[hostile]
    archive = _sdist(tmp_path / "pkg-1.0.tar.gz", top + bad, {named: b"overwritten"})
    with pytest.raises(AgentEnvError, match=named.replace(".", r"\.")):
        extract_sdist(archive, tmp_path / "out")
    assert victim.read_text() == "root-only" and victim.stat().st_mode & 0o777 == 0o600
    assert not (tmp_path / "out").exists() and not (tmp_path / "x").exists()


def test_symlinks_are_followed_through_the_archives_own_links(tmp_path: Path) -> None:
    """A target that looks inside ('up/..') but climbs out through another link of the archive ('up' -> '.') is
    refused; where the unpack happens inside a sandbox (``outward_symlinks``), links are kept as written."""
    from agentenv.host import archives

    def tar_of(members: list[tarfile.TarInfo]) -> tarfile.TarFile:
        _sdist(tmp_path / "t.tar.gz", members)
        return tarfile.open(tmp_path / "t.tar.gz")

    sneaky = [_member("up", tarfile.SYMTYPE, "."), _member("out", tarfile.SYMTYPE, "up/..")]
    with tar_of(sneaky) as tar, pytest.raises(archives.UnsafeArchive, match="'out' is a symlink to 'up/..'"):
        archives.checked(tar)
    fine = [_member("d", tarfile.DIRTYPE), _member("d/deep", tarfile.DIRTYPE), _member("in", tarfile.SYMTYPE, "d/deep"),
            _member("back", tarfile.SYMTYPE, "in/.."), _member("abs", tarfile.SYMTYPE, "/usr/bin/python3")]
    with tar_of(fine) as tar, pytest.raises(archives.UnsafeArchive, match="'abs'"):
        archives.checked(tar)
    with tar_of(fine) as tar:
        assert [m.name for m in archives.checked(tar, outward_symlinks=True)][-1] == "abs"
    with tar_of(fine[:-1]) as tar:
        archives.extract(tar, tmp_path / "out")
    assert os.readlink(tmp_path / "out" / "back") == "in/.." and (tmp_path / "out" / "back").resolve() == \
        (tmp_path / "out" / "d").resolve()
