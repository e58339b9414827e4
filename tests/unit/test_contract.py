"""The sandbox contract (agentenv.api): value types round-trip the wire, and mypy holds every backend to it."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from agentenv import api, wire
from agentenv.api import ExecResult, Limits, ProcessInfo, SandboxInfo, SnapshotInfo
from agentenv.remote.client import RemoteSnapshot
from agentenv.snapshot.store import Snapshot

ROOT = Path(__file__).resolve().parents[2]
VALUES = [
    ExecResult(exit_code=3, stdout="é\n", stderr="", duration=0.25, timed_out=True),
    SandboxInfo(id="sb-1", state="paused", image="agentenv/base", created_at=1.5, expires_at=None,
                labels={"k": "v"}, limits=Limits(cpus=0.5, memory=256 << 20, pids=64), parent_snapshot="snap-0",
                forked_from="sb-0"),
    SnapshotInfo(id="snap-1", parent_id=None, created_at=2.0, size_bytes=10, has_memory=True, sandbox_id="sb-1",
                 labels={"a": "b"}),
    ProcessInfo(pid=7, log="/tmp/p.log", command="sleep 1", exit_code=None),
]


@pytest.mark.parametrize("value", VALUES, ids=lambda v: type(v).__name__)
@pytest.mark.parametrize("msgpack_body", [True, False])
def test_values_round_trip_the_wire(value, msgpack_body):
    body = wire.decode(wire.encode(value.to_wire(), msgpack_body), wire.MSGPACK if msgpack_body else wire.JSON)
    assert type(value).from_wire(body) == value


def test_from_wire_ignores_fields_it_does_not_know():
    """An older client reads a newer server's bodies."""
    body = {**VALUES[0].to_wire(), "added_later": 1}
    assert ExecResult.from_wire(body) == VALUES[0]


def test_a_sandbox_body_from_before_the_lineage_fields_reads_as_lineage_unknown():
    """A newer client reads an older server's bodies: no ``parent_snapshot`` or ``forked_from`` is None."""
    body = {k: v for k, v in VALUES[1].to_wire().items() if k not in ("parent_snapshot", "forked_from")}
    info = SandboxInfo.from_wire(body)
    assert (info.parent_snapshot, info.forked_from) == (None, None) and info.labels == {"k": "v"}


def test_local_and_remote_snapshots_share_the_info_fields():
    local = Snapshot(id="snap-1", parent_id=None, created_at=2.0, size_bytes=10, has_memory=True, sandbox_id="sb-1",
                     labels={"a": "b"}, spec={"image_id": "x"}, criu_stats={"frozen_time": 5})
    assert local.info() == VALUES[2]
    assert "spec" not in local.info().to_wire()  # local file details never reach the wire
    remote = RemoteSnapshot(**local.info().to_wire())
    assert isinstance(remote, SnapshotInfo) and not isinstance(remote, Snapshot)
    assert not hasattr(remote, "fs_dir")
    assert isinstance(local, api.SnapshotLike) and isinstance(remote, api.SnapshotLike)


def _mypy(path: Path, cache: Path) -> tuple[int, str]:
    mypy_api = pytest.importorskip("mypy.api")
    out, err, code = mypy_api.run([str(path), "--cache-dir", str(cache), "--config-file", str(ROOT / "pyproject.toml")])
    return code, out + err


def test_mypy_holds_every_backend_to_the_contract(tmp_path):
    code, out = _mypy(ROOT / "tests" / "typecheck" / "contract.py", tmp_path / "cache")
    assert code == 0, out
    broken = tmp_path / "broken.py"
    broken.write_text(textwrap.dedent("""
        from agentenv.api import Backend, SandboxLike

        class Half:  # no snapshot, fork, files, ...
            id = "sb-1"

        class Factory:
            def get(self, snapshot_id: str) -> None: ...

        class HalfBackend:
            Sandbox = Factory()
            Snapshot = Factory()

        def sandbox() -> SandboxLike:
            return Half()

        def backend() -> Backend:
            return HalfBackend()
    """))
    code, out = _mypy(broken, tmp_path / "cache")
    assert code == 1
    assert out.count("Incompatible return value type") == 2, out
