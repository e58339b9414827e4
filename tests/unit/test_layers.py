"""A sandbox's overlay upper folder as a Docker image layer (``agentenv.host.layers.write_layer``), on a folder
laid out as overlayfs leaves one: owners in a uid range, whiteouts, an opaque folder, hard links, the agent's own
mount point."""

from __future__ import annotations

import os
import socket
import stat
import tarfile
from pathlib import Path

import pytest

from agentenv.host import layers

BASE, SIZE = 300_000, 65536  # the sandbox's root is host uid 300000


@pytest.fixture
def upper(tmp_path: Path) -> Path:
    if os.geteuid() != 0:
        pytest.skip("whiteouts (0:0 character devices) and trusted.* xattrs need root, as the server has")
    up = tmp_path / "upper"
    (up / "etc").mkdir(parents=True)
    (up / "etc" / "new.conf").write_text("conf")
    os.link(up / "etc" / "new.conf", up / "etc" / "again.conf")
    os.mknod(up / "etc" / "gone", stat.S_IFCHR | 0o000, os.makedev(0, 0))  # a file the sandbox deleted
    (up / "opt").mkdir()
    os.setxattr(up / "opt", "trusted.overlay.opaque", b"y")  # a folder the sandbox replaced
    (up / "opt" / "only").symlink_to("/etc/new.conf")
    os.mkfifo(up / "opt" / "pipe")
    (up / ".agentenv").mkdir()
    (up / ".agentenv" / "agent.py").touch()
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(up / "opt" / "sock"))
    for p in [up, *up.rglob("*")]:
        os.lchown(p, BASE, BASE)
    os.lchown(up / "etc" / "gone", 0, 0)  # whiteouts belong to the host's root (overlayfs makes them)
    os.lchown(up / "etc" / "new.conf", BASE + 1000, BASE + 1000)
    return up


def test_an_upper_folder_becomes_a_docker_layer(upper: Path, tmp_path: Path) -> None:
    layer = layers.write_layer(upper, BASE, SIZE, tmp_path / "layer.tar")
    with tarfile.open(layer.path) as tar:
        got = {m.name: m for m in tar}
    assert sorted(got) == ["etc", "etc/.wh.gone", "etc/again.conf", "etc/new.conf", "opt", "opt/.wh..wh..opq",
                           "opt/only", "opt/pipe"]  # the agent's mount point and the socket left out
    assert (got["etc/again.conf"].uid, got["etc/again.conf"].gid, got["etc"].uid) == (1000, 1000, 0)
    assert got["etc/again.conf"].isreg() and got["etc/again.conf"].size == 4  # the first name holds the data
    assert got["etc/new.conf"].islnk() and got["etc/new.conf"].linkname == "etc/again.conf"
    assert got["opt/only"].issym() and got["opt/only"].linkname == "/etc/new.conf" and got["opt/pipe"].isfifo()
    assert got["etc/.wh.gone"].isreg() and got["etc/.wh.gone"].size == 0
    assert layer.entries == len(got) and layer.diff_id.startswith("sha256:")
    again = layers.write_layer(upper, BASE, SIZE, tmp_path / "again.tar")
    assert again.diff_id == layer.diff_id  # the same files, the same layer


@pytest.mark.parametrize("bad, message", [("owner", "outside the sandbox's range"), ("whiteout-name", "deletion"),
                                          ("device", "device node")])
def test_what_no_layer_may_hold_is_refused(bad: str, message: str, upper: Path, tmp_path: Path) -> None:
    if bad == "owner":
        os.lchown(upper / "etc" / "new.conf", 0, 0)  # a host root file cannot come from the sandbox
    elif bad == "whiteout-name":
        (upper / ".wh.passwd").touch()
        os.lchown(upper / ".wh.passwd", BASE, BASE)
    else:
        os.mknod(upper / "tty", stat.S_IFCHR | 0o600, os.makedev(5, 0))
        os.lchown(upper / "tty", BASE, BASE)
    with pytest.raises(layers.LayerError, match=message):
        layers.write_layer(upper, BASE, SIZE, tmp_path / "layer.tar")


def test_a_layer_larger_than_the_builds_disk_is_refused(upper: Path, tmp_path: Path) -> None:
    with open(upper / "sparse", "wb") as f:  # a sparse file takes no disk in the sandbox, and all of it in a layer
        f.truncate(1 << 20)
    os.lchown(upper / "sparse", BASE, BASE)
    with pytest.raises(layers.LayerError, match="more than 65536 bytes, its disk limit"):
        layers.write_layer(upper, BASE, SIZE, tmp_path / "layer.tar", limit=65536)
