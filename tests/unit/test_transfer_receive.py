"""The receiving side of a snapshot transfer, without Docker: manifests are checked (their seal first), damaged
chunks are refused and never kept, a later try resumes at the first chunk missing, and the routes refuse bad input."""

from __future__ import annotations

import hashlib
import io
import secrets
import tarfile
from typing import Any

import pytest

from agentenv.errors import TransferError, UntrustedSnapshot
from agentenv.snapshot import transfer, trust

CHUNK = transfer.MIN_CHUNK


def manifest(data: bytes) -> dict[str, Any]:
    """The sealed manifest of an archive ``data`` that is all record (this home's key seals it)."""
    pieces = [data[i:i + CHUNK] for i in range(0, len(data), CHUNK)]
    return trust.seal({"id": "snap-x", "size": len(data), "chunk": CHUNK, "format": transfer.FORMAT,
                       "digests": [hashlib.sha256(p).hexdigest() for p in pieces], "meta": [0, len(data)],
                       "files": None})


def record_part(size: int) -> bytes:
    """A record part of one ``meta.json`` of ``size`` bytes that is no JSON: every member allowed, yet no snapshot."""
    info = tarfile.TarInfo("./meta.json")
    info.size = size
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as t:
        t.addfile(info, io.BytesIO(bytes(range(256)) * (size // 256)))
    return out.getvalue()


@pytest.mark.parametrize("bad", [{"digests": ["zz"] * 4}, {"chunk": 1}, {"id": "../etc"}, {"size": -1},
                                 {"meta": "x"}, {"digests": []}])
def test_a_malformed_manifest_is_a_transfer_error(tmp_path, monkeypatch, bad):
    monkeypatch.setenv("AGENTENV_HOME", str(tmp_path))
    m = {**manifest(b"a" * (3 * CHUNK + 5)), **bad}
    with pytest.raises(TransferError, match="malformed"):
        transfer.receive(m, lambda i: b"", origin="http://127.0.0.1:1")


def test_a_damaged_chunk_is_refused_and_the_next_try_resumes_after_the_good_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTENV_HOME", str(tmp_path))
    data = record_part(CHUNK * 4)
    m = manifest(data)
    assert len(m["digests"]) == 5
    asked: list[int] = []

    def damaged(i: int) -> bytes:
        asked.append(i)
        piece = data[i * CHUNK:(i + 1) * CHUNK]
        return piece if i < 2 else b"\xff" + piece[1:]

    with pytest.raises(TransferError, match="chunk 2 .* damaged"):
        transfer.receive(m, damaged, origin="http://127.0.0.1:1")
    part = tmp_path / "imports" / ".part-snap-x"
    assert part.read_bytes() == data[:2 * CHUNK]  # the damaged chunk was never written
    asked.clear()

    def good_but_not_a_snapshot(i: int) -> bytes:
        asked.append(i)
        return data[i * CHUNK:(i + 1) * CHUNK]

    with pytest.raises(TransferError, match="no valid snapshot"):  # a tar of no snapshot: nothing is listed
        transfer.receive(m, good_but_not_a_snapshot, origin="http://127.0.0.1:1")
    assert asked == [2, 3, 4]  # resumed at the first chunk missing
    assert not list((tmp_path / "snapshots").iterdir()) and not part.exists()


@pytest.mark.parametrize("how", ["not sealed", "another key", "changed"])
def test_a_manifest_not_sealed_with_this_servers_key_is_refused_before_any_chunk(tmp_path, monkeypatch, how):
    monkeypatch.setenv("AGENTENV_HOME", str(tmp_path))
    m = manifest(record_part(CHUNK))
    if how == "not sealed":
        m = {k: v for k, v in m.items() if k not in ("mac", "key_id")}
    elif how == "another key":
        m = trust.seal(m, secrets.token_hex(32).encode())
    else:
        m["digests"] = [hashlib.sha256(b"other").hexdigest()] * len(m["digests"])
    asked: list[int] = []
    with pytest.raises(UntrustedSnapshot, match="not sealed|another key|does not match its seal") as e:
        transfer.receive(m, lambda i: asked.append(i) or b"", origin="http://127.0.0.1:1")
    assert "same key file" in str(e.value) or how == "changed"
    assert not asked and not list((tmp_path / "imports").glob(".part-*"))


def test_the_routes_refuse_bad_chunk_sizes_and_unknown_snapshots(client):
    auth = {"Authorization": "Bearer unit-token"}
    assert client.get("/v1/snapshots/snap-none/export", params={"chunk": 1}, headers=auth).status_code == 422
    assert client.get("/v1/snapshots/snap-none/export", headers=auth).status_code == 404
    assert client.get("/v1/snapshots/snap-none/export/0", headers=auth).status_code == 404
    r = client.post("/v1/snapshots/import", json={"id": "snap-x", "source": "file:///etc", "token": "t"}, headers=auth)
    assert r.status_code == 422
    assert client.get("/v1/snapshots/snap-none/export").status_code == 401


def test_gc_drops_the_packed_archives_of_snapshots_gone_and_keeps_the_others(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTENV_HOME", str(tmp_path))
    from agentenv.snapshot import store

    for sid in ("snap-kept", "snap-gone"):
        (store.exports() / sid).mkdir(parents=True)
        (store.exports() / sid / "archive").write_bytes(b"x")
    (tmp_path / "snapshots" / "snap-kept").mkdir(parents=True)
    assert "snap-gone" in store.gc()
    assert sorted(d.name for d in store.exports().iterdir()) == ["snap-kept"]
