"""The environment server against hostile clients (issue 10, items 7 and 8): bodies bounded while they stream,
and connections that stall are closed. A real uvicorn server on loopback, with the limits shrunk."""

from __future__ import annotations

import contextlib
import socket
import time

import pytest

from agentenv.server import limits

from .server_fixtures import TOKEN, threaded_server

pytestmark = pytest.mark.integration


@pytest.fixture
def url(monkeypatch):
    monkeypatch.setattr(limits, "HEADER_TIMEOUT", 1.0)
    monkeypatch.setattr(limits, "BODY_IDLE_TIMEOUT", 1.0)
    monkeypatch.setattr(limits, "MAX_BODY", 64 << 10)
    with threaded_server(max_sandboxes=2, reap_interval=60) as u:
        yield u


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=15)
    return s


def _closed_by_server(s: socket.socket) -> bool:
    """Read until the server closes (True) or 15 s pass without it (False)."""
    s.settimeout(15)
    try:
        while s.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    return True


def _trickle(s: socket.socket, piece: bytes, times: int, pause: float) -> bool:
    """Send ``piece`` ``times`` times, ``pause`` s apart; True when the server closed the connection meanwhile
    or right after."""
    try:
        for _ in range(times):
            s.sendall(piece)
            time.sleep(pause)
    except OSError:
        return True
    return _closed_by_server(s)


def test_stalled_and_silent_connections_are_closed(url):
    socks = [_connect(url) for _ in range(40)]
    try:
        for i, s in enumerate(socks):
            if i % 2:  # half send a start of headers and stall (unauthenticated), half send nothing
                s.sendall(b"GET /v1/sandboxes HTTP/1.1\r\nHost: x\r\n")
        assert all(_closed_by_server(s) for s in socks)
    finally:
        for s in socks:
            s.close()


def test_a_stalled_body_is_dropped_and_a_trickle_of_headers_cannot_go_on(url):
    s = _connect(url)
    s.sendall(f"POST /v1/sandboxes/sb-x/exec HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
              "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"command\":".encode())
    assert _closed_by_server(s)
    s.close()
    s = _connect(url)
    try:
        s.sendall(b"GET /health HTTP/1.1\r\n")
        # one header line every 0.3 s for up to 6 s: progress, but the headers never end
        assert _trickle(s, b"X-Slow: 1\r\n", 20, 0.3)
    finally:
        s.close()


def test_huge_headers_are_refused(url):
    s = _connect(url)
    try:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        assert _trickle(s, b"X-Big: " + b"a" * 4096 + b"\r\n", 200, 0.0)  # 800 KiB of headers; the cap is 64
    finally:
        s.close()


def test_a_chunked_body_past_the_limit_is_413_before_it_is_all_sent(url):
    s = _connect(url)
    try:
        s.sendall(f"POST /v1/sandboxes/sb-x/exec HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                  "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        chunk = b"%x\r\n%s\r\n" % (8192, b"x" * 8192)
        sent, reply = 0, b""
        s.settimeout(0.05)
        while sent < 2000 and not reply:  # up to 16 MiB; the limit is 64 KiB
            try:
                s.sendall(chunk)
            except OSError:
                break
            sent += 1
            with contextlib.suppress(TimeoutError):
                reply = s.recv(65536)
        s.settimeout(15)
        reply += b"" if reply else s.recv(65536)
        assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
        assert b"PayloadTooLarge" in reply
        assert sent < 2000  # answered long before the client was done
    finally:
        s.close()


def test_an_honest_client_still_works(url):
    import httpx

    r = httpx.get(f"{url}/v1/server", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200 and r.json()["capacity"]["max_sandboxes"] == 2
