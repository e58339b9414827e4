"""Request bodies are bounded while they stream in (no Docker: the limits are shrunk for the test)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from agentenv import server
from agentenv.server import limits

TOKEN = "unit-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def client(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTENV_HOME", str(tmp_path))
    monkeypatch.setattr(limits, "MAX_BODY", 4096)
    monkeypatch.setattr(limits, "MAX_UPLOAD", 64 << 10)
    with TestClient(server.create_app(TOKEN, max_sandboxes=0, reap_interval=60)) as c:
        yield c


def test_a_declared_length_over_the_limit_is_refused_before_the_body_is_read(client):
    r = client.post("/v1/sandboxes/sb-1/exec", content=b"x" * 5000, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413
    assert r.json()["error"] == "PayloadTooLarge" and "4096" in r.json()["message"]
    r = client.post("/v1/sandboxes", content=b"{}", headers={**AUTH, "Content-Length": "-1"})
    assert r.status_code == 413  # a length that is not a number is no way around the limit


def test_a_chunked_body_over_the_limit_is_413(client):
    """No Content-Length: the bytes are counted as they come (a real server stops reading: integration test)."""

    def chunks():
        for _ in range(1000):
            yield b"x" * 1024

    r = client.post("/v1/sandboxes/sb-1/exec", content=chunks(), headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"] == "PayloadTooLarge"


def test_uploads_have_their_own_larger_limit(client):
    small = b"y" * 8192  # over MAX_BODY, under MAX_UPLOAD: it reaches the route (404: no such sandbox)
    r = client.put("/v1/sandboxes/sb-1/files", params={"path": "/tmp/f"}, content=small, headers=AUTH)
    assert r.status_code == 404 and r.json()["error"] == "SandboxNotFound"

    def chunks():
        for _ in range(200):
            yield b"z" * 1024

    r = client.put("/v1/sandboxes/sb-1/files", params={"path": "/tmp/f"}, content=chunks(), headers=AUTH)
    assert r.status_code == 413


def test_bodies_under_the_limit_go_through(client):
    r = client.post("/v1/sandboxes/sb-1/exec", json={"command": "true"}, headers=AUTH)
    assert r.status_code == 404 and r.json()["error"] == "SandboxNotFound"
