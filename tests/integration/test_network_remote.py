"""Sandbox networking through a real server: the native client (``agentenv.connect``) and the official ``e2b`` SDK.

No traffic leaves this machine: nothing connects anywhere from inside a sandbox here, and no rule names a host
(a name would be resolved on the host); the rules are read back through the sandboxes' info. 198.51.100.0/24 is
a documentation range.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator

import pytest

import agentenv
from agentenv.api import Network
from agentenv.errors import NetworkRuleError, SandboxStateError
from agentenv.remote.client import Client

from .server_fixtures import TOKEN

pytestmark = pytest.mark.integration

ALLOWED, OTHER, ALL = "198.51.100.7", "198.51.100.8", "0.0.0.0/0"


@pytest.fixture(scope="module")
def client(e2b_url: str) -> Iterator[Client]:
    c = agentenv.connect(e2b_url, TOKEN)
    yield c
    c.close()


def _interfaces(dev: str) -> list[str]:
    """The interface names of a /proc/net/dev."""
    return sorted(line.split(":")[0].strip() for line in dev.splitlines()[2:] if ":" in line)


def _addresses(fib_trie: str) -> set[str]:
    """The sandbox's own addresses, from /proc/net/fib_trie (the line before each '/32 host LOCAL')."""
    lines = [line.strip() for line in fib_trie.splitlines()]
    return {lines[i - 1].split()[-1] for i, line in enumerate(lines) if line == "/32 host LOCAL"}


def test_rules_address_and_update_over_the_native_client(client: Client) -> None:
    with client.Sandbox.create(memory="256m", network={"allow_out": [ALLOWED], "deny_out": [ALL]}) as sb:
        net = sb.network
        assert isinstance(net, Network)
        assert (net.allow_out, net.deny_out, net.resolved) == ((ALLOWED,), (ALL,), {})
        assert net.address is not None and ipaddress.IPv4Address(net.address).is_private
        assert sb.info().network == net == client.Sandbox.get(sb.id).network
        assert "eth0" in _interfaces(sb.exec("cat /proc/net/dev").stdout)
        assert net.address in _addresses(sb.exec("cat /proc/net/fib_trie").stdout)

        got = sb.update_network(allow_out=[OTHER], deny_out=(ALL,))
        assert (got.allow_out, got.deny_out, got.address) == ((OTHER,), (ALL,), net.address)
        assert sb.network == got and client.Sandbox.get(sb.id).network == got

        for bad in ({"allow_out": ["2001:db8::1"]}, {"deny_out": ["2001:db8::/32"]}, {"deny_out": ["a.example"]},
                    {"allow_out": ["*.example.com"]}, {"allow_out": ["127.0.0.1"]}):
            with pytest.raises(NetworkRuleError):
                sb.update_network(**bad)
        assert client.Sandbox.get(sb.id).network == got  # a refused update changes nothing

        cleared = sb.update_network()
        assert (cleared.allow_out, cleared.deny_out) == ((), ())

    before = {s.id for s in client.Sandbox.list()}
    for bad_network in ({"allow_out": ["2001:db8::1"]}, Network(deny_out=("fe80::/10",)),
                        {"allow_out": [ALLOWED], "mask_request_host": "x"}):
        with pytest.raises(NetworkRuleError):
            client.Sandbox.create(memory="256m", network=bad_network)
    assert {s.id for s in client.Sandbox.list()} == before  # nothing half-made


def test_network_true_and_false_over_the_native_client(client: Client) -> None:
    with client.Sandbox.create(memory="256m", network=Network()) as open_sb:
        assert open_sb.network is not None and (open_sb.network.allow_out, open_sb.network.deny_out) == ((), ())
        assert open_sb.network.address is not None
    with client.Sandbox.create(memory="256m") as sb:
        assert sb.network is None and sb.info().network is None
        assert _interfaces(sb.exec("cat /proc/net/dev").stdout) == ["lo"]
        with pytest.raises(SandboxStateError):  # 409: no rules to change
            sb.update_network(allow_out=[ALLOWED])
        assert client.Sandbox.get(sb.id).network is None


e2b = pytest.importorskip("e2b", reason="the E2B SDK is a test extra; bootstrap installs it")
from e2b import Sandbox  # noqa: E402
from e2b.exceptions import SandboxException  # noqa: E402


def _sdk_sandbox(**kw: object) -> Sandbox:
    return Sandbox.create(timeout=600, **kw)  # type: ignore[arg-type]


def test_e2b_without_internet_access_has_loopback_only(client: Client) -> None:
    sb = _sdk_sandbox(allow_internet_access=False)
    try:
        assert _interfaces(sb.commands.run("cat /proc/net/dev").stdout) == ["lo"]
        assert client.Sandbox.get(sb.sandbox_id).network is None
        assert sb.get_info().allow_internet_access is False
        with pytest.raises(SandboxException) as e:  # a sandbox made with loopback only has no rules to replace
            sb.update_network({"allow_out": [ALLOWED]})
        assert getattr(e.value, "status_code", None) == 409
    finally:
        Sandbox.kill(sb.sandbox_id)


def test_e2b_network_rules_map_onto_the_sandboxs_and_update(client: Client) -> None:
    sb = _sdk_sandbox(network={"deny_out": [ALL], "allow_out": [ALLOWED], "allow_public_traffic": False})
    try:
        net = client.Sandbox.get(sb.sandbox_id).network
        assert net is not None and (net.allow_out, net.deny_out) == ((ALLOWED,), (ALL,)) and net.address
        info = sb.get_info()
        assert info.allow_internet_access is True and info.network is not None
        assert (info.network.get("allow_out"), info.network.get("deny_out")) == ([ALLOWED], [ALL])
        assert "eth0" in _interfaces(sb.commands.run("cat /proc/net/dev").stdout)

        sb.update_network({"allow_out": [OTHER], "deny_out": lambda ctx: [ctx.all_traffic]})
        net = client.Sandbox.get(sb.sandbox_id).network
        assert net is not None and (net.allow_out, net.deny_out) == ((OTHER,), (ALL,))
        sb.update_network({"allow_out": [ALLOWED], "allow_internet_access": False})  # E2B: denyOut 0.0.0.0/0
        net = client.Sandbox.get(sb.sandbox_id).network
        assert net is not None and (net.allow_out, net.deny_out) == ((ALLOWED,), (ALL,))

        for bad, says in [({"allow_out": ["2001:db8::1"]}, "IPv6"), ({"deny_out": ["a.example"]}, "host name"),
                          ({"allow_out": [OTHER], "dns_servers": ["192.0.2.53"]}, "dnsServers")]:
            with pytest.raises(SandboxException, match=says):
                sb.update_network(bad)  # type: ignore[arg-type]
        net = client.Sandbox.get(sb.sandbox_id).network  # refused: unchanged
        assert net is not None and (net.allow_out, net.deny_out) == ((ALLOWED,), (ALL,))
    finally:
        Sandbox.kill(sb.sandbox_id)


def test_e2b_default_is_internet_access_without_rules(client: Client) -> None:
    sb = _sdk_sandbox()
    try:
        net = client.Sandbox.get(sb.sandbox_id).network
        assert net is not None and (net.allow_out, net.deny_out) == ((), ()) and net.address
        assert sb.get_info().allow_internet_access is True
    finally:
        Sandbox.kill(sb.sandbox_id)


@pytest.mark.parametrize(("network", "named"), [
    ({"rules": {"api.example.com": [{"transform": {"headers": {"X-A": "1"}}}]}}, "rules"),  # needs an egress proxy
    ({"allow_out": [ALLOWED], "dns_servers": ["192.0.2.53"]}, "dnsServers"),
    ({"allow_out": ["2001:db8::1"]}, "IPv6"),
])
def test_e2b_refuses_what_it_cannot_enforce_by_name(client: Client, network: dict, named: str) -> None:
    before = {s.id for s in client.Sandbox.list()}
    with pytest.raises(SandboxException, match=named) as e:
        _sdk_sandbox(network=network)
    assert getattr(e.value, "status_code", None) == 400
    assert {s.id for s in client.Sandbox.list()} == before


def test_e2b_rules_asked_of_a_snapshot_template_replace_its_rules(client: Client) -> None:
    """A template that is a snapshot keeps the snapshot's link; rules asked for replace its rules, and a snapshot
    of a loopback-only sandbox cannot be given more (400, nothing restored)."""
    src = _sdk_sandbox(network={"allow_out": [ALLOWED], "deny_out": [ALL]})
    closed = _sdk_sandbox(allow_internet_access=False)
    snaps = [src.create_snapshot(), closed.create_snapshot()]
    made: list[str] = []
    try:
        same = Sandbox.create(template=snaps[0].snapshot_id, timeout=600)
        made.append(same.sandbox_id)
        net = client.Sandbox.get(same.sandbox_id).network
        assert net is not None and (net.allow_out, net.deny_out) == ((ALLOWED,), (ALL,))
        other = Sandbox.create(template=snaps[0].snapshot_id, timeout=600, network={"allow_out": [OTHER]})
        made.append(other.sandbox_id)
        net = client.Sandbox.get(other.sandbox_id).network
        assert net is not None and (net.allow_out, net.deny_out) == ((OTHER,), ())
        before = {s.id for s in client.Sandbox.list()}
        with pytest.raises(SandboxException, match="loopback only") as e:
            Sandbox.create(template=snaps[1].snapshot_id, timeout=600, network={"allow_out": [OTHER]})
        assert getattr(e.value, "status_code", None) == 400
        with pytest.raises(SandboxException, match="IPv6"):  # a refused rule: the restored sandbox is closed again
            Sandbox.create(template=snaps[0].snapshot_id, timeout=600, network={"allow_out": ["2001:db8::1"]})
        assert {s.id for s in client.Sandbox.list()} == before
    finally:
        for sid in [*made, src.sandbox_id, closed.sandbox_id]:
            Sandbox.kill(sid)
        for snap in snaps:
            Sandbox.delete_snapshot(snap.snapshot_id)
