"""The one atomic writer every package uses (``agentenv.config.replacing``, ``write_atomic``, ``write_json``): a file
written whole or not at all, its mode from its creation, its temporary file never through a symlink."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv import config
from agentenv.config import replacing, write_atomic, write_json


def _mode(path: Path | str) -> int:
    return os.stat(path).st_mode & 0o7777


@pytest.fixture(params=[0, 0o022], ids=["umask-0", "umask-022"])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def test_the_mode_is_the_files_from_its_creation(tmp_path: Path, umask: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mode given is made by ``os.open`` (never a chmod after, where the umask leaves it whole); the default is what
    ``open`` makes, 0o666 less the umask."""

    def no_chmod(*args: object) -> None:
        raise AssertionError("chmod'ed after its creation")

    monkeypatch.setattr(os, "fchmod", no_chmod)
    monkeypatch.setattr(os, "chmod", no_chmod)
    private = tmp_path / "private.json"
    with replacing(private, mode=config.PRIVATE_FILE) as f:
        assert _mode(f.name) == 0o600  # before a byte is written
        f.write(b"{}")
    assert _mode(private) == 0o600 and private.read_bytes() == b"{}"
    config.write_private(tmp_path / "record.json", "{}")
    assert _mode(tmp_path / "record.json") == 0o600
    write_atomic(tmp_path / "plain", b"x")
    assert _mode(tmp_path / "plain") == 0o666 & ~umask


def test_a_mode_the_umask_narrows_is_set_on_the_empty_file(tmp_path: Path) -> None:
    """The agent's file must be 0644 whatever the umask: made 0600 under umask 077, then set before it is written
    (never wider than asked at any moment)."""
    old = os.umask(0o077)
    try:
        with replacing(tmp_path / "agent.py", mode=0o644) as f:
            assert _mode(f.name) == 0o644 and os.path.getsize(f.name) == 0
            f.write(b"print()")
    finally:
        os.umask(old)
    assert _mode(tmp_path / "agent.py") == 0o644


def test_nothing_is_left_when_the_serializer_raises(tmp_path: Path) -> None:
    target = tmp_path / "x.json"
    write_json(target, {"a": 1})
    with pytest.raises(TypeError):
        write_json(target, {"a": object()})
    assert json.loads(target.read_text()) == {"a": 1}
    assert os.listdir(tmp_path) == ["x.json"]


def test_nothing_is_left_when_the_block_raises(tmp_path: Path) -> None:
    target = tmp_path / "shard"
    with pytest.raises(RuntimeError), replacing(target, fsync=True) as f:
        f.write(b"half a shard")
        raise RuntimeError("killed mid-write")
    assert os.listdir(tmp_path) == []
    write_atomic(target, b"old")
    with pytest.raises(RuntimeError), replacing(target, text=True) as t:
        t.write("new")
        raise RuntimeError("killed mid-write")
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["shard"]


def test_an_existing_file_is_replaced_by_rename(tmp_path: Path) -> None:
    """A reader holding the old file keeps reading it whole; the name leads to the new one, a new inode."""
    target = tmp_path / "index.json"
    write_json(target, {"v": 1}, indent=1)
    before = os.stat(target).st_ino
    with open(target) as reader:
        with replacing(target, text=True) as f:
            f.write(json.dumps({"v": 2}))
            assert json.loads(target.read_text()) == {"v": 1}  # not there until the block ends
        assert json.loads(reader.read()) == {"v": 1}
    assert json.loads(target.read_text()) == {"v": 2}
    assert os.stat(target).st_ino != before and os.listdir(tmp_path) == ["index.json"]


def test_a_symlink_at_the_temporary_name_is_not_followed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    victim = tmp_path / "elsewhere"
    victim.write_text("untouched")
    folder = tmp_path / "folder"
    folder.mkdir()
    planted = folder / ".target.tmp"
    monkeypatch.setattr(config, "_temporary", lambda path: planted)
    for points_to in (victim, tmp_path / "missing"):
        planted.unlink(missing_ok=True)
        planted.symlink_to(points_to)
        with pytest.raises(FileExistsError):
            write_atomic(folder / "target", b"secret", mode=config.PRIVATE_FILE)
        assert victim.read_text() == "untouched" and not (tmp_path / "missing").exists()
        assert sorted(os.listdir(folder)) == [".target.tmp"] and planted.is_symlink()


def test_fsync_where_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    real = os.fsync

    def spy(fd: int) -> None:
        synced.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    write_atomic(tmp_path / "a", b"a")
    assert synced == []
    write_atomic(tmp_path / "b", b"b", fsync=True)
    assert len(synced) == 1


def test_a_writer_that_takes_a_path_writes_the_temporary_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``f.name`` is the temporary file: what a path-only writer puts there is what is synced and renamed, even
    made anew there (safetensors writes a file of its own and renames it over the name it is given)."""
    synced: list[int] = []
    real = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.fstat(fd).st_ino)
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    target = tmp_path / "weights"
    with replacing(target, fsync=True) as f:
        assert Path(f.name).parent == tmp_path and Path(f.name).name.startswith(".weights.")
        Path(f.name).write_bytes(b"tensors")
    assert target.read_bytes() == b"tensors" and synced == [os.stat(target).st_ino]
    with replacing(target, fsync=True) as f:
        (tmp_path / "own").write_bytes(b"new tensors")
        os.replace(tmp_path / "own", f.name)
    assert target.read_bytes() == b"new tensors" and synced[-1] == os.stat(target).st_ino
    assert os.listdir(tmp_path) == ["weights"]


def test_text_is_utf8_and_writers_of_one_file_do_not_meet(tmp_path: Path) -> None:
    target = tmp_path / "t.jsonl"
    with replacing(target, text=True) as a, replacing(target, text=True) as b:
        assert a.name != b.name
        a.write("ä\n")
        b.write("b\n")
    assert target.read_bytes() == "ä\n".encode()  # the last to finish wins, whole
    assert os.listdir(tmp_path) == ["t.jsonl"]
