"""Who may reach what under the home (issue 40, finding 3), no infrastructure needed: the layout's modes, the gates
of uid ranges, private writes, and a home an older agentenv left open closed on first use (``config.lay_out``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from agentenv import config
from agentenv.host import userns

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="gates are root's folders given a range's group")


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o7777


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "home"
    monkeypatch.setenv("AGENTENV_HOME", str(h))
    monkeypatch.setattr(userns, "_passable", lambda home: None)  # pytest's tmp folders are 0700
    return h


def test_a_new_home_is_private_but_for_the_folders_a_sandboxs_root_passes(home: Path) -> None:
    p = config.paths()
    assert {d.name: _mode(d) for d in p.folders()} == {
        "home": 0o711, "sandboxes": 0o711, "snapshots": 0o711, "agents": 0o711, "runc": 0o700, "uids": 0o700,
        "exports": 0o700, "imports": 0o700, "e2b-templates": 0o700, "image-uses": 0o700, "volume": 0o700,
        "tmp": 0o700}


def test_a_private_write_is_0600_from_its_creation_whatever_the_umask_or_a_leftover(tmp_path: Path) -> None:
    target = tmp_path / "sandbox.json"
    old = os.umask(0)
    try:
        config.write_private(target, "{}")
        assert _mode(target) == 0o600 and target.read_text() == "{}"
        leftover = tmp_path / "meta.json.tmp"  # a crash's, made open: O_CREAT keeps a file's mode
        leftover.write_text("old")
        leftover.chmod(0o644)
        config.write_private(tmp_path / "meta.json", b"new")
        assert _mode(tmp_path / "meta.json") == 0o600 and not leftover.exists()
    finally:
        os.umask(old)


@as_root
def test_a_holder_is_the_gate_of_its_range(home: Path) -> None:
    """A sandbox's bundle and its snapshots' folders: root's, 0710, the range's base gid (its root's group)."""
    p = config.paths()
    bundle, snap = p.sandboxes / "sb-a", p.snapshots / "snap-a"
    bundle.mkdir(mode=config.PRIVATE_DIR)
    snap.mkdir(mode=config.PRIVATE_DIR)
    base = userns.allocate(bundle)
    userns.hold(base, snap)
    for d in (bundle, snap):
        st = d.stat()
        assert (st.st_uid, st.st_gid, _mode(d)) == (0, base, 0o710)


@as_root
def test_a_home_an_older_agentenv_left_open_is_closed_on_first_use(home: Path) -> None:
    """What the code before issue 40 left (seen on a home it made): every folder 0755, records 0644, the volume's
    image 0644. A process's first use of the home closes it: folders to their modes, each holder its range's
    gate, records and the image 0600; a holder whose record names no range is root's alone."""
    p = config.paths()
    uids = userns.base_of(5)
    old = {"bundle": p.sandboxes / "sb-old", "snap": p.snapshots / "snap-old", "bare": p.sandboxes / "sb-bare"}
    for d in old.values():
        d.mkdir()
    (old["bundle"] / "sandbox.json").write_text(json.dumps({"spec": {"uids": uids, "env": ["S=secret"]}}))
    (old["snap"] / "meta.json").write_text(json.dumps({"spec": {"uids": uids}}))
    (old["snap"] / "criu").mkdir()
    (old["snap"] / "criu" / "runc-state.json").write_text("{}")
    p.volume_image.write_bytes(b"\0" * 512)
    for d in (*p.folders(), *old.values()):
        d.chmod(0o755)
    for f in (old["bundle"] / "sandbox.json", old["snap"] / "meta.json", old["snap"] / "criu" / "runc-state.json",
              p.volume_image):
        f.chmod(0o644)
    config._laid_out.clear()  # a new process
    config.paths()
    assert {d.name: _mode(d) for d in p.folders()} == {d.name: m for d, m in p.folders().items()}
    for d in (old["bundle"], old["snap"]):
        st = d.stat()
        assert (st.st_uid, st.st_gid, _mode(d)) == (0, uids, 0o710)
    assert (old["bare"].stat().st_gid, _mode(old["bare"])) == (0, 0o700)
    for f in (old["bundle"] / "sandbox.json", old["snap"] / "meta.json", old["snap"] / "criu" / "runc-state.json",
              p.volume_image):
        assert _mode(f) == 0o600, f
