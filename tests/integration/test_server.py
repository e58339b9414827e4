"""The environment server on loopback: abuse (tokens, ids, bodies, paths), quotas, TTL, streaming, metrics, schemathesis."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import msgpack
import pytest

import agentenv
from agentenv import wire
from agentenv.errors import DiskLimitRequired, QuotaExceeded, SandboxStateError, Unauthorized
from agentenv.sandbox import warm

from .server_fixtures import TOKEN, threaded_server

pytestmark = pytest.mark.integration
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def url():
    with threaded_server(max_sandboxes=8, reap_interval=0.2) as u:
        yield u


@pytest.fixture(scope="module")
def client(url):
    c = agentenv.connect(url, TOKEN)
    yield c
    c.close()


@pytest.fixture(scope="module")
def sb(client):
    with client.Sandbox.create(memory="256m", ttl=None) as s:  # the module's: closed at its teardown, no deadline
        yield s


def test_wrong_token_changes_nothing(url, sb):
    before = {s.id for s in agentenv.Sandbox.list()}
    bad = agentenv.connect(url, "not-the-token")
    try:
        with pytest.raises(Unauthorized):
            bad.Sandbox.create()
        with pytest.raises(Unauthorized):
            bad.Sandbox.get(sb.id).exec("touch /tmp/pwned")
        r = httpx.delete(f"{url}/v1/sandboxes/{sb.id}")
        assert r.status_code == 401
        r = httpx.post(f"{url}/v1/sandboxes/{sb.id}/exec", json={"command": "touch /tmp/pwned"},
                       headers={"Authorization": "Bearer " + TOKEN[:-1]})
        assert r.status_code == 401
    finally:
        bad.close()
    assert {s.id for s in agentenv.Sandbox.list()} == before
    assert sb.exec("test -e /tmp/pwned").exit_code == 1


def test_bodies_in_msgpack_and_json(url, sb):
    r = httpx.post(f"{url}/v1/sandboxes/{sb.id}/exec", content=msgpack.packb({"command": "echo mp"}),
                   headers={**AUTH, "Content-Type": wire.MSGPACK, "Accept": wire.MSGPACK})
    assert r.headers["content-type"] == wire.MSGPACK and msgpack.unpackb(r.content)["stdout"] == "mp\n"
    r = httpx.post(f"{url}/v1/sandboxes/{sb.id}/exec", json={"command": "echo js"}, headers=AUTH)
    assert r.headers["content-type"] == wire.JSON and r.json()["stdout"] == "js\n"
    for body, ctype in [(b"\xc1\x00", wire.MSGPACK), (b"{", wire.JSON), (msgpack.packb({"command": 5}), wire.MSGPACK),
                        (json.dumps({"command": "x", "env": {"A": 1}}).encode(), wire.JSON)]:
        r = httpx.post(f"{url}/v1/sandboxes/{sb.id}/exec", content=body, headers={**AUTH, "Content-Type": ctype})
        assert 400 <= r.status_code < 500 and r.json()["message"], (body, r.text)


def test_streaming_exec_in_ndjson(url, sb):
    with httpx.stream("POST", f"{url}/v1/sandboxes/{sb.id}/exec/stream", json={"command": "echo a; sleep 0.3; echo b"},
                      headers=AUTH) as r:
        assert r.headers["content-type"].startswith(wire.NDJSON)
        frames = [json.loads(line) for line in r.iter_lines() if line]
    out = b"".join(base64.b64decode(f["data"]) for f in frames if "stream" in f)
    assert out == b"a\nb\n" and len(frames) >= 3
    assert frames[-1]["result"]["stdout"] == "a\nb\n"


def test_job_output_streams_in_ndjson_from_offsets(url, sb):
    job = httpx.post(f"{url}/v1/sandboxes/{sb.id}/jobs", json={"command": "printf abc; sleep 0.3; printf def"},
                     headers=AUTH).json()
    out = f"{url}/v1/sandboxes/{sb.id}/jobs/{job['pid']}/output"
    with httpx.stream("POST", out, json={"offsets": [1, 0]}, headers=AUTH) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith(wire.NDJSON)
        frames = [json.loads(line) for line in r.iter_lines() if line]
    data = [(f["offset"], base64.b64decode(f["data"])) for f in frames if f.get("stream") == "stdout"]
    assert data[0][0] == 1 and b"".join(d for _, d in data) == b"bcdef"
    assert frames[-1]["end"]["exit_code"] == 0 and not frames[-1]["end"]["timed_out"]
    r = httpx.post(out, json={}, headers=AUTH)  # its end was read: the job is gone, a 404 before any stream
    assert r.status_code == 404 and r.json()["error"] == "ProcessLookupError"
    r = httpx.post(f"{url}/v1/sandboxes/{sb.id}/jobs/{job['pid']}/input", content=b"x", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"] == "ProcessLookupError"


def test_file_routes_stay_inside_the_sandbox(client, sb):
    marker = f"agentenv-escape-{uuid.uuid4().hex}"
    for path in (f"../../../../../../tmp/{marker}", f"/../../../tmp/{marker}", f"/proc/1/root/tmp/{marker}"):
        sb.write_file(path, "x")
        assert not Path(f"/tmp/{marker}").exists()
    assert sb.exec(f"cat /tmp/{marker}").stdout == "x"  # it landed in the sandbox's own /tmp
    host_file = Path(f"/tmp/{marker}-host")
    host_file.write_text("host secret")
    try:
        for path in (f"/../../../../tmp/{marker}-host", f"../../../../../tmp/{marker}-host",
                     f"/proc/1/root/tmp/{marker}-host"):
            with pytest.raises(FileNotFoundError):
                sb.read_file(path)
    finally:
        host_file.unlink()
    sb.exec(f"ln -sf / /tmp/root-link-{marker}")
    sb.write_file(f"/tmp/root-link-{marker}/tmp/{marker}-2", "y")
    assert not Path(f"/tmp/{marker}-2").exists()
    r = httpx.get(f"{client.url}/v1/sandboxes/{sb.id}/files", params={"path": "/etc/\x00passwd"}, headers=AUTH)
    assert r.status_code == 422


def test_quota_is_429_and_retry_after(sb):
    live = sum(1 for s in agentenv.Sandbox.list() if s.state == "running")  # the quota counts the whole host
    with threaded_server(max_sandboxes=live + 1, reap_interval=60) as u:
        c = agentenv.connect(u, TOKEN)
        try:
            with c.Sandbox.create(memory="256m") as one:
                with pytest.raises(QuotaExceeded) as e:
                    c.Sandbox.create(memory="256m")
                assert e.value.retry_after > 0
                with pytest.raises(QuotaExceeded):
                    one.fork(1)
                r = httpx.post(f"{u}/v1/sandboxes", json={}, headers=AUTH)
                assert r.status_code == 429 and int(r.headers["retry-after"]) > 0
                assert one.exec("echo still fine").stdout == "still fine\n"
            with pytest.raises(QuotaExceeded):
                c.Sandbox.create(memory="100g")  # past the memory quota (64g by default)
            with pytest.raises(QuotaExceeded, match="disk"):
                c.Sandbox.create(memory="256m", disk="1t")  # past the disk quota (640g by default)
            with pytest.raises(DiskLimitRequired, match="unlimited-disk"):
                c.Sandbox.create(memory="256m", disk=None)  # this server gives every sandbox a disk limit
        finally:
            c.close()


def test_ttl_closes_by_default_pauses_when_asked_and_can_be_extended(client):
    gone = client.Sandbox.create(memory="256m", ttl=0.5)  # nobody asked to keep it: closed, no snapshot kept
    s = client.Sandbox.create(memory="256m", ttl=0.5, labels={"agentenv.on_expiry": "pause"})
    try:
        s.write_file("/testbed/state", "kept")
        deadline = time.monotonic() + 60
        while s.state != "paused" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert s.state == "paused"
        while gone.id in {x.id for x in client.Sandbox.list()} and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone.id not in {x.id for x in client.Sandbox.list()}
        with pytest.raises(SandboxStateError):
            s.exec("true")
        s.set_ttl(3600)
        s.resume()
        assert s.read_file("/testbed/state") == b"kept"
        assert s.expires_at is not None and s.expires_at > time.time() + 3000
    finally:
        s.close()


def test_metrics_and_health_are_open(url, sb):
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    text = httpx.get(f"{url}/metrics").text
    assert 'agentenv_sandboxes{state="running"}' in text
    assert "agentenv_snapshot_store_bytes" in text
    assert 'agentenv_operation_seconds_count{op="exec_command"}' in text


SCHEMATHESIS_CONFIG = """
[dictionaries.sandboxes]
values = ["{sandbox}"]

[parameters]
"path.sandbox_id" = {{ dictionary = "sandboxes", probability = 0.5 }}

# a rule's entry can be well formed and still not enforceable (a name that does not resolve, an address no
# sandbox may reach): the route answers 400 NetworkRuleError, documented, for schema-valid bodies too
[[operations]]
include-name = "PUT /v1/sandboxes/{{sandbox_id}}/network"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "403", "404", "409", "429", "5xx"]

[[operations]]
include-name = "POST /v1/sandboxes"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "403", "404", "409", "429", "5xx"]

# an import pulls from the url it is given: one where no server answers is a documented 502 ConnectionLost
# (a Bad Gateway), after the pull's connect timeout and retries; a well-formed host can still be no address
# (all-digit labels that are no IPv4 address): a documented 400
[[operations]]
include-name = "POST /v1/snapshots/import"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "403", "404", "409", "429", "5xx"]
checks.not_a_server_error.expected-statuses = ["2xx", "3xx", "4xx", "502"]
checks.max_response_time = 60

# eviction removes the host's Docker images (the fuzzer once evicted the task and code-interpreter images of the
# machine running the tests): not fuzzed; test_image_store checks it, and the route's body is pydantic's
[[operations]]
include-name = "POST /v1/images/evict"
enabled = false
"""


def test_schemathesis_finds_no_server_error_and_no_spec_violation(tmp_path):
    """Fuzz every route from the served OpenAPI spec: half the sandbox ids are a real sandbox's."""
    with threaded_server(max_sandboxes=3, max_memory="2g", reap_interval=60) as u:
        c = agentenv.connect(u, TOKEN)
        try:
            real = c.Sandbox.create(memory="256m")
            config = tmp_path / "schemathesis.toml"
            config.write_text(SCHEMATHESIS_CONFIG.format(sandbox=real.id))
            env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.integration.schemathesis_hooks",
                   "PYTHONPATH": str(Path(__file__).parents[2])}
            cmd = [str(Path(sys.executable).parent / "schemathesis"), "--config-file", str(config), "run",
                   f"{u}/openapi.json", "-H", f"Authorization: Bearer {TOKEN}", "--checks", "all",
                   "--max-examples", "12", "--seed", "7", "--continue-on-failure", "--request-timeout", "120"]
            p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False,
                               cwd=Path(__file__).parents[2])
            assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-2000:]
        finally:
            for s in c.Sandbox.list():
                s.close()
            for snap in c.Snapshot.list():
                snap.delete()
            c.close()


def test_a_warm_pool_on_the_server_serves_creates_and_is_drained_at_exit():
    def pooled() -> list[str]:
        return [sb.id for sb in agentenv.Sandbox.list() if sb.labels.get("agentenv.kind") == "warm"]

    with threaded_server(warm_pool=1) as url:
        assert warm.wait_full(60), "the warm pool never filled"  # the server runs in this process: its pool
        [ready] = pooled()
        client = agentenv.connect(url, TOKEN)
        sb = client.Sandbox.create(labels={"who": "me"})  # the default image and limits: the pool's shape
        try:
            assert sb.id == ready and sb.labels == {"who": "me"}
            assert sb.exec("echo served").stdout == "served\n"
        finally:
            sb.close()
            client.close()
    assert pooled() == []  # the server's exit closed what the pool still held
