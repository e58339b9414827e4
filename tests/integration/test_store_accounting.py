"""The store counts a snapshot's files by the quota group of their cloned layer (``volume.referenced``): exact
(what was written and not yet flushed included), O(1) in the number of files, and the store's limit still
refuses a snapshot past it, leaving nothing behind."""

from __future__ import annotations

import os

import pytest

import agentenv
from agentenv.config import paths
from agentenv.errors import StoreFullError
from agentenv.host import volume
from agentenv.snapshot import store

pytestmark = pytest.mark.integration

MANY = ("mkdir -p /testbed/many && cd /testbed/many && python3 -c \"import os\n"
        "for i in range(3000): open(str(i), 'wb').write(os.urandom(8192))\"")


def test_a_clones_quota_group_counts_what_was_just_written():
    if not volume.ensure().quotas:
        pytest.skip("no btrfs volume with quotas here")
    p = paths()
    src, dst = p.layers / "acct-src", p.snapshot_files / "acct-dst"
    volume.make_layer(src, None)
    try:
        (src / "work").mkdir()
        with open(src / "data", "wb") as f:
            f.write(os.urandom(8 << 20))  # not flushed: the clone flushes it, and counts it
        volume.clone_layer(src, dst, None)
        counted = volume.referenced(dst)
        assert counted is not None and 8 << 20 <= counted < (8 << 20) + (1 << 20)
        assert volume.referenced(p.sandboxes) is None  # not a subvolume: the store walks the files instead
    finally:
        volume.drop_layer(dst)
        volume.drop_layer(src)


def test_the_store_limit_holds_with_sizes_from_quota_groups():
    with agentenv.Sandbox.create(memory="256m", disk="256m") as s:
        assert s.exec(MANY, timeout=120).ok
        snap = s.snapshot()
        try:
            counted = volume.referenced(snap.files)
            if volume.ensure().quotas:
                assert counted is not None and snap.size_bytes >= counted >= 3000 * 8192
            assert snap.size_bytes >= 3000 * 8192
            store.set_limit(snap.size_bytes + (4 << 20))  # room for this one, not for a second
            with pytest.raises(StoreFullError, match="does not fit"):
                s.snapshot()
            with pytest.raises(StoreFullError):
                s.fork(1)
            assert [x.id for x in agentenv.Snapshot.list()] == [snap.id]
            assert sorted(f.name for f in paths().snapshot_files.iterdir()) == [snap.id]
            assert s.exec("echo alive").stdout == "alive\n"
        finally:
            store.set_limit(None)
            snap.delete()
