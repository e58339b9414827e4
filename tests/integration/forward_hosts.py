"""Host endpoints for the forward tests and benchmark: an HTTP server on the host's loopback that records what
reaches it, answers a streamed response (server-sent events) whose events wait for the test, and holds requests
until let go; and the script a process inside a sandbox runs to call it."""

from __future__ import annotations

import contextlib
import http.server
import shlex
import threading
from collections.abc import Iterator


class Endpoint(http.server.ThreadingHTTPServer):
    """``/hold`` waits until ``release`` is set; ``/sse`` sends one event, waits for ``release``, then two more;
    ``POST`` echoes the body; anything else answers ``hello <path>``. ``paths`` records every request line's target,
    ``open_now`` and ``most_open`` the connections open at once."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.paths: list[str] = []
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.open_now = self.most_open = 0

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def process_request_thread(self, request: object, client_address: object) -> None:
        with self.lock:
            self.open_now += 1
            self.most_open = max(self.most_open, self.open_now)
        try:
            super().process_request_thread(request, client_address)  # type: ignore[misc]
        finally:
            with self.lock:
                self.open_now -= 1


class _Handler(http.server.BaseHTTPRequestHandler):
    server: Endpoint
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def _answer(self, body: bytes, kind: str = "text/plain") -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        with self.server.lock:
            self.server.paths.append(self.path)
        if self.path.startswith("/hold"):
            self.server.release.wait(120)
        if self.path.startswith("/sse"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(3):
                if i == 1:
                    self.server.release.wait(120)
                event = f"data: event {i}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            return
        self._answer(b"hello " + self.path.encode())

    def do_POST(self) -> None:  # noqa: N802
        with self.server.lock:
            self.server.paths.append(self.path)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self._answer(body, "application/octet-stream")

    def do_CONNECT(self) -> None:  # noqa: N802 - a proxy's verb: this server is none, it just answers
        self.do_GET()


@contextlib.contextmanager
def endpoint() -> Iterator[Endpoint]:
    srv = Endpoint()
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield srv
    finally:
        srv.release.set()
        srv.shutdown()
        srv.server_close()


def python(code: str) -> str:
    """A shell command running ``code`` with the sandbox's python3."""
    return f"python3 -c {shlex.quote(code)}"


def get(url: str, timeout: float = 30) -> str:
    """A shell command that prints the body ``url`` answers (urllib, as a harness's SDK would call)."""
    return python(f"import urllib.request\nprint(urllib.request.urlopen({url!r}, timeout={timeout}).read().decode())")
