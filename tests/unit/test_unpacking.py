"""Unpacking archives on Debian 12's own Python (3.11.2, whose ``tarfile`` has no extraction filters): an sdist
unpacks, and a hostile one is refused, naming its member, before anything reaches a host file."""

from __future__ import annotations

import io
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


@pytest.mark.xfail(strict=True, reason="issue 40: Python 3.11.2 has no tarfile filters; extractall(filter=...) "
                                        "raises TypeError")
def test_an_sdist_unpacks_on_this_interpreter(tmp_path: Path) -> None:
    archive = _sdist(tmp_path / "pkg-1.0.tar.gz", [
        _member("pkg-1.0", tarfile.DIRTYPE, mode=0o755), _member("pkg-1.0/setup.py"),
        _member("pkg-1.0/src", tarfile.DIRTYPE, mode=0o755), _member("pkg-1.0/src/m.py", mode=0o755),
        _member("pkg-1.0/alias.py", tarfile.SYMTYPE, "src/m.py"), _member("pkg-1.0/gone", tarfile.SYMTYPE, "nothing"),
        _member("pkg-1.0/copy.py", tarfile.LNKTYPE, "pkg-1.0/src/m.py")],
        {"pkg-1.0/setup.py": b"print('setup')\n", "pkg-1.0/src/m.py": b"x = 1\n"})
    dest = extract_sdist(archive, tmp_path / "out")
    assert (dest / "setup.py").read_text() == "print('setup')\n"
    assert (dest / "alias.py").read_text() == (dest / "copy.py").read_text() == "x = 1\n"
    assert (dest / "src" / "m.py").stat().st_mode & 0o777 == 0o755
    assert not (dest / "gone").is_symlink()  # a dangling link is dropped (it would break a COPY)


@pytest.mark.xfail(strict=True, reason="issue 40: finding 1, archives are unpacked with tarfile's filters (absent "
                                        "on 3.11.2; the 'tar' filter lets hard links reach any host file)")
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
