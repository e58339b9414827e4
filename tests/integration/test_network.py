"""The host boundary of a sandbox with network (docs/architecture.md §8): its own namespace and address, the outside through
NAT, never the host, another sandbox, loopback services or link-local addresses; the rules a user sets, on a
running sandbox too; forks, pauses and restores keep each child's network. Every address the sandboxes are sent
to is a test host on this machine (``net_hosts``): no traffic leaves it."""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Iterator

import pytest

import agentenv
from agentenv.errors import NetworkRuleError, SandboxStateError

from .net_hosts import Outside, outside_hosts
from .netprobe import host_addresses, probe, reached


@pytest.fixture(scope="module")
def outside() -> Iterator[Outside]:
    with outside_hosts() as o:
        yield o


@pytest.fixture(scope="module")
def host_server() -> Iterator[int]:
    """An HTTP server of the host's on every address (loopback included): what no sandbox may reach."""
    srv = http.server.ThreadingHTTPServer(("0.0.0.0", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield int(srv.server_address[1])
    srv.shutdown()
    srv.server_close()


def _at(o: Outside, addr: str) -> str:
    return f"{addr}:{o.http_port}"


def test_a_networked_sandbox_reaches_the_outside_from_its_own_address(outside):
    with agentenv.Sandbox.create(network=True) as sb:
        net = sb.network
        assert net is not None and net.address and net.address.startswith("10.213.")
        r = probe(sb, [_at(outside, outside.allowed)])
        # the test host sees the host's address on its side (NAT), and answers the sandbox
        assert r[_at(outside, outside.allowed)] == f"open {outside.allowed} 198.51.100.1"
        ifaces = sb.exec("cut -d: -f1 /proc/net/dev | tail -n +3 | tr -d ' '").stdout.split()
        assert sorted(ifaces) == ["eth0", "lo"]


def test_no_sandbox_reaches_the_host_on_any_of_its_addresses(outside, host_server):
    addrs = host_addresses()
    assert "127.0.0.1" in addrs and "10.213.0.1" in addrs
    for a in addrs:  # the server answers the host on each of them
        with socket.create_connection((a, host_server), timeout=5):
            pass
    with agentenv.Sandbox.create(network=True) as sb:
        targets = [f"{a}:{host_server}" for a in addrs] + [f"127.0.0.1:{host_server}"]
        r = probe(sb, targets)
        assert reached(r) == [], r
        assert all(v == "ConnectionRefusedError" for v in r.values()), r
        # a port on the host's loopback is absent from the sandbox's socket table too
        tcp = sb.read_file("/proc/net/tcp").decode()
        assert f":{host_server:04X}" not in tcp
        assert len(tcp.strip().splitlines()) == 1, tcp  # the header alone: the sandbox has no TCP socket yet


def test_sandboxes_do_not_reach_each_other(outside):
    with agentenv.Sandbox.create(network=True) as a, agentenv.Sandbox.create(network=True) as b:
        b.spawn("python3 -m http.server 8000 --bind 0.0.0.0")
        b_addr = b.network.address
        assert b_addr != a.network.address
        assert b.exec("python3 -c \"import socket,time\nfor _ in range(200):\n"
                      "  try: socket.create_connection(('127.0.0.1', 8000), 1).close(); break\n"
                      "  except OSError: time.sleep(0.05)\"").ok
        assert reached(probe(b, ["127.0.0.1:8000"])) == ["127.0.0.1:8000"]  # it listens, to itself
        r = probe(a, [f"{b_addr}:8000"])
        assert reached(r) == [], r


def test_private_ranges_only_where_allowed_and_link_local_never(outside):
    targets = [_at(outside, outside.private), _at(outside, outside.metadata), _at(outside, outside.allowed)]
    with agentenv.Sandbox.create(network=True) as sb:
        assert reached(probe(sb, targets)) == [_at(outside, outside.allowed)]
    with agentenv.Sandbox.create(network={"allow_out": ["10.214.0.0/16", "0.0.0.0/0"]}) as sb:
        # the metadata address stays out of reach even under an allow-everything rule
        assert reached(probe(sb, targets)) == sorted([_at(outside, outside.private), _at(outside, outside.allowed)])
    with pytest.raises(NetworkRuleError, match="169.254.169.254"):
        agentenv.Sandbox.create(network={"allow_out": ["169.254.169.254"]})
    with pytest.raises(NetworkRuleError, match="IPv6"):
        agentenv.Sandbox.create(network={"deny_out": ["fd00:ec2::254"]})
    with pytest.raises(NetworkRuleError, match="unknown network option"):
        agentenv.Sandbox.create(network={"allow_out": [], "allow_public_traffic": True})


def test_deny_and_allow_lists_and_their_update_on_a_running_sandbox(outside):
    allowed, denied = _at(outside, outside.allowed), _at(outside, outside.denied)
    with agentenv.Sandbox.create(network={"deny_out": [outside.denied]}) as sb:
        assert reached(probe(sb, [allowed, denied])) == [allowed]
        net = sb.update_network(deny_out=["0.0.0.0/0"], allow_out=[outside.denied])  # an allowlist
        assert net.deny_out == ("0.0.0.0/0",) and net.allow_out == (outside.denied,)
        assert reached(probe(sb, [allowed, denied])) == [denied]
        with pytest.raises(NetworkRuleError):  # refused whole: the rules in force stay
            sb.update_network(deny_out=["::/0"])
        assert reached(probe(sb, [allowed, denied])) == [denied]
        assert agentenv.Sandbox.get(sb.id).network.allow_out == (outside.denied,)
        sb.update_network(deny_out=[outside.denied])  # entries go too: the allowlist and its 0.0.0.0/0 are gone
        assert reached(probe(sb, [allowed, denied])) == [allowed]
    with agentenv.Sandbox.create() as plain, pytest.raises(SandboxStateError, match="without network"):
        plain.update_network(deny_out=["0.0.0.0/0"])


def test_dns_through_the_sandboxs_resolver_and_host_names_in_rules(outside, monkeypatch):
    monkeypatch.setenv("AGENTENV_DNS", outside.dns)
    resolve = "python3 -c \"import socket; print(socket.gethostbyname('allowed.test'))\""
    with agentenv.Sandbox.create(network={"deny_out": ["0.0.0.0/0"]}) as sb:
        assert sb.read_file("/etc/resolv.conf").decode().split() == ["nameserver", outside.dns]
        r = sb.exec(resolve)
        assert r.stdout.strip() == outside.allowed, r.stderr  # DNS passes a deny-everything rule...
        assert reached(probe(sb, [_at(outside, outside.allowed)])) == []  # ...nothing else does
    monkeypatch.setattr("agentenv.netpolicy.resolve_ipv4", lambda name: {"allowed.test": [outside.allowed]}[name])
    from agentenv import netpolicy

    rules = netpolicy.check(["allowed.test"], ["0.0.0.0/0"], resolve=netpolicy.resolve_ipv4)
    assert rules.resolved == {"allowed.test": [outside.allowed]}
    with pytest.raises(NetworkRuleError, match="host name"):
        netpolicy.check([], ["allowed.test"])


def test_a_sandbox_cannot_change_its_own_network(outside):
    with agentenv.Sandbox.create(network=True) as sb:
        status = sb.read_file("/proc/self/status").decode()
        bounding = int(next(line for line in status.splitlines() if line.startswith("CapBnd")).split()[1], 16)
        assert not bounding & (1 << 12) and not bounding & (1 << 13)  # neither CAP_NET_ADMIN nor CAP_NET_RAW
        r = sb.exec("python3 -c \"import fcntl, socket, struct\n"
                    "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                    "req = struct.pack('16sH2s4s8x', b'eth0', socket.AF_INET, b'', socket.inet_aton('10.213.0.1'))\n"
                    "fcntl.ioctl(s.fileno(), 0x8916, req)\"")  # SIOCSIFADDR: take the gateway's address
        assert r.exit_code != 0 and "Operation not permitted" in r.stderr


def test_fork_pause_and_restore_give_each_child_its_own_working_network(outside):
    allowed, denied = _at(outside, outside.allowed), _at(outside, outside.denied)
    with agentenv.Sandbox.create(network={"deny_out": [outside.denied]}) as sb:
        sb.spawn("python3 -m http.server 8000 --bind 0.0.0.0")
        assert sb.exec("python3 -c \"import socket,time\nfor _ in range(200):\n"
                       "  try: socket.create_connection(('127.0.0.1', 8000), 1).close(); break\n"
                       "  except OSError: time.sleep(0.05)\"").ok
        kids = sb.fork(2) + sb.fork(1, memory=False)
        try:
            addrs = {sb.network.address} | {k.network.address for k in kids}
            assert len(addrs) == 4
            for k in kids:
                assert reached(probe(k, [allowed, denied])) == [allowed]  # its rules came along
                assert k.network.deny_out == (outside.denied,)
            for k in kids[:2]:  # the listening socket came back in the memory forks
                assert reached(probe(k, ["127.0.0.1:8000"])) == ["127.0.0.1:8000"]
        finally:
            for k in kids:
                k.close()
        before = sb.network.address
        sb.pause()
        sb.resume()
        assert sb.network.address == before  # its own address again, where it is free
        assert reached(probe(sb, [allowed, "127.0.0.1:8000"])) == sorted([allowed, "127.0.0.1:8000"])
        snap = sb.snapshot(memory=True)
        try:
            with agentenv.Sandbox.restore(snap) as again:
                assert again.network.address not in (None, before)
                assert reached(probe(again, [allowed, denied, "127.0.0.1:8000"])) == sorted(
                    [allowed, "127.0.0.1:8000"])
        finally:
            snap.delete()


HOLD = r"""
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
s.sendall(b"hi")
assert s.recv(10) == b"hi"
open("/tmp/connected", "w").close()
while True:
    try:
        s.sendall(b"x")
        r = s.recv(10)
        if not r:
            raise ConnectionResetError("closed")
        with open("/tmp/echoes", "a") as f:
            f.write("x")
    except OSError as e:
        open("/tmp/closed", "w").write(type(e).__name__)
        break
    time.sleep(0.05)
"""


def _wait_file(sb, path: str) -> None:
    assert sb.exec(f"for i in $(seq 400); do [ -e {path} ] && exit 0; sleep 0.05; done; exit 1").ok, path


def test_an_outside_connection_resumes_with_the_sandbox_and_is_closed_in_a_fork(outside):
    """A pause keeps the sandbox's address, so its established connection comes back (CRIU --tcp-established); a
    fork child has an address of its own, so the connection comes back closed (--tcp-close), not a failed fork."""
    with agentenv.Sandbox.create(network=True) as sb:
        sb.write_file("/tmp/hold.py", HOLD)
        sb.spawn(f"python3 /tmp/hold.py {outside.allowed} {outside.echo_port}")
        _wait_file(sb, "/tmp/connected")
        (kid,) = sb.fork(1)
        try:
            _wait_file(kid, "/tmp/closed")
            assert kid.read_file("/tmp/closed").decode() in ("BrokenPipeError", "ConnectionResetError")
        finally:
            kid.close()
        sb.pause()
        sb.resume()
        sb.exec("rm -f /tmp/echoes")
        _wait_file(sb, "/tmp/echoes")  # it echoes again after the resume
        assert sb.exec("test -e /tmp/closed").exit_code == 1


SPOOF = r"""
import socket, sys
s = socket.socket()
s.setsockopt(socket.IPPROTO_IP, 15, 1)  # IP_FREEBIND: bind an address that is not ours, no capability needed
s.bind((sys.argv[1], 0))
s.settimeout(3)
try:
    s.connect((sys.argv[2], int(sys.argv[3])))
    print("connected")
except OSError as e:
    print(type(e).__name__, e.errno)
"""


def test_a_sandbox_cannot_send_from_another_sandboxs_address(outside):
    with agentenv.Sandbox.create(network=True) as a, agentenv.Sandbox.create(network=True) as b:
        a.write_file("/tmp/spoof.py", SPOOF)
        own = a.exec(f"python3 /tmp/spoof.py {a.network.address} {outside.allowed} {outside.http_port}")
        assert own.stdout.strip() == "connected"  # the probe works from its own address
        for source in (b.network.address, "10.213.0.1", "203.0.113.9"):  # another sandbox, the gateway, any other
            r = a.exec(f"python3 /tmp/spoof.py {source} {outside.allowed} {outside.http_port}")
            assert r.ok and r.stdout.strip() != "connected", (source, r.stdout + r.stderr)
