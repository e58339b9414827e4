"""File metadata in the keeper: ``user.e2b.*`` xattrs set by a write, read back by stat and list, cleared by an
overwrite (the joined keeper as a plain process, ``ch``; needs a temporary folder with user xattrs)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentenv.sandbox import jobs
from agentenv.sandbox.channel import Channel


def _xattrs_here(path: Path) -> bool:
    probe = path / "probe"
    probe.write_text("")
    try:
        os.setxattr(probe, "user.e2b.probe", b"1")
    except OSError:
        return False
    return True


def test_a_write_sets_metadata_that_stat_and_list_read_and_an_overwrite_clears(ch: Channel, tmp_path: Path) -> None:
    if not _xattrs_here(tmp_path):
        pytest.skip("the temporary folder's file system has no user xattrs")
    target = str(tmp_path / "d" / "f.txt")
    ch.call({"op": "write", "path": target, "mode": 0o644, "metadata": {"k": "v", "a": "b"}}, b"data")
    assert os.getxattr(target, "user.e2b.k") == b"v"  # a real xattr
    assert jobs.stat(ch, target).metadata == {"k": "v", "a": "b"}
    assert [e.metadata for e in jobs.list_dir(ch, str(tmp_path / "d"), 1)] == [{"k": "v", "a": "b"}]
    os.setxattr(target, "user.other", b"x")  # not of the prefix: never surfaced
    assert jobs.stat(ch, target).metadata == {"k": "v", "a": "b"}
    ch.call({"op": "write", "path": target, "mode": 0o644}, b"again")
    assert jobs.stat(ch, target).metadata is None
    assert jobs.move(ch, target, str(tmp_path / "g.txt")).metadata is None


def test_malformed_metadata_is_refused_before_the_file_appears(ch: Channel, tmp_path: Path) -> None:
    target = str(tmp_path / "bad.txt")
    with pytest.raises(ValueError, match="metadata"):
        ch.call({"op": "write", "path": target, "mode": 0o644, "metadata": {"": "v"}}, b"data")
    assert not os.path.exists(target)
