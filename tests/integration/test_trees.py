"""A sandbox's folders are deleted without ever deleting through a mount inside them (agentenv.host.trees): a
layer mount that a start cut short left in a bundle is the image's own files on the Docker host."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import agentenv
from agentenv.host import userns
from agentenv.host.hostcalls import MS_BIND, idmap_mount, mount, umount
from agentenv.host.trees import remove_tree

pytestmark = pytest.mark.integration


@pytest.fixture
def layer() -> Iterator[Path]:
    """A stand-in for an image layer: a folder with a file in a subfolder, removed at the end."""
    d = Path(tempfile.mkdtemp(prefix="agentenv-layer-", dir="/var/tmp"))
    (d / "usr" / "bin").mkdir(parents=True)
    (d / "usr" / "bin" / "python3").write_text("the image's")
    yield d
    remove_tree(d)


def _files(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


def _mounts_under(d: Path) -> list[str]:
    return [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()
            if line.split()[1].startswith(f"{d}/")]


def test_closing_a_sandbox_spares_a_layer_mount_left_in_its_bundle(layer):
    """A start killed between mounting a layer (idmapped, under bundle/lower/0) and unmounting it leaves the
    layer mounted there; closing the sandbox then removes its bundle, the mount included, and not the layer's files."""
    sb = agentenv.Sandbox.create()
    bundle = sb.lifecycle.container.bundle
    left = bundle / "lower" / "0"
    left.mkdir(parents=True)
    uids = sb.container_spec().uids
    assert uids is not None
    fd = userns.userns_fd(uids)
    try:
        idmap_mount(str(layer), left, fd)
    finally:
        os.close(fd)
    assert (left / "usr" / "bin" / "python3").exists()  # the layer, seen through the bundle
    sb.close()
    assert _files(layer) == ["usr", "usr/bin", "usr/bin/python3"]
    assert not bundle.exists() and not _mounts_under(bundle)


def test_remove_tree_unmounts_nested_mounts_and_never_follows_links(layer):
    """Plain bind mounts (same device number as their source, which ``os.path.ismount`` misses) at two depths and a
    symlink to the layer: the tree goes, the layer stays, no mount is left."""
    tree = layer.parent / f"{layer.name}-tree"  # the layer's filesystem: a bind mount keeps its device number
    for sub in ("a", "b/c/d"):
        (tree / sub).mkdir(parents=True)
        mount(str(layer), tree / sub, None, MS_BIND)
    (tree / "b" / "file").write_text("x")
    (tree / "link").symlink_to(layer)
    assert not os.path.ismount(tree / "a")  # why the mount id is what tells
    try:
        assert remove_tree(tree) == []
    finally:
        for m in reversed(_mounts_under(tree)):
            umount(Path(m), lazy=True)
    assert not tree.exists()
    assert _files(layer) == ["usr", "usr/bin", "usr/bin/python3"]


def test_remove_tree_unmounts_a_file_mount_and_spares_what_it_showed(layer):
    """A file with something bound on it (as a user namespace is kept bound to a file beside its uid lease):
    the bind is undone, the file goes, the bound file stays."""
    tree = layer.parent / f"{layer.name}-files"
    tree.mkdir()
    (tree / "held").write_text("")
    mount(str(layer / "usr" / "bin" / "python3"), tree / "held", None, MS_BIND)
    assert (tree / "held").read_text() == "the image's"
    try:
        assert remove_tree(tree) == []
    finally:
        for m in reversed(_mounts_under(tree)):
            umount(Path(m), lazy=True)
    assert not tree.exists() and (layer / "usr" / "bin" / "python3").read_text() == "the image's"
