"""Disk limits and the store's counts on both kinds of btrfs quotas, each on a volume of its own.

A new volume gets simple quotas where the kernel has them (a group counts what its subvolume wrote: no
backref walks, so a snapshot's cost does not grow with the files it shares) and full quota groups otherwise
or with ``AGENTENV_QUOTAS=full``. Either way a layer's limit bounds what it holds, inherited bytes included,
and ``referenced`` counts a clone's bytes without walking its files.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.config import paths
from agentenv.host import volume
from bench.snapshot_scale import home_with

pytestmark = pytest.mark.integration

MIB = 1 << 20


@pytest.fixture(params=["simple", "full"])
def quota_volume(request: pytest.FixtureRequest) -> Iterator[volume.Volume]:
    """A fresh home whose volume (a sparse image) has the quotas named by the parameter."""
    if request.param == "simple" and not os.path.exists("/sys/fs/btrfs/features/simple_quota"):
        pytest.skip("this kernel has no simple quotas (Linux 6.7+)")
    if not volume.ensure().quotas:
        pytest.skip(f"no btrfs volume with quotas here: {volume.ensure().reason}")
    with home_with(request.param):
        yield volume.ensure()


def fill(path: Path, mib: int) -> int:
    """Write up to ``mib`` MiB to ``path``; the MiB written before the quota stopped it."""
    done = 0
    try:
        with open(path, "wb") as f:
            for _ in range(mib):
                f.write(os.urandom(MIB))
                done += 1
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        assert e.errno == errno.EDQUOT, e
    return done


def layer(name: str, disk: int | None) -> Path:
    path = paths().layers / name
    volume.make_layer(path, disk)
    (path / "upper").mkdir()
    (path / "work").mkdir()
    return path


def test_the_mode_is_the_one_asked_for_and_kept_when_found(quota_volume: volume.Volume) -> None:
    assert quota_volume.simple == (os.environ[volume.QUOTAS_ENV] == "simple")
    volume.forget()
    os.environ[volume.QUOTAS_ENV] = "full" if quota_volume.simple else "simple"  # a volume keeps its mode
    assert volume.ensure().simple == quota_volume.simple


def test_a_clone_counts_and_is_limited_by_what_it_inherited(quota_volume: volume.Volume) -> None:
    src = layer("src", 64 * MIB)
    kid = paths().layers / "kid"
    grandkid = paths().snapshot_files / "grandkid"
    full_kid = paths().layers / "full-kid"
    try:
        assert fill(src / "upper" / "f", 24) == 24  # not flushed yet: the clone flushes and counts it
        volume.clone_layer(src, kid, 64 * MIB)
        counted = volume.referenced(kid)
        assert counted is not None and 24 * MIB <= counted < 25 * MIB
        written = fill(kid / "upper" / "g", 64)
        assert 30 <= written <= 40  # 64 MiB less the 24 it began with (and some metadata)
        assert 30 <= fill(src / "upper" / "h", 64) <= 40  # the source's own limit is untouched by the clone
        volume.clone_layer(kid, grandkid, None)  # as a snapshot of the kid (at its limit), for the store
        again = volume.referenced(grandkid)
        assert again is not None and (24 + written) * MIB <= again
        volume.clone_layer(kid, full_kid, 64 * MIB)  # a fork of a layer at its limit: no room to write
        assert fill(full_kid / "upper" / "x", 8) == 0
        assert volume.referenced(paths().layers) is None  # no subvolume: the store walks the files instead
    finally:
        for p in (full_kid, grandkid, kid, src):
            volume.drop_layer(p)


def test_reflinks_copied_into_a_layer_count_against_its_limit(quota_volume: volume.Volume) -> None:
    src = layer("copied-from", None)
    dst = layer("copied-to", 64 * MIB)
    try:
        assert fill(src / "upper" / "f", 24) == 24
        subprocess.run(["cp", "-a", "--reflink=always", str(src / "upper" / "f"), str(dst / "upper" / "f")],
                       check=True)
        txn = volume.account_copy(dst, 64 * MIB)
        volume.wait_accounted(dst, txn)
        assert 30 <= fill(dst / "upper" / "g", 64) <= 40
    finally:
        volume.drop_layer(dst)
        volume.drop_layer(src)
