"""The server app without Docker: token checks, bad bodies, quotas, the OpenAPI contract, refusing to run open."""

from __future__ import annotations

import msgpack
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from agentenv import errors, server, wire
from agentenv.cli import app as cli_app
from agentenv.host import volume
from agentenv.server.service import Service

TOKEN = "unit-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_no_or_wrong_token_is_401_and_nothing_happens(client, tmp_path):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}, {"Authorization": f"Basic {TOKEN}"}):
        r = client.post("/v1/sandboxes", json={"image": "agentenv/base"}, headers=headers)
        assert r.status_code == 401, headers
        assert r.json()["error"] == "Unauthorized"
        assert r.headers["www-authenticate"] == "Bearer"
    # malformed bodies are refused for the token first, before they are even parsed
    r = client.post("/v1/sandboxes", content=b"\xc1", headers={"Content-Type": wire.MSGPACK})
    assert r.status_code == 401
    assert list((tmp_path / "sandboxes").iterdir()) == []
    assert client.get("/health").status_code == 200  # open
    assert client.get("/metrics").status_code == 200  # open
    assert client.get("/v1/sandboxes", headers=AUTH).json() == []


def test_bad_bodies_are_4xx_with_a_reason(client):
    cases = [
        (b"\xc1\xc1", wire.MSGPACK, 400),       # not msgpack
        (b"{not json", wire.JSON, 422),          # not JSON
        (msgpack.packb([1, 2]), wire.MSGPACK, 422),
    ]
    for body, ctype, code in cases:
        r = client.post("/v1/sandboxes", content=body, headers={**AUTH, "Content-Type": ctype})
        assert r.status_code == code, (body, r.text)
        assert r.json()["message"]
    bad_json = [{"cpus": "many"}, {"cpus": -1}, {"memory": "-5g"}, {"memory": 0}, {"pids": -5}, {"ttl": -1},
                {"memory": "lots"}, {"workdir": "relative"}, {"workdir": "/proc/self"}, {"env": {"A=B": "x"}},
                {"labels": {"k": 1}}, {"surprise": True}, {"disk": "1m"}, {"disk": 4096}, {"disk": "lots"},
                {"disk": True}]
    for body in bad_json:
        r = client.post("/v1/sandboxes", json=body, headers=AUTH)
        assert r.status_code == 422, (body, r.text)
        assert r.json()["error"] == "ValidationError" and r.json()["message"]
    r = client.post("/v1/sandboxes/sb-x/fork", json={"count": 10_000}, headers=AUTH)
    assert r.status_code == 422 and "count" in r.json()["message"]
    r = client.post("/v1/sandboxes/sb-x/exec", json={"command": "true", "timeout": -1}, headers=AUTH)
    assert r.status_code == 422 and "timeout" in r.json()["message"]
    r = client.get("/v1/sandboxes/sb-x/files", params={"path": "/a\x00b"}, headers=AUTH)
    assert r.status_code == 422
    job = "/v1/sandboxes/sb-x/jobs"
    for method, path, kwargs, field in [
            ("POST", job, {"json": {"command": "true", "timeout": 0}}, "timeout"),
            ("POST", job, {"json": {"command": "true", "stdin": "yes"}}, "stdin"),
            ("POST", f"{job}/7/output", {"json": {"offsets": [0]}}, "offsets"),
            ("POST", f"{job}/7/output", {"json": {"offsets": [0, -1]}}, "offsets"),
            ("POST", f"{job}/7/output", {"json": {"offsets": ["0", 0]}}, "offsets"),
            ("POST", f"{job}/7/discard", {"json": {}}, "offsets"),
            ("POST", f"{job}/0/signal", {"json": {"signal": 9}}, "pid"),
            ("POST", f"{job}/7/signal", {"json": {"signal": 0}}, "signal"),
            ("GET", "/v1/sandboxes/sb-x/list", {"params": {"path": "/", "depth": 0}}, "depth"),
            ("GET", "/v1/sandboxes/sb-x/stat", {"params": {"path": ""}}, "path"),
            ("POST", "/v1/sandboxes/sb-x/mkdir", {"json": {"path": "/a\x00b"}}, "path"),
            ("POST", "/v1/sandboxes/sb-x/move", {"json": {"src": "/a"}}, "dst"),
            ("DELETE", "/v1/sandboxes/sb-x/files", {"params": {}}, "path"),
            ("POST", "/v1/images/evict", {"json": {"budget": 0, "dry_run": 0}}, "dry_run"),
            ("POST", "/v1/images/evict", {"json": {"budget": 0, "only_fetched": "yes"}}, "only_fetched"),
            ("POST", "/v1/images/evict", {"json": {"budget": "5"}}, "budget"),
            ("POST", "/v1/images/evict", {"json": {"budget": 0, "surprise": 1}}, "surprise"),
            ("POST", "/v1/images/ensure", {"json": {"image": "a:b", "deadline": "5"}}, "deadline"),
            ("POST", "/v1/images/ensure", {"json": {"image": "a:b", "pull_from": "x"}}, "pull_from")]:
        r = client.request(method, path, headers=AUTH, **kwargs)
        assert r.status_code == 422 and field in r.json()["message"], (method, path, kwargs, r.text)


def test_unknown_ids_are_404_with_the_id(client):
    r = client.get("/v1/sandboxes/sb-nothere", headers=AUTH)
    assert r.status_code == 404 and r.json()["id"] == "sb-nothere" and r.json()["error"] == "SandboxNotFound"
    r = client.delete("/v1/snapshots/snap-nothere", headers=AUTH)
    assert r.status_code == 404 and r.json()["id"] == "snap-nothere" and r.json()["error"] == "SnapshotNotFound"
    r = client.post("/v1/snapshots/snap-nothere/restore", json={}, headers={**AUTH, "Accept": wire.MSGPACK})
    assert r.status_code == 404 and r.headers["content-type"] == wire.MSGPACK
    assert msgpack.unpackb(r.content)["id"] == "snap-nothere"


def test_quota_is_429_with_retry_after(client):
    r = client.post("/v1/sandboxes", json={}, headers=AUTH)  # max_sandboxes=0
    assert r.status_code == 429
    assert int(r.headers["retry-after"]) > 0
    assert r.json()["error"] == "QuotaExceeded"
    info = client.get("/v1/server", headers=AUTH).json()
    assert info["capacity"]["free_sandboxes"] == 0


def test_disk_is_counted_in_the_quota_and_a_sandbox_without_a_limit_needs_the_servers_consent(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTENV_HOME", str(tmp_path))
    monkeypatch.setenv(volume.VOLUME_ENV, "off")  # no volume can be made: a disk limit is a typed error
    volume.forget()
    with TestClient(server.create_app(TOKEN, max_disk="20g", reap_interval=60)) as c:
        cap = c.get("/v1/server", headers=AUTH).json()["capacity"]
        assert cap["max_disk"] == 20 << 30 and cap["free_disk"] == 20 << 30 and cap["disk_used"] == 0
        r = c.post("/v1/sandboxes", json={"disk": "30g"}, headers=AUTH)
        assert r.status_code == 429 and "disk" in r.json()["message"]
        r = c.post("/v1/sandboxes", json={"disk": None}, headers=AUTH)
        assert r.status_code == 403 and r.json()["error"] == "DiskLimitRequired" and "--unlimited-disk" in r.json()["fix"]
        r = c.post("/v1/sandboxes", json={}, headers=AUTH)  # the default, 10g: this host cannot enforce it
        assert r.status_code == 501 and r.json()["error"] == "DiskLimitUnsupported"
        assert "disk=None" in r.json()["fix"]
    volume.forget()
    service = Service(4, 4 << 30, 60, max_disk=10 << 30)
    with service.reserve(2, 1 << 30, 4 << 30):
        assert service.capacity().disk_used == 8 << 30
        with pytest.raises(errors.QuotaExceeded, match="disk"), service.reserve(1, 1 << 30, 4 << 30):
            pass
        with service.reserve(1, 1 << 30, None):  # no limit (a server with --unlimited-disk): counts nothing
            assert service.capacity().disk_used == 8 << 30
    assert service.capacity().disk_used == 0


def test_msgpack_and_json_are_chosen_by_accept(client):
    r = client.get("/v1/server", headers={**AUTH, "Accept": wire.MSGPACK})
    assert r.headers["content-type"] == wire.MSGPACK and "capacity" in msgpack.unpackb(r.content)
    r = client.get("/v1/server", headers={**AUTH, "Accept": wire.JSON})
    assert r.headers["content-type"] == wire.JSON and "capacity" in r.json()


def test_openapi_describes_every_route_error_and_msgpack(client):
    spec = client.get("/openapi.json").json()
    routes = {(m.upper(), p) for p, item in spec["paths"].items() for m in item}
    for needed in [("POST", "/v1/sandboxes"), ("GET", "/v1/sandboxes"), ("GET", "/v1/sandboxes/{sandbox_id}"),
                   ("DELETE", "/v1/sandboxes/{sandbox_id}"), ("POST", "/v1/sandboxes/{sandbox_id}/exec"),
                   ("POST", "/v1/sandboxes/{sandbox_id}/exec/stream"), ("POST", "/v1/sandboxes/{sandbox_id}/spawn"),
                   ("GET", "/v1/sandboxes/{sandbox_id}/files"), ("PUT", "/v1/sandboxes/{sandbox_id}/files"),
                   ("POST", "/v1/sandboxes/{sandbox_id}/snapshot"), ("POST", "/v1/sandboxes/{sandbox_id}/fork"),
                   ("POST", "/v1/sandboxes/{sandbox_id}/pause"), ("POST", "/v1/sandboxes/{sandbox_id}/resume"),
                   ("POST", "/v1/sandboxes/{sandbox_id}/ttl"), ("POST", "/v1/snapshots/{snapshot_id}/restore"),
                   ("POST", "/v1/snapshots/{snapshot_id}/receive"), ("GET", "/v1/snapshots"), ("DELETE", "/v1/snapshots/{snapshot_id}"),
                   ("POST", "/v1/sandboxes/{sandbox_id}/jobs"), ("GET", "/v1/sandboxes/{sandbox_id}/jobs"),
                   ("POST", "/v1/sandboxes/{sandbox_id}/jobs/{pid}/output"),
                   ("POST", "/v1/sandboxes/{sandbox_id}/jobs/{pid}/discard"),
                   ("POST", "/v1/sandboxes/{sandbox_id}/jobs/{pid}/input"),
                   ("POST", "/v1/sandboxes/{sandbox_id}/jobs/{pid}/close-input"),
                   ("POST", "/v1/sandboxes/{sandbox_id}/jobs/{pid}/signal"),
                   ("GET", "/v1/sandboxes/{sandbox_id}/stat"), ("GET", "/v1/sandboxes/{sandbox_id}/list"),
                   ("POST", "/v1/sandboxes/{sandbox_id}/mkdir"), ("POST", "/v1/sandboxes/{sandbox_id}/move"),
                   ("DELETE", "/v1/sandboxes/{sandbox_id}/files")]:
        assert needed in routes, needed
    for path, item in spec["paths"].items():
        for method, op in item.items():
            if path not in server.OPEN_PATHS:
                assert "401" in op["responses"] and "default" in op["responses"], (method, path)
                assert op.get("security"), (method, path)
            body = op.get("requestBody", {}).get("content", {})
            if wire.JSON in body:
                assert wire.MSGPACK in body, (method, path)
    assert "bearer" in str(spec["components"]["securitySchemes"]).lower()
    lineage = spec["components"]["schemas"]["SandboxInfo"]["properties"]  # a sandbox's lineage is in its body
    assert {"parent_snapshot", "forked_from"} <= lineage.keys()


def test_the_server_refuses_to_run_without_a_token(monkeypatch, tmp_path):
    monkeypatch.delenv(server.TOKEN_ENV, raising=False)
    with pytest.raises(ValueError, match="token"):
        server.create_app("")
    with pytest.raises(ValueError, match="token"):
        server.load_token(None)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    result = CliRunner().invoke(cli_app, ["serve", "--token-file", str(empty)])
    assert result.exit_code == 2 and "token" in result.output
    good = tmp_path / "tok"
    good.write_text("s3cret\n")
    assert server.load_token(good) == "s3cret"
    monkeypatch.setenv(server.TOKEN_ENV, "from-env")
    assert server.load_token(None) == "from-env"


def test_unknown_e2b_routes_are_404_in_e2b_shape_and_native_ones_keep_theirs(client):
    from e2b.api.client.models.error import Error  # the SDK's own model of an error body

    for method, path in (("GET", "/volumes"), ("POST", "/volumes/v-x"), ("GET", "/teams")):
        r = client.request(method, path, headers={"X-API-KEY": TOKEN})
        assert r.status_code == 404, (method, path)
        err = Error.from_dict(r.json())
        assert err.code == 404 and path in err.message
    for path in ("/v1/nothing", "/v1", "/health/x"):
        r = client.get(path, headers=AUTH)
        assert r.status_code == 404 and r.json()["error"] == "HTTPError" and "code" not in r.json(), path
    r = client.get("/v1/sandboxes/sb-nothere", headers=AUTH)  # a route's own 404 is untouched
    assert r.json()["error"] == "SandboxNotFound"
