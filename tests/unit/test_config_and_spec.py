"""Sizes, the OCI spec of a sandbox, the snapshot store's atomic writes, its limit and its garbage collection."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest

from agentenv.config import parse_disk, parse_size, paths
from agentenv.errors import DiskLimitUnsupported, SnapshotNotFound, StoreFullError
from agentenv.host import userns, volume
from agentenv.host.runtime import DEFAULT_CAPS, ContainerSpec, Limits, dev_size, oci_config
from agentenv.host.seccomp import seccomp_profile
from agentenv.snapshot import store


@pytest.mark.parametrize(("text", "n"), [("1g", 1 << 30), ("512m", 512 << 20), ("1.5GiB", 3 << 29), ("4096", 4096),
                                          (100, 100), ("2k", 2048)])
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("bad", ["lots", "", "-1g", "1x", 0, -5, "0"])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


def _spec(network: bool = False, uids: int | None = userns.FIRST) -> ContainerSpec:
    return ContainerSpec(image_id="sha256:x", layers=["/l1", "/l0"], env=["A=1"], workdir="/testbed",
                         limits=Limits(cpus=0.5, memory=256 << 20, pids=64), network=network, uids=uids)


def test_oci_config_is_locked_down():
    c = oci_config(_spec(), hostname="h", cgroup="/agentenv/x")
    ns = {n["type"]: n.get("path") for n in c["linux"]["namespaces"]}
    assert ns == {"pid": None, "ipc": None, "uts": None, "mount": None, "network": None, "user": None, "cgroup": None}
    caps = set(c["process"]["capabilities"]["bounding"])
    assert "CAP_SYS_ADMIN" not in caps and "CAP_NET_RAW" not in caps and "CAP_SYS_PTRACE" not in caps
    assert c["process"]["noNewPrivileges"] is True
    res = c["linux"]["resources"]
    assert res["memory"]["limit"] == 256 << 20 and res["pids"]["limit"] == 64
    assert res["cpu"]["quota"] == 50_000 and res["cpu"]["period"] == 100_000
    assert not any("docker.sock" in m.get("source", "") for m in c["mounts"])
    assert "/proc/kcore" in c["linux"]["maskedPaths"]


def test_seccomp_profile_is_an_allowlist_modelled_on_dockers():
    c = oci_config(_spec(), hostname="h", cgroup="/agentenv/x")
    prof = c["linux"]["seccomp"]
    assert prof["defaultAction"] == "SCMP_ACT_ERRNO" and prof["defaultErrnoRet"] == 1
    allowed = {n for r in prof["syscalls"] if r["action"] == "SCMP_ACT_ALLOW" and "args" not in r for n in r["names"]}
    assert {"read", "write", "execve", "wait4", "chroot"} <= allowed
    assert "prctl" not in allowed and "madvise" not in allowed  # allowed unless they ask KSM to merge (below)
    for denied in ("ptrace", "process_vm_readv", "mount", "unshare", "setns", "bpf", "keyctl", "io_uring_setup",
                   "kexec_load", "init_module", "perf_event_open", "clone3", "userfaultfd"):
        assert denied not in allowed, denied
    clone = [r for r in prof["syscalls"] if r["names"] == ["clone"]]
    assert clone and clone[0]["args"][0]["op"] == "SCMP_CMP_MASKED_EQ"  # no new namespaces
    assert [r["errnoRet"] for r in prof["syscalls"] if r["names"] == ["clone3"]] == [38]  # ENOSYS: libc falls back
    assert "ptrace" in seccomp_profile([*DEFAULT_CAPS, "CAP_SYS_PTRACE"])["syscalls"][0]["names"]
    assert seccomp_profile(DEFAULT_CAPS, machine="x86_64")["architectures"] == ["SCMP_ARCH_X86_64"]  # native ABI only


def _allows(prof: dict, name: str, arg: int, value: int) -> bool:
    """Whether the profile's rules for ``name`` allow a call whose argument ``arg`` is ``value`` (as libseccomp
    reads them: any allow rule matching)."""
    return any(name in r["names"] and r["action"] == "SCMP_ACT_ALLOW"
               and all(value & a["value"] == a["valueTwo"] for a in r.get("args", []) if a["index"] == arg)
               for r in prof["syscalls"])


def test_only_a_sharing_sandbox_may_ask_ksm_to_merge_its_pages():
    plain, sharing = seccomp_profile(DEFAULT_CAPS), seccomp_profile(DEFAULT_CAPS, share_memory=True)
    for name, arg, merge in (("prctl", 0, 67), ("madvise", 2, 12)):
        assert not _allows(plain, name, arg, merge) and not _allows(plain, name, arg, merge + (1 << 32))
        assert _allows(sharing, name, arg, merge)
        for other in (0, 1, 3, 4, 66, 68, 0x59616D61):  # PR_GET_DUMPABLE, MADV_DONTNEED, PR_GET_MEMORY_MERGE...
            assert _allows(plain, name, arg, other), (name, other)


def test_dev_tmpfs_is_at_most_half_the_memory():
    c = oci_config(_spec(), hostname="h", cgroup="/agentenv/x")
    dev = next(m for m in c["mounts"] if m["destination"] == "/dev")
    assert f"size={128 << 20}" in dev["options"]
    assert dev_size(4 << 30) == 256 << 20 and dev_size(64 << 20) == 32 << 20


def test_every_sandbox_has_its_own_network_and_user_namespaces():
    """With network or without, the sandbox gets a new network namespace (never the host's, never one joined by
    path) and a user namespace whose root is its range's first uid, never the host's root."""
    for network in (False, True):
        c = oci_config(_spec(network=network), "h", "/x", resolv="/b/resolv.conf")
        assert {"type": "network"} in c["linux"]["namespaces"] and {"type": "user"} in c["linux"]["namespaces"]
        for key in ("uidMappings", "gidMappings"):
            assert c["linux"][key] == [{"containerID": 0, "hostID": userns.FIRST, "size": userns.SIZE}]
    binds = {m["destination"]: m["source"] for m in c["mounts"] if m["type"] == "bind"}
    assert binds["/etc/resolv.conf"] == "/b/resolv.conf"  # its own resolvers, not the host's file
    with pytest.raises(ValueError):
        oci_config(_spec(uids=None), "h", "/x")  # no spec runs as the host's root
    with pytest.raises(ValueError):
        oci_config(_spec(network=True), "h", "/x")  # a networked one needs its resolv.conf


def test_spec_round_trips_through_json():
    s = _spec()
    assert ContainerSpec.from_json(s.to_json()) == s


@pytest.mark.parametrize("bad", [{"memory": 0}, {"pids": 0}, {"pids": 7}, {"cpus": 1e-6}, {"cpus": 0},
                                 {"cpus": float("nan")}, {"cpus": float("inf")}, {"cpus": True}, {"disk": 0},
                                 {"memory": "1g"}])
def test_limits_runc_would_take_as_none_are_refused(bad):
    """What a create and an import refuse: runc takes a memory or pids limit of 0, and a CPU quota under 1 ms, as
    no limit at all."""
    with pytest.raises(ValueError, match=next(iter(bad))):
        Limits(**bad).checked()
    assert Limits(cpus=1, memory=1 << 20, pids=8, disk=None).checked().cpus == 1.0


@pytest.mark.parametrize(("text", "n"), [(None, None), ("10g", 10 << 30), ("16m", 16 << 20), (1 << 30, 1 << 30)])
def test_parse_disk(text, n):
    assert parse_disk(text) == n


@pytest.mark.parametrize("bad", ["1m", 4096, "lots", 0])
def test_parse_disk_rejects(bad):
    with pytest.raises(ValueError):
        parse_disk(bad)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTENV_HOME", str(tmp_path))
    monkeypatch.setenv(volume.VOLUME_ENV, "off")  # unit tests never mount a volume
    return tmp_path


@pytest.fixture
def snapshots(home):
    d = paths().snapshots
    d.mkdir(parents=True, exist_ok=True)
    return d


def test_store_publishes_only_complete_snapshots(home):
    sid = store.new_id("snap")
    with pytest.raises(RuntimeError), store.writing(sid) as d:
        (d / "fs").mkdir()
        raise RuntimeError("crash mid-snapshot")
    assert store.Snapshot.list() == []
    assert os.listdir(paths().snapshots) == []
    with store.writing(sid) as d:
        snap = store.Snapshot(id=sid, parent_id=None, created_at=1.0, size_bytes=0, has_memory=False)
        store.write_meta(d, snap)
    assert store.Snapshot.get(sid) == snap
    snap.delete()
    with pytest.raises(SnapshotNotFound):
        store.Snapshot.get(sid)


def test_store_full_is_typed_and_leaves_nothing(home):
    with pytest.raises(StoreFullError), store.writing("snap-full") as d:
        (d / "x").write_text("partial")
        raise OSError(errno.ENOSPC, "No space left on device")
    assert os.listdir(paths().snapshots) == []
    with pytest.raises(StoreFullError), store.writing("snap-quota") as d:
        raise OSError(errno.EDQUOT, "Disk quota exceeded")
    assert os.listdir(paths().snapshots) == []


def test_gc_removes_leftovers_of_dead_writers_only(snapshots):
    dead = snapshots / ".tmp-snap-a-999999999"
    alive = snapshots / f".tmp-snap-b-{os.getpid()}"
    dead.mkdir(parents=True)
    alive.mkdir()
    for d in (dead, alive):
        store.files_of(d).mkdir(parents=True)
    orphan = paths().snapshot_files / "snap-gone"  # files whose snapshot is gone (a kill between two renames)
    orphan.mkdir()
    assert sorted(store.gc()) == [dead.name, dead.name, "snap-gone"]
    assert alive.exists() and store.files_of(alive).exists()
    assert not dead.exists() and not store.files_of(dead).exists() and not orphan.exists()


def _publish(sid: str, size: int, **fields: object) -> store.Snapshot:
    with store.writing(sid) as d:
        (store.files_of(d) / "data").write_bytes(os.urandom(size))
        snap = store.Snapshot(id=sid, parent_id=None, created_at=1.0, size_bytes=store.size_of(d),
                              has_memory=False, **fields)  # type: ignore[arg-type]
        store.write_meta(d, snap)
    return snap


def test_a_snapshot_past_the_stores_limit_is_refused_and_leaves_nothing(snapshots):
    store.set_limit("1m")
    assert store.limit() == 1 << 20
    _publish("snap-1", 600 << 10)
    with pytest.raises(StoreFullError, match="does not fit"):
        _publish("snap-2", 600 << 10)
    assert [s.id for s in store.Snapshot.list()] == ["snap-1"]
    assert sorted(os.listdir(snapshots)) == [".lock", "snap-1"]  # the store's lock file, and the one that fit
    store.set_limit(None)
    _publish("snap-2", 600 << 10)
    assert store.limit() is None and len(store.Snapshot.list()) == 2


def test_gc_keeps_an_interrupted_pauses_folder_for_recovery(home, snapshots):
    tmp = snapshots / ".tmp-snap-p-999999999"
    tmp.mkdir()
    store.files_of(tmp).mkdir(parents=True)
    rec = paths().sandboxes / "sb-x" / "sandbox.json"
    rec.parent.mkdir(parents=True)
    rec.write_text(json.dumps({"id": "sb-x", "pausing": "snap-p"}))
    assert store.gc() == [] and tmp.exists() and store.files_of(tmp).exists()
    rec.write_text(json.dumps({"id": "sb-x", "pausing": None}))  # recovery is done with it
    assert store.gc() == [tmp.name, tmp.name] and not tmp.exists() and not store.files_of(tmp).exists()


def test_gc_collects_the_snapshots_of_forks_whose_process_died(snapshots):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    fork = {"agentenv.kind": store.FORK_KIND}
    _publish("snap-dead", 10, labels=fork, owner=[int(dead.stdout), 1])
    _publish("snap-live", 10, labels=fork, owner=store.owner())
    _publish("snap-kept", 10, labels={"agentenv.kind": "pause"})
    assert store.gc() == ["snap-dead"]
    assert {s.id for s in store.Snapshot.list()} == {"snap-live", "snap-kept"}


def test_without_a_volume_a_disk_limit_is_a_typed_error_naming_the_fix(home):
    volume.forget()
    try:
        v = volume.ensure()
        assert not v.quotas and "AGENTENV_VOLUME" in (v.reason or "")
        v.require(None)  # no limit asked: fine
        with pytest.raises(DiskLimitUnsupported) as e:
            v.require(10 << 30)
        assert "bootstrap.sh" in str(e.value) and "disk=None" in str(e.value)
        assert paths().snapshots.is_dir() and paths().layers.is_dir()
    finally:
        volume.forget()


def test_the_volume_is_made_only_over_an_unused_folder(home):
    assert volume._unused(paths().volume)  # not there yet
    paths().snapshot_files.mkdir(parents=True)
    paths().layers.mkdir(parents=True)
    assert volume._unused(paths().volume)  # empty folders only
    (paths().snapshot_files / "snap-1").mkdir()
    assert not volume._unused(paths().volume)
