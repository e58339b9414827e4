"""A host endpoint forwarded into a sandbox (``Sandbox.forward``, ``agentenv.sandbox.forward``): a process inside
reaches an HTTP server on the host's loopback through ``127.0.0.1:PORT`` of its own, without network, streamed
responses included; and nothing else of the host (the boundary of docs/security.md holds, whatever the sandbox
sends through the forward); a flood or a slow sender is bounded; forks, pauses, snapshots and restores keep
a working forward (a restore once it is made again)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

import agentenv
from agentenv.sandbox import forward

from .forward_hosts import Endpoint, endpoint, get, python
from .netprobe import host_addresses, probe, reached

PORT = 8000  # in the sandboxes


def _wait(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


@pytest.fixture
def ep():
    with endpoint() as e:
        yield e


def test_a_sandbox_without_network_reaches_the_forwarded_endpoint(ep: Endpoint):
    with agentenv.Sandbox.create() as sb:
        assert sb.network is None
        fwd = sb.forward(PORT, ("127.0.0.1", ep.port))
        assert fwd.url == f"http://127.0.0.1:{PORT}" and sb.forwards == [fwd]
        r = sb.exec(get(f"{fwd.url}/v1/models"))
        assert (r.exit_code, r.stdout) == (0, "hello /v1/models\n"), r.stderr
        # 4 MiB of every byte value, both ways, unchanged
        r = sb.exec(python(f"""
import hashlib, urllib.request
body = bytes(range(256)) * 16384
got = urllib.request.urlopen(urllib.request.Request("{fwd.url}/echo", data=body), timeout=60).read()
print(got == body, hashlib.sha256(got).hexdigest()[:8])"""))
        assert r.stdout.startswith("True"), (r.stdout, r.stderr)
        assert ep.paths == ["/v1/models", "/echo"]
        assert sb.forward(PORT, ("127.0.0.1", ep.port)) == fwd  # again, the same: nothing changes
        with pytest.raises(ValueError, match="forwarded to"):
            sb.forward(PORT, ("127.0.0.1", ep.port + 1))


def test_a_port_taken_inside_or_a_bad_target_is_refused_saying_what(ep: Endpoint):
    with agentenv.Sandbox.create() as sb:
        server = sb.spawn("python3 -m http.server 8001 --bind 127.0.0.1")
        _wait(lambda: _listening(sb, 8001), "the sandbox's own server listens")
        with pytest.raises(OSError, match="may hold the port; forward another one"):
            sb.forward(8001, ("127.0.0.1", ep.port))
        with pytest.raises(ValueError, match="host address, port"):
            sb.forward(PORT, "127.0.0.1:80")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="IP address"):
            sb.forward(PORT, ("localhost", ep.port))
        assert sb.forwards == [] and server.exit_code is None


def test_a_streamed_response_reaches_the_sandbox_event_by_event(ep: Endpoint):
    """Server-sent events, as a harness streams a completion: the first event is read inside while the server
    still holds the rest of the response."""
    with agentenv.Sandbox.create() as sb:
        fwd = sb.forward(PORT, ("127.0.0.1", ep.port))
        job = sb.spawn(python(f"""
import urllib.request
r = urllib.request.urlopen("{fwd.url}/sse", timeout=60)
for line in r:
    if line.strip():
        print(line.decode().strip(), flush=True)
print("end", flush=True)"""))
        _wait(lambda: "event 0" in job.output(), "the first event is read inside")
        assert not ep.release.is_set()  # the response is not over: the other events wait on the test
        ep.release.set()
        assert job.wait(60) == 0, job.output()
        assert job.output().split("\n")[:4] == ["data: event 0", "data: event 1", "data: event 2", "end"]


def test_the_forward_reaches_its_target_and_nothing_else_of_the_host(ep: Endpoint):
    """Whatever the sandbox sends through the forward lands on its one target; the host's other loopback services
    and addresses stay out of reach, with network and without; the sandbox cannot ask its keeper for a forward of
    its own."""
    with endpoint() as other, agentenv.Sandbox.create(network=True) as sb:
        sb.forward(PORT, ("127.0.0.1", ep.port))
        # a request that names another host port every way HTTP can: each reaches the target, as it is
        r = sb.exec(python(f"""
import socket
for req in [b"GET /a HTTP/1.1\\r\\nHost: 127.0.0.1:{other.port}\\r\\n\\r\\n",
            b"GET http://127.0.0.1:{other.port}/b HTTP/1.1\\r\\nHost: 127.0.0.1:{other.port}\\r\\n\\r\\n",
            b"CONNECT 127.0.0.1:{other.port} HTTP/1.1\\r\\nHost: 127.0.0.1:{other.port}\\r\\n\\r\\n"]:
    with socket.create_connection(("127.0.0.1", {PORT}), timeout=10) as s:
        s.sendall(req)
        print(s.recv(4096).split(b"\\r\\n")[0].decode())"""))
        assert r.stdout.split("\n")[:3] == ["HTTP/1.1 200 OK"] * 3, (r.stdout, r.stderr)
        assert ep.paths == ["/a", f"http://127.0.0.1:{other.port}/b", f"127.0.0.1:{other.port}"]
        # the host's own addresses and loopback ports: refused (the sandbox's loopback is its own)
        targets = [f"{a}:{p}" for a in host_addresses() for p in (ep.port, other.port)]
        result = probe(sb, targets)
        assert reached(result) == [], result
        # the keeper refuses a forward (or a listener) asked for from inside, whatever target the request names
        r = sb.exec(python(f"""
import json, socket, struct
for op in ("forward", "listen"):
    s = socket.socket(socket.AF_UNIX)
    s.connect("/dev/agentenv/agent.sock")
    head = json.dumps({{"op": op, "port": 8001, "host": "127.0.0.1", "host_port": {other.port}}}).encode()
    s.sendall(struct.pack(">II", len(head), 0) + head)
    n, _ = struct.unpack(">II", s.recv(8))
    print(json.loads(s.recv(n))["message"])"""))
        assert r.stdout.split("\n")[:2] == ["[Errno 1] forward is the host's request alone: refused",
                                            "[Errno 1] listen is the host's request alone: refused"], r.stderr
        assert probe(sb, ["127.0.0.1:8001"]) == {"127.0.0.1:8001": "ConnectionRefusedError"}
        # the forward is on the sandbox's own loopback: another sandbox does not reach it at its address
        assert sb.network is not None and sb.network.address
        with agentenv.Sandbox.create(network=True) as peer:
            assert reached(probe(peer, [f"{sb.network.address}:{PORT}"])) == []
        assert other.paths == []


def test_a_flood_is_bounded_and_other_sandboxes_are_served_meanwhile(ep: Endpoint):
    """A sandbox opening 1000 connections gets at most max_connections relays (the rest wait inside), no more host
    threads, and does not hold up another sandbox's forward; once it stops, its forward serves again."""
    with agentenv.Sandbox.create() as a, agentenv.Sandbox.create() as b:
        a.forward(PORT, ("127.0.0.1", ep.port), max_connections=4)
        b.forward(PORT, ("127.0.0.1", ep.port))
        threads = threading.active_count()
        flood = a.spawn(python(f"""
import socket, time
held = []
for i in range(1000):
    s = socket.socket()
    s.setblocking(False)
    s.connect_ex(("127.0.0.1", {PORT}))
    held.append(s)
time.sleep(0.5)
for s in held:
    try:
        s.send(b"GET /hold HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
    except OSError:
        pass
print("sent", flush=True)
time.sleep(600)"""))
        _wait(lambda: forward.active(a.id) == 4 and ep.open_now == 4, "the flood fills its 4 relays")
        r = b.exec(get(f"http://127.0.0.1:{PORT}/fast"))
        assert r.stdout == "hello /fast\n", r.stderr
        assert ep.most_open <= 5  # a's 4 held, and b's one
        assert forward.active(a.id) == 4
        assert threading.active_count() <= threads + 8  # the relays' few worker threads at most
        flood.kill()
        _wait(lambda: forward.active(a.id) == 0, "a's relays end with its connections")
        ep.release.set()
        r = a.exec(get(f"http://127.0.0.1:{PORT}/after"))
        assert r.stdout == "hello /after\n", r.stderr


def test_a_slow_sender_is_cut_at_the_idle_deadline(ep: Endpoint):
    with agentenv.Sandbox.create() as sb:
        fwd = sb.forward(PORT, ("127.0.0.1", ep.port), max_connections=1, idle_timeout=1.0)
        job = sb.spawn(python(f"""
import socket
s = socket.create_connection(("127.0.0.1", {PORT}))
s.sendall(b"GET /slow HTTP/1.1\\r\\n")  # and no more
print("closed" if s.recv(1) == b"" else "answered", flush=True)"""))
        _wait(lambda: "closed" in job.output(), "the idle relay is closed")
        assert forward.active(sb.id) == 0
        r = sb.exec(get(f"{fwd.url}/next"))
        assert r.stdout == "hello /next\n", r.stderr


def _tcp(sb: agentenv.Sandbox) -> list[list[str]]:
    """The sandbox's TCP sockets, as ``/proc/net/tcp`` lists them (local, remote, state in columns 1 to 3)."""
    return [line.split() for line in sb.read_file("/proc/net/tcp").decode().splitlines()[1:]]


def _connected(sb: agentenv.Sandbox, port: int) -> bool:
    """Whether a connection to ``127.0.0.1:port`` of the sandbox is established."""
    return any(r[2].endswith(f":{port:04X}") and r[3] == "01" for r in _tcp(sb))


def _listening(sb: agentenv.Sandbox, port: int) -> bool:
    return any(r[1].endswith(f":{port:04X}") and r[3] == "0A" for r in _tcp(sb))


def _served(sb: agentenv.Sandbox, path: str) -> str:
    r = sb.exec(get(f"http://127.0.0.1:{PORT}{path}"))
    assert r.exit_code == 0, r.stderr
    return r.stdout.strip()


def test_forks_pauses_and_snapshots_keep_a_working_forward(ep: Endpoint):
    """Each child of a fork (memory or files) relays on its own; a pause and resume, and a snapshot with a relay
    in flight (cut, the snapshot taken), leave it serving."""
    with agentenv.Sandbox.create() as sb:
        fwd = sb.forward(PORT, ("127.0.0.1", ep.port))
        for memory in (True, False):
            kids = sb.fork(2, memory=memory)
            try:
                assert [k.forwards for k in kids] == [[fwd], [fwd]]
                assert [_served(k, f"/{k.id}") for k in kids] == [f"hello /{k.id}" for k in kids]
            finally:
                for k in kids:
                    k.close()
        sb.pause()
        sb.resume()
        assert _served(sb, "/resumed") == "hello /resumed"
        sb.pause(memory=False)  # its keeper starts afresh, with no listener: the relay's next post makes one
        sb.resume()
        assert _served(sb, "/booted") == "hello /booted"
        held = sb.spawn(get(f"{fwd.url}/hold", timeout=120))
        _wait(lambda: "/hold" in ep.paths, "a relay is in flight")
        snap = sb.snapshot(memory=True)  # its relay is cut for the dump
        try:
            assert held.wait(60) != 0  # its connection was cut: the client sees it end
            assert _served(sb, "/after-snapshot") == "hello /after-snapshot"
        finally:
            snap.delete()


def test_a_restore_is_forwarded_once_asked_and_a_connection_made_meanwhile_waits(ep: Endpoint):
    """A snapshot's target may be another service by the time it is restored: a restore forwards nothing until asked,
    and a connection made inside meanwhile waits in the listener the snapshot kept, then is served."""
    with agentenv.Sandbox.create() as sb:
        sb.forward(PORT, ("127.0.0.1", ep.port))
        snap = sb.snapshot(memory=True)
    try:
        with agentenv.Sandbox.restore(snap) as again:
            assert again.forwards == []
            job = again.spawn(get(f"http://127.0.0.1:{PORT}/waited", timeout=120))
            _wait(lambda: _connected(again, PORT), "the client connected to the listener the snapshot kept")
            assert ep.paths == [] and job.exit_code is None
            again.forward(PORT, ("127.0.0.1", ep.port))
            assert job.wait(60) == 0, job.output()
            assert ep.paths == ["/waited"]
    finally:
        snap.delete()


def test_another_process_snapshots_a_sandbox_this_one_relays(ep: Endpoint):
    """The keeper connections this process leaves waiting are closed by another process's snapshot, and posted again
    after it: its dumps succeed, and the forward serves between them."""
    with agentenv.Sandbox.create() as sb:
        sb.forward(PORT, ("127.0.0.1", ep.port))
        for i in range(3):
            r = subprocess.run([sys.executable, "-c", "import agentenv\n"
                                f"agentenv.Sandbox.get({sb.id!r}).snapshot(memory=True).delete()"],
                               capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, r.stderr[-2000:]
            assert _served(sb, f"/{i}") == f"hello /{i}"
