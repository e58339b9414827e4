"""When a restore may run CRIU without runc (agentenv.snapshot.restore._restore_plan), and runc's device rules as the kernel
takes them: no infrastructure needed."""

from __future__ import annotations

import json
from pathlib import Path

from agentenv.host import cgroups
from agentenv.snapshot import restore


def test_device_rules_read_as_the_v1_devices_controller_takes_them():
    assert cgroups.device_rule({"type": 97, "major": -1, "minor": -1, "permissions": "rwm"}) == "a *:* rwm"
    assert cgroups.device_rule({"type": 99, "major": 1, "minor": 3, "permissions": "rwm"}) == "c 1:3 rwm"
    assert cgroups.device_rule({"type": 98, "major": 8, "minor": -1, "permissions": "m"}) == "b 8:* m"


def test_cgroup_paths_outside_the_host_hierarchies_are_refused():
    assert cgroups.v1_paths({}, "/agentenv/a", "/agentenv/b") is None
    assert cgroups.v1_paths({"memory": "/tmp/x/agentenv/a"}, "/agentenv/a", "/agentenv/b") is None
    assert cgroups.v1_paths({"memory": "/sys/fs/cgroup/memory/other"}, "/agentenv/a", "/agentenv/b") is None


def bundle(tmp_path: Path, mounts: list[dict[str, str]]) -> tuple[Path, Path]:
    images, bundle = tmp_path / "images", tmp_path / "bundle"
    images.mkdir()
    (bundle / "rootfs").mkdir(parents=True)
    (bundle / "config.json").write_text(json.dumps({"root": {"path": "rootfs"}, "mounts": mounts,
                                                    "linux": {"cgroupsPath": "/agentenv/new"}}))
    (images / "descriptors.json").write_text(json.dumps(["/dev/null"] * 3))
    return images, bundle


def test_images_without_runcs_record_go_to_runc(tmp_path):
    images, b = bundle(tmp_path, [])
    assert restore._restore_plan(images, b) is None


def test_a_mount_point_behind_a_symbolic_link_goes_to_runc(tmp_path):
    images, b = bundle(tmp_path, [{"destination": "/.agentenv/agent.py", "type": "bind", "source": "/x"}])
    (b / "rootfs" / ".agentenv").symlink_to("/etc")  # a hostile root: the mount point would resolve on the host
    assert not restore._plain_path(b / "rootfs", "/.agentenv/agent.py")
    (b / "rootfs" / ".agentenv").unlink()
    (b / "rootfs" / ".agentenv").mkdir()
    assert not restore._plain_path(b / "rootfs", "/.agentenv/agent.py")  # missing: runc makes it
    (b / "rootfs" / ".agentenv" / "agent.py").touch()
    assert restore._plain_path(b / "rootfs", "/.agentenv/agent.py")
