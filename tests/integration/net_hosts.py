"""Test hosts "outside" the machine, made on it: a network namespace joined to the host by a veth, with addresses
of documentation and private ranges, serving HTTP (it answers with the caller's address), a TCP port that
echoes, and DNS (A records given on the command line). No traffic of the tests leaves this machine: every
address a sandbox is sent to in them is one of these, routed to this namespace before any test runs.

Run inside the namespace as ``python3 net_hosts.py PORT_HTTP PORT_ECHO NAME=ADDR...``; ``outside_hosts()``
makes the namespace, starts it there and removes both.
"""

from __future__ import annotations

import contextlib
import http.server
import socket
import socketserver
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HOST_END = "tstout0"
ALLOWED, DENIED, PRIVATE, METADATA = "198.51.100.2", "198.51.100.3", "10.214.7.2", "169.254.169.254"
HTTP_PORT, ECHO_PORT = 8080, 8081
NAMES = {"allowed.test": ALLOWED, "denied.test": DENIED}


@dataclass(frozen=True)
class Outside:
    """The outside test hosts: their namespace's name and what each address is for."""

    netns: str
    allowed: str = ALLOWED
    denied: str = DENIED
    private: str = PRIVATE
    metadata: str = METADATA
    http_port: int = HTTP_PORT
    echo_port: int = ECHO_PORT
    dns: str = ALLOWED


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def outside_hosts() -> Iterator[Outside]:
    """Make the outside namespace and its servers; wait until they answer from the host; remove all after."""
    name = f"agentenv-outside-{Path('/proc/self').resolve().name}"
    _sh("ip", "netns", "add", name)
    proc = None
    try:
        _sh("ip", "link", "add", HOST_END, "type", "veth", "peer", "name", "eth0", "netns", name)
        for cidr in ("198.51.100.1/24", "10.214.7.1/24", "169.254.0.1/16"):
            _sh("ip", "addr", "add", cidr, "dev", HOST_END)
        _sh("ip", "link", "set", HOST_END, "up")
        for cidr in (f"{ALLOWED}/24", f"{DENIED}/24", f"{PRIVATE}/24", f"{METADATA}/16"):
            _sh("ip", "-n", name, "addr", "add", cidr, "dev", "eth0")
        _sh("ip", "-n", name, "link", "set", "eth0", "up")
        _sh("ip", "-n", name, "link", "set", "lo", "up")
        for addr in (ALLOWED, DENIED, PRIVATE, METADATA):  # routed here, never out of the machine
            route = subprocess.run(["ip", "route", "get", addr], capture_output=True, text=True, check=True).stdout
            assert f"dev {HOST_END}" in route, f"{addr} is not routed to the test namespace: {route}"
        proc = subprocess.Popen(["ip", "netns", "exec", name, sys.executable, __file__, str(HTTP_PORT),
                                 str(ECHO_PORT), *(f"{k}={v}" for k, v in NAMES.items())],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:  # ready when its ports answer
            try:
                with socket.create_connection((ALLOWED, HTTP_PORT), timeout=1), \
                        socket.create_connection((ALLOWED, ECHO_PORT), timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the outside test hosts did not come up") from None
                time.sleep(0.05)
        yield Outside(name)
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        subprocess.run(["ip", "link", "del", HOST_END], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


# --- the servers, run inside the namespace --------------------------------------------------------


class _Who(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        body = f"{self.connection.getsockname()[0]} {self.client_address[0]}\n".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


def _dns(names: dict[str, str]) -> None:
    """Answer A queries for ``names`` (NXDOMAIN for others) on UDP port 53 of every address here."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", 53))
    while True:
        data, peer = s.recvfrom(512)
        if len(data) < 12:
            continue
        qid, _flags, qd = struct.unpack("!HHH", data[:6])
        pos, labels = 12, []
        while pos < len(data) and data[pos]:
            labels.append(data[pos + 1:pos + 1 + data[pos]].decode(errors="replace"))
            pos += 1 + data[pos]
        question = data[12:pos + 5]
        qtype = struct.unpack("!H", data[pos + 1:pos + 3])[0] if pos + 3 <= len(data) else 0
        addr = names.get(".".join(labels).lower())
        answers = b""
        if addr and qtype == 1:
            answers = b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 60, 4) + socket.inet_aton(addr)
        rcode = 0 if addr else 3
        header = struct.pack("!HHHHHH", qid, 0x8180 | rcode, qd, 1 if answers else 0, 0, 0)
        s.sendto(header + question + answers, peer)


def main(argv: list[str]) -> None:
    http_port, echo_port = int(argv[0]), int(argv[1])
    names = dict(a.split("=", 1) for a in argv[2:])
    threading.Thread(target=_dns, args=(names,), daemon=True).start()
    echo = socketserver.ThreadingTCPServer(("0.0.0.0", echo_port), _Echo)
    threading.Thread(target=echo.serve_forever, daemon=True).start()
    http.server.ThreadingHTTPServer(("0.0.0.0", http_port), _Who).serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
