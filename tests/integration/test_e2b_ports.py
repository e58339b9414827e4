"""Any port of a sandbox through a real ``agentenv serve --domain``: a web server started inside with the E2B SDK is
reached on E2B's routing headers and on the Host name ``get_host`` builds; responses stream, closed ports are
E2B's 502, the traffic token is required, and the connection is made inside the sandbox, never on the host."""

from __future__ import annotations

import base64
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .conftest import envd_token
from .server_fixtures import e2b_domain_server

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

WS_ECHO = r"""
import base64, hashlib, socket, threading
def exact(c, n):
    b = b""
    while len(b) < n:
        d = c.recv(n - len(b))
        if not d:
            raise EOFError
        b += d
    return b
def frame(op, data):
    n = len(data)
    size = bytes([n]) if n < 126 else b"\x7e" + n.to_bytes(2, "big") if n < 65536 else b"\x7f" + n.to_bytes(8, "big")
    return bytes([0x80 | op]) + size + data
def serve(c):
    head = b""
    while b"\r\n\r\n" not in head:
        head += c.recv(4096)
    lines = head.split(b"\r\n\r\n")[0].decode().split("\r\n")
    key = [l.split(":", 1)[1].strip() for l in lines if l.lower().startswith("sec-websocket-key:")][0]
    accept = base64.b64encode(hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest())
    c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
              b"Sec-WebSocket-Accept: " + accept + b"\r\nX-Path: " + lines[0].split()[1].encode() + b"\r\n\r\n")
    while True:
        h = exact(c, 2)
        op, n = h[0] & 15, h[1] & 127
        n = int.from_bytes(exact(c, 2 if n == 126 else 8), "big") if n >= 126 else n
        mask = exact(c, 4)
        data = bytes(b ^ mask[i % 4] for i, b in enumerate(exact(c, n)))
        if op == 8:
            c.sendall(frame(8, b""))
            break
        c.sendall(frame(op, b"echo:" + data))
    c.close()
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 8002))
s.listen()
while True:
    threading.Thread(target=serve, args=(s.accept()[0],), daemon=True).start()
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``agentenv serve --domain sandbox.test`` as a process, the SDK's variables pointing at it."""
    with e2b_domain_server(tmp_path_factory.mktemp("ports"), DOMAIN) as url:
        yield url


@pytest.fixture(scope="module")
def web(server: str) -> Iterator[Sandbox]:
    """A sandbox serving ``python3 -m http.server 8000`` and the slow server above on 8001."""
    sb = Sandbox.create(timeout=600)
    try:
        sb.files.write("/tmp/www/hello.txt", "hello from inside")
        sb.files.write("/tmp/slow.py", SLOW_SERVER)
        sb.commands.run("cd /tmp/www && exec python3 -m http.server 8000 --bind 127.0.0.1", background=True)
        sb.commands.run("exec python3 /tmp/slow.py", background=True)
        sb.files.write("/tmp/ws.py", WS_ECHO)
        sb.commands.run("exec python3 /tmp/ws.py", background=True)
        wait_listening(sb, 8000, 8001, 8002)
        yield sb
    finally:
        Sandbox.kill(sb.sandbox_id)


def _listening(sb: Sandbox, port: int) -> bool:
    r = sb.commands.run(f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}))\" "
                        "2>/dev/null && echo up || echo down")
    return r.stdout.strip() == "up"


def wait_listening(sb: Sandbox, *ports: int) -> None:
    """Until something listens on each of ``ports`` inside ``sb`` (a state, polled; 20 s each at most)."""
    for port in ports:
        deadline = time.monotonic() + 20
        while not _listening(sb, port):
            assert time.monotonic() < deadline, f"port {port} never opened"
            time.sleep(0.1)


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
    # envd's port on its get_host name too, with envd's token alone
    envd = {"X-Access-Token": str(envd_token(web))}
    r = httpx.get(f"{server}/health", headers={"Host": web.get_host(49983), **envd})
    assert r.status_code == 204
    r = httpx.get(f"{server}/health", headers={"Host": web.get_host(49983), **token})
    assert r.status_code == 401


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


def test_a_missing_or_wrong_token_is_e2bs_403(server: str, web: Sandbox) -> None:
    for token in ("", "0" * 64, str(web.traffic_access_token)[:-1] + "x"):
        r = httpx.get(f"{server}/hello.txt", headers=routed(web, 8000, token))
        assert r.status_code == 403, (token, r.text)
        r = httpx.get(f"{server}/hello.txt", headers={"Host": web.get_host(8000), "e2b-traffic-access-token": token})
        assert r.status_code == 403
    r = httpx.get(f"{server}/hello.txt", headers={"Host": web.get_host(8000)})
    assert r.status_code == 403
    envd = str(envd_token(web))  # envd's token is not the traffic token, in either header
    assert httpx.get(f"{server}/hello.txt", headers=routed(web, 8000, envd)).status_code == 403
    r = httpx.get(f"{server}/hello.txt", headers={**routed(web, 8000, ""), "X-Access-Token": envd})
    assert r.status_code == 403
    other = Sandbox.create(timeout=120)
    try:  # one sandbox's token opens no other sandbox's ports
        r = httpx.get(f"{server}/hello.txt", headers=routed(web, 8000, str(other.traffic_access_token)))
        assert r.status_code == 403
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


def _frame(op: int, data: bytes) -> bytes:
    """A client's (masked) WebSocket frame."""
    n = len(data)
    size = bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + n.to_bytes(2, "big") if n < 65536 else \
        bytes([0x80 | 127]) + n.to_bytes(8, "big")
    mask = os.urandom(4)
    return bytes([0x80 | op]) + size + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data))


def _read_frame(s: socket.socket) -> tuple[int, bytes]:
    def exact(n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = s.recv(n - len(out))
            assert chunk, "the connection closed mid-frame"
            out += chunk
        return out
    h = exact(2)
    n = h[1] & 127
    n = int.from_bytes(exact(2 if n == 126 else 8), "big") if n >= 126 else n
    return h[0] & 15, exact(n)


def _upgrade(server: str, headers: dict[str, str], path: str = "/chat") -> tuple[socket.socket, bytes]:
    host, port = server.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=15)
    key = base64.b64encode(os.urandom(16)).decode()
    lines = [f"GET {path} HTTP/1.1", "Upgrade: websocket", "Connection: Upgrade", f"Sec-WebSocket-Key: {key}",
             "Sec-WebSocket-Version: 13", *(f"{k}: {v}" for k, v in headers.items())]
    s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(4096)
        if not chunk:
            break
        head += chunk
    return s, head


def test_a_websocket_passes_through_on_the_headers_and_on_get_host(server: str, web: Sandbox) -> None:
    token = str(web.traffic_access_token)
    for headers in (routed(web, 8002), {"Host": web.get_host(8002), "e2b-traffic-access-token": token}):
        s, head = _upgrade(server, headers)
        try:
            assert head.startswith(b"HTTP/1.1 101"), head
            assert b"x-path: /chat" in head.lower()
            s.sendall(_frame(1, b"hello"))
            assert _read_frame(s) == (1, b"echo:hello")
            big = os.urandom(100_000)
            s.sendall(_frame(2, big))
            assert _read_frame(s) == (2, b"echo:" + big)
            s.sendall(_frame(8, b""))
            assert _read_frame(s) == (8, b"")
        finally:
            s.close()


def test_a_refused_websocket_gets_e2bs_error(server: str, web: Sandbox) -> None:
    s, head = _upgrade(server, routed(web, 8002, "0" * 64))
    s.close()
    assert head.startswith(b"HTTP/1.1 403")
    s, head = _upgrade(server, routed(web, 8998))
    s.close()
    assert head.startswith(b"HTTP/1.1 502")
    body = json.loads(head.split(b"\r\n\r\n", 1)[1])
    assert body["code"] == 502 and "port is not open" in body["message"] and body["port"] == 8998


def test_a_sandbox_without_a_network_serves_its_ports_across_a_pause(server: str) -> None:
    """The agent connects inside, so loopback alone is enough; an open WebSocket does not stop a pause (the tunnel
    is shut for the snapshot), and the listeners answer again once the sandbox is resumed."""
    sb = Sandbox.create(timeout=300, allow_internet_access=False)
    try:
        sb.files.write("/tmp/www/a.txt", "offline")
        sb.files.write("/tmp/ws.py", WS_ECHO)
        sb.commands.run("cd /tmp/www && exec python3 -m http.server 8000 --bind 127.0.0.1", background=True)
        sb.commands.run("exec python3 /tmp/ws.py", background=True)
        wait_listening(sb, 8000, 8002)
        assert httpx.get(f"{server}/a.txt", headers=routed(sb, 8000)).text == "offline"
        ws, head = _upgrade(server, routed(sb, 8002))
        try:
            assert head.startswith(b"HTTP/1.1 101")
            ws.sendall(_frame(1, b"before"))
            assert _read_frame(ws) == (1, b"echo:before")
            assert sb.pause() is True
            ws.settimeout(10)
            assert ws.recv(100) == b""  # the pause closed the spliced connection
        finally:
            ws.close()
        r = httpx.get(f"{server}/a.txt", headers=routed(sb, 8000))
        assert r.status_code == 502 and "paused" in r.json()["message"]
        Sandbox.connect(sb.sandbox_id)
        assert httpx.get(f"{server}/a.txt", headers=routed(sb, 8000), timeout=30).text == "offline"
        ws, head = _upgrade(server, routed(sb, 8002))
        try:
            assert head.startswith(b"HTTP/1.1 101")
            ws.sendall(_frame(1, b"after"))
            assert _read_frame(ws) == (1, b"echo:after")
        finally:
            ws.close()
    finally:
        Sandbox.kill(sb.sandbox_id)


def test_a_fork_child_serves_the_ports_its_parent_listened_on(server: str, web: Sandbox) -> None:
    """The listening sockets are copied with the processes: each child answers on its own host name and token."""
    kids = web.fork(count=1)
    try:
        (kid,) = kids
        assert kid.sandbox_id != web.sandbox_id
        r = httpx.get(f"{server}/hello.txt", headers={"Host": kid.get_host(8000),
                                                      "e2b-traffic-access-token": str(kid.traffic_access_token)})
        assert r.status_code == 200 and r.text == "hello from inside"
        kid.files.write("/tmp/www/hello.txt", "hello from the child")
        assert httpx.get(f"{server}/hello.txt", headers=routed(kid, 8000)).text == "hello from the child"
        assert httpx.get(f"{server}/hello.txt", headers=routed(web, 8000)).text == "hello from inside"
        r = httpx.get(f"{server}/hello.txt", headers=routed(kid, 8000, str(web.traffic_access_token)))
        assert r.status_code == 403  # the parent's token is not the child's
    finally:
        for kid in kids:
            Sandbox.kill(kid.sandbox_id)


def test_a_listener_that_breaks_http_is_a_502_not_a_hang(server: str, web: Sandbox) -> None:
    garbage = ("import socket\ns = socket.socket()\ns.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
               "s.bind(('127.0.0.1', 8003))\ns.listen()\nwhile True:\n    c = s.accept()[0]\n    c.recv(65536)\n"
               "    c.sendall(b'NOT HTTP AT ALL' + b'x' * 100000 + b'\\r\\n\\r\\n')\n    c.close()\n")
    web.files.write("/tmp/garbage.py", garbage)
    web.commands.run("exec python3 /tmp/garbage.py", background=True)
    wait_listening(web, 8003)
    r = httpx.get(f"{server}/", headers=routed(web, 8003), timeout=30)
    assert r.status_code == 502 and "did not answer HTTP" in r.json()["message"], r.text
    assert httpx.get(f"{server}/hello.txt", headers=routed(web, 8000)).status_code == 200  # the server goes on
