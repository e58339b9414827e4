"""An imported memory snapshot's CRIU images moved into its new range (``agentenv.snapshot.criu_images``), without a
dump: the user namespace's maps and runc's record name the new range, every capability past the sandbox's set is
cut, and a map agentenv never dumps is refused. (A real dump restored elsewhere: tests/integration/test_transfer.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pycriu import images

from agentenv.host import userns
from agentenv.host.runtime import DEFAULT_CAPS
from agentenv.snapshot import criu_images


def write(path: Path, magic: str, entries: list[dict[str, object]]) -> None:
    with open(path, "wb") as f:
        images.dump({"magic": magic, "entries": entries}, f)


def read(path: Path) -> list[dict[str, object]]:
    with open(path, "rb") as f:
        return list(images.load(f)["entries"])


def creds(words: list[int]) -> dict[str, object]:
    ids = dict.fromkeys(("uid", "gid", "euid", "egid", "suid", "sgid", "fsuid", "fsgid"), 0)
    sets = {k: list(words) for k in ("cap_inh", "cap_prm", "cap_eff", "cap_bnd", "cap_amb")}
    return {"mtype": "X86_64", "thread_core": {"futex_rla": 0, "futex_rla_len": 0, "secbits": 0,
                                               "creds": {**ids, **sets, "secbits": 0}}}


def test_the_maps_and_capabilities_become_this_servers(tmp_path):
    old, new = userns.base_of(3), userns.base_of(7)
    extent = [{"first": 0, "lower_first": old, "count": userns.SIZE}]
    write(tmp_path / "userns-14.img", "USERNS", [{"uid_map": extent, "gid_map": extent}])
    write(tmp_path / "core-1.img", "CORE", [creds([0xFFFFFFFF, 0x1FF])])  # every capability, CAP_SYS_ADMIN too
    (tmp_path / "runc-state.json").write_text(json.dumps({"config": {
        "uid_mappings": [{"container_id": 0, "host_id": old, "size": userns.SIZE}], "gid_mappings": [],
        "devices": [{"path": "/dev/null", "uid": old, "gid": old}], "capabilities": {"Bounding": ["CAP_SYS_ADMIN"]}}}))
    criu_images.rehome(tmp_path, new, DEFAULT_CAPS)
    ns = read(tmp_path / "userns-14.img")[0]
    assert [e["lower_first"] for e in ns["uid_map"] + ns["gid_map"]] == [new, new]  # type: ignore[operator]
    got = read(tmp_path / "core-1.img")[0]["thread_core"]["creds"]  # type: ignore[index]
    assert all(got[k] == [criu_images.mask(DEFAULT_CAPS), 0] for k in ("cap_prm", "cap_eff", "cap_bnd"))
    assert criu_images.mask(DEFAULT_CAPS) == 0x405FB  # what a sandbox's root holds (CapEff)
    config = json.loads((tmp_path / "runc-state.json").read_text())["config"]
    assert config["uid_mappings"][0]["host_id"] == config["gid_mappings"][0]["host_id"] == new
    assert config["devices"][0]["uid"] == new and config["capabilities"]["Bounding"] == sorted(DEFAULT_CAPS)


@pytest.mark.parametrize("extents", [
    [{"first": 0, "lower_first": 0, "count": (1 << 32) - 1}],  # the host's root and every id
    [{"first": 0, "lower_first": userns.base_of(3), "count": userns.SIZE}, {"first": userns.SIZE, "lower_first": 0,
                                                                            "count": 1}],
])
def test_a_map_agentenv_never_dumps_is_refused(tmp_path, extents):
    write(tmp_path / "userns-9.img", "USERNS", [{"uid_map": extents, "gid_map": extents}])
    with pytest.raises(ValueError, match="not one extent"):
        criu_images.rehome(tmp_path, userns.base_of(7), DEFAULT_CAPS)
