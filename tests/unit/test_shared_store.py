"""The shared snapshot store's refusals, without Docker: a folder that is not a writable directory outside the
home, ids that are not safe names, a snapshot in neither store, a shared manifest of another snapshot."""

from __future__ import annotations

import json
import os

import pytest

from agentenv.errors import SnapshotNotFound, TransferError
from agentenv.server.app import create_app
from agentenv.snapshot import shared, store


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTENV_HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    yield tmp_path / "home"
    shared.configure(None)


def test_a_shared_store_must_be_a_directory_outside_the_home(home, tmp_path):
    (tmp_path / "file").write_text("x")
    for bad, why in ((tmp_path / "file", "not a directory"), (tmp_path / "missing", "not a directory"),
                     (home / "sub", "not a directory"), (home, "overlaps"), (tmp_path, "overlaps")):
        if why == "overlaps" or bad.name == "sub":
            bad.mkdir(exist_ok=True)
            why = "overlaps"
        with pytest.raises(ValueError, match=why):
            shared.configure(bad)
        assert store.shared_root() is None
    with pytest.raises(ValueError, match="not a directory"):
        create_app("t", shared_store=tmp_path / "file")
    (tmp_path / "ok").mkdir()
    assert shared.configure(tmp_path / "ok") == (tmp_path / "ok").resolve() == store.shared_root()


def test_unsafe_ids_are_refused_and_missing_or_foreign_snapshots_named(home, tmp_path):
    root = tmp_path / "shared"
    root.mkdir()
    shared.configure(root)
    for bad in ("../etc", ".hidden", "a/b", ""):
        with pytest.raises(ValueError, match="not a snapshot id"):
            shared.get(bad)
        with pytest.raises(ValueError, match="not a snapshot id"):
            shared.drop(bad)
    with pytest.raises(SnapshotNotFound, match="nor in the shared store"):
        shared.get("snap-none")
    assert shared.info("snap-none") is None and not shared.drop("snap-none")
    (root / "snap-x").mkdir()
    (root / "snap-x" / f"manifest-{1 << 20}.json").write_text(json.dumps({"id": "snap-y"}))
    with pytest.raises(TransferError, match="another snapshot"):
        shared.get("snap-x")
    (root / "snap-x" / f"manifest-{1 << 20}.json").write_text("{not json")
    with pytest.raises(TransferError, match="unreadable"):
        shared.get("snap-x")
    assert shared.drop("snap-x") and [p.name for p in root.iterdir()] == [store.shared_staging().name]
    assert not list(store.shared_staging().iterdir())


def test_a_hosts_dead_publishers_leftovers_go_and_live_ones_stay(home, tmp_path):
    root = tmp_path / "shared"
    staging = root / f".staging-{os.uname().nodename}"
    staging.mkdir(parents=True)
    for name in ("snap-a-999999999", ".tmp-snap-b-999999999", ".del-snap-c-999999999", f"snap-d-{os.getpid()}"):
        (staging / name).mkdir()
    shared.configure(root)
    assert [p.name for p in staging.iterdir()] == [f"snap-d-{os.getpid()}"]
