"""Any port of a sandbox through a real ``agentenv serve --domain``: a web server started inside with the E2B SDK is
reached on E2B's routing headers and on the Host name ``get_host`` builds; responses stream, closed ports are
E2B's 502, the traffic token is required, and the connection is made inside the sandbox, never on the host."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .server_fixtures import TOKEN, free_port, start_server_process, write_token_file

e2b = pytest.importorskip("e2b", reason="the E2B SDK is a test extra; bootstrap installs it")

from e2b import Sandbox  # noqa: E402

DOMAIN = "sandbox.test"
SLOW_SERVER = r"""
import http.server, json, time
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i in range(3):
            d = f"tick {i}\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(d), d))
            self.wfile.flush()
            time.sleep(0.6)
        self.wfile.write(b"0\r\n\r\n")
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        while self.headers.get("transfer-encoding") == "chunked":
            n = int(self.rfile.readline(), 16)
            body += self.rfile.read(n + 2)[:n]
            if not n:
                break
        out = json.dumps({"path": self.path, "body": body.decode(), "headers": dict(self.headers)}).encode()
        self.send_response(201)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)
http.server.ThreadingHTTPServer(("127.0.0.1", 8001), H).serve_forever()
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``agentenv serve --domain sandbox.test`` as a process, the SDK's variables pointing at it."""
    port = free_port()
    proc = start_server_process(port, write_token_file(tmp_path_factory.mktemp("ports")), "--domain", DOMAIN)
    url = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "E2B_DEBUG")}
    os.environ.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY=TOKEN)
    os.environ.pop("E2B_DEBUG", None)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def web(server: str) -> Iterator[Sandbox]:
    """A sandbox serving ``python3 -m http.server 8000`` and the slow server above on 8001."""
    sb = Sandbox.create(timeout=600)
    try:
        sb.files.write("/tmp/www/hello.txt", "hello from inside")
        sb.files.write("/tmp/slow.py", SLOW_SERVER)
        sb.commands.run("cd /tmp/www && exec python3 -m http.server 8000 --bind 127.0.0.1", background=True)
        sb.commands.run("exec python3 /tmp/slow.py", background=True)
        for port in (8000, 8001):
            deadline = time.monotonic() + 20
            while not _listening(sb, port):
                assert time.monotonic() < deadline, f"port {port} never opened"
                time.sleep(0.1)
        yield sb
    finally:
        Sandbox.kill(sb.sandbox_id)


def _listening(sb: Sandbox, port: int) -> bool:
    r = sb.commands.run(f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}))\" "
                        "2>/dev/null && echo up || echo down")
    return r.stdout.strip() == "up"


def routed(sb: Sandbox, port: int, token: str | None = None) -> dict[str, str]:
    return {"E2b-Sandbox-Id": sb.sandbox_id, "E2b-Sandbox-Port": str(port),
            "e2b-traffic-access-token": sb.traffic_access_token if token is None else token}


def test_a_web_server_inside_is_reached_on_the_headers_and_on_get_host(server: str, web: Sandbox) -> None:
    r = httpx.get(f"{server}/hello.txt", headers=routed(web, 8000))
    assert r.status_code == 200 and r.text == "hello from inside"
    host = web.get_host(8000)
    assert host == f"8000-{web.sandbox_id}.{DOMAIN}"
    # what a wildcard DNS name (or curl --resolve) gives: the server's address, the sandbox's host name
    token = {"e2b-traffic-access-token": str(web.traffic_access_token)}
    r = httpx.get(f"{server}/hello.txt", headers={"Host": host, **token})
    assert r.status_code == 200 and r.text == "hello from inside"
    r = httpx.get(f"{server}/hello.txt", headers={"Host": f"{host}:443", **token})
    assert r.status_code == 200
    r = httpx.get(f"{server}/missing", headers={"Host": host, **token})
    assert r.status_code == 404  # the listener's own answer, passed through
    # envd's port on its get_host name too
    r = httpx.get(f"{server}/health", headers={"Host": web.get_host(49983), "X-Access-Token": token[
        "e2b-traffic-access-token"]})
    assert r.status_code == 204


def test_a_request_body_goes_in_and_the_routing_headers_stay_out(server: str, web: Sandbox) -> None:
    r = httpx.post(f"{server}/echo?x=1", headers={**routed(web, 8001), "X-Mine": "kept"}, content=b"payload")
    assert r.status_code == 201, r.text
    seen = r.json()
    got = {k.lower(): v for k, v in seen["headers"].items()}
    assert seen["path"] == "/echo?x=1" and seen["body"] == "payload" and got["x-mine"] == "kept"
    names = set(got)
    assert not names & {"e2b-sandbox-id", "e2b-sandbox-port", "e2b-traffic-access-token", "x-access-token"}

    def chunks() -> Iterator[bytes]:
        yield b"stream"
        yield b"ed"
    r = httpx.post(f"{server}/up", headers=routed(web, 8001), content=chunks())
    assert r.status_code == 201 and r.json()["body"] == "streamed"


def test_a_streamed_response_arrives_as_it_is_written(server: str, web: Sandbox) -> None:
    arrivals: list[tuple[float, bytes]] = []
    with httpx.stream("GET", f"{server}/", headers=routed(web, 8001), timeout=30) as r:
        assert r.status_code == 200
        for chunk in r.iter_raw():
            arrivals.append((time.monotonic(), chunk))
    assert b"".join(c for _, c in arrivals) == b"tick 0\ntick 1\ntick 2\n"
    assert arrivals[-1][0] - arrivals[0][0] > 0.9, "the ticks came all at once: the response was buffered"


def test_a_closed_port_is_e2bs_502(server: str, web: Sandbox) -> None:
    r = httpx.get(f"{server}/", headers=routed(web, 8999))
    assert r.status_code == 502
    body = r.json()
    assert body["code"] == 502 and "port is not open" in body["message"]
    assert body["sandboxId"] == web.sandbox_id and body["port"] == 8999


def test_a_missing_or_wrong_token_is_401(server: str, web: Sandbox) -> None:
    for token in ("", "0" * 64, str(web.traffic_access_token)[:-1] + "x"):
        r = httpx.get(f"{server}/hello.txt", headers=routed(web, 8000, token))
        assert r.status_code == 401, (token, r.text)
        r = httpx.get(f"{server}/hello.txt", headers={"Host": web.get_host(8000), "e2b-traffic-access-token": token})
        assert r.status_code == 401
    r = httpx.get(f"{server}/hello.txt", headers={"Host": web.get_host(8000)})
    assert r.status_code == 401
    other = Sandbox.create(timeout=120)
    try:  # one sandbox's token opens no other sandbox's ports
        r = httpx.get(f"{server}/hello.txt", headers=routed(web, 8000, str(other.traffic_access_token)))
        assert r.status_code == 401
    finally:
        Sandbox.kill(other.sandbox_id)


def test_the_port_is_the_sandboxs_never_the_hosts(server: str, web: Sandbox, tmp_path: Path) -> None:
    """A listener on the host's loopback is not what a sandbox's port reaches: the agent connects inside."""
    host_listener = socket.socket()
    host_listener.bind(("127.0.0.1", 0))
    host_listener.listen()
    port = host_listener.getsockname()[1]
    try:
        r = httpx.get(f"{server}/", headers=routed(web, port))
        assert r.status_code == 502 and "port is not open" in r.json()["message"]
        host_listener.settimeout(0.2)
        with pytest.raises(TimeoutError):
            host_listener.accept()  # nothing came to the host's port
        # the server's own port (on the host's loopback) is not reachable as a sandbox port either
        r = httpx.get(f"{server}/health", headers=routed(web, int(server.rsplit(":", 1)[1])))
        assert r.status_code == 502
    finally:
        host_listener.close()
