"""Outbound rules of networked sandboxes, checked and turned into nftables (no kernel, no Docker)."""

from __future__ import annotations

import ipaddress

import pytest

from agentenv import netpolicy
from agentenv.api import Network
from agentenv.errors import NetworkRuleError
from agentenv.host import network


def _no_dns(name: str) -> list[str]:
    raise OSError(-2, "Name or service not known")


@pytest.mark.parametrize("entry, why", [
    ("fd00:ec2::254", "IPv6"), ("::/0", "IPv6"), ("*.example.com", "wildcard"), ("not a host", "neither"),
    ("10.0.0.0/33", "neither"), ("", "non-empty"),
])
def test_entries_that_cannot_be_enforced_are_refused_with_the_reason(entry, why):
    with pytest.raises(NetworkRuleError, match=why):
        netpolicy.check([entry], [], resolve=_no_dns)


@pytest.mark.parametrize("entry", ["169.254.169.254", "127.0.0.1", "127.0.0.0/8", "224.0.0.1", "10.213.4.5"])
def test_an_allow_wholly_inside_the_never_reachable_set_is_refused(entry):
    with pytest.raises(NetworkRuleError, match="no sandbox may reach"):
        netpolicy.check([entry], [], never=("10.213.0.0/16",))
    netpolicy.check([], [entry], never=("10.213.0.0/16",))  # denying it is fine: it changes nothing


def test_an_allow_that_overlaps_the_never_set_is_kept_and_the_rest_allowed():
    rules = netpolicy.check(["0.0.0.0/0", "10.0.0.0/8"], ["8.8.8.8"], never=("10.213.0.0/16",))
    assert rules.allow_out == ("0.0.0.0/0", "10.0.0.0/8") and rules.deny_out == ("8.8.8.8",)
    text = netpolicy.ruleset(rules, [], "10.213.0.9")
    assert "elements = { 0.0.0.0/0, 10.0.0.0/8 }" in text


def test_host_names_resolve_when_set_and_only_in_allow_out():
    rules = netpolicy.check(["Example.COM"], ["0.0.0.0/0"], resolve=lambda n: ["169.254.1.1", "93.184.216.34"])
    assert rules.allow_out == ("example.com",)
    assert rules.resolved == {"example.com": ["93.184.216.34"]}  # the never-reachable address is left out
    assert rules.nets("allow_out") == [ipaddress.IPv4Network("93.184.216.34/32")]
    with pytest.raises(NetworkRuleError, match="host name"):
        netpolicy.check([], ["example.com"], resolve=lambda n: ["93.184.216.34"])
    with pytest.raises(NetworkRuleError, match="does not resolve"):
        netpolicy.check(["nowhere.invalid"], [], resolve=_no_dns)
    with pytest.raises(NetworkRuleError, match="only to addresses no sandbox may reach"):
        netpolicy.check(["meta.internal"], [], resolve=lambda n: ["169.254.169.254"])


def test_the_forms_of_network_a_create_takes():
    assert netpolicy.requested(False) is None and netpolicy.requested(None) is None
    assert netpolicy.requested(True) == netpolicy.Rules()
    assert netpolicy.requested({"deny_out": ["1.1.1.1", "1.1.1.1"]}).deny_out == ("1.1.1.1",)  # duplicates dropped
    assert netpolicy.requested(Network(allow_out=("1.1.1.1",))).allow_out == ("1.1.1.1",)
    with pytest.raises(NetworkRuleError, match="unknown network option"):
        netpolicy.requested({"allow_out": [], "mask_request_host": "x"})
    with pytest.raises(NetworkRuleError, match="host's to set"):
        netpolicy.requested(Network(address="10.213.0.9"))
    with pytest.raises(NetworkRuleError, match="list of strings"):
        netpolicy.requested({"allow_out": "1.1.1.1"})
    with pytest.raises(NetworkRuleError, match="at most"):
        netpolicy.check([f"1.1.{i // 256}.{i % 256}" for i in range(257)], [])
    with pytest.raises(NetworkRuleError):
        netpolicy.requested("yes")  # type: ignore[arg-type]


def test_rules_round_trip_through_the_record():
    rules = netpolicy.check(["a.test"], ["0.0.0.0/0"], resolve=lambda n: ["203.0.113.5"])
    assert netpolicy.Rules.from_json(rules.to_json()) == rules
    assert netpolicy.Rules.from_json(None) == netpolicy.Rules()


def test_the_sandboxs_ruleset_orders_dns_allow_deny_private():
    rules = netpolicy.check(["10.1.0.0/16"], ["0.0.0.0/0"])
    lines = [line.strip() for line in netpolicy.ruleset(rules, ["10.255.255.53"], "10.213.0.9").splitlines()]
    order = ['oifname "lo" accept', "ip saddr != 10.213.0.9 drop", "ip daddr { 10.255.255.53 } udp dport 53 accept", "ip daddr @allow accept",
             "ip daddr @deny reject", "ip daddr @private reject"]
    assert [lines.index(x) for x in order] == sorted(lines.index(x) for x in order)
    assert lines[0] == "table inet agentenv {"  # a new namespace's table
    replacing = netpolicy.ruleset(rules, ["10.255.255.53"], "10.213.0.9", replace=True).splitlines()
    flushes = ["flush table inet agentenv", "flush set inet agentenv allow", "flush set inet agentenv deny"]
    assert replacing[:3] == flushes and replacing[3:] == netpolicy.ruleset(
        rules, ["10.255.255.53"], "10.213.0.9").splitlines()  # replaced whole (sets too), in one transaction
    no_rules = netpolicy.ruleset(netpolicy.Rules(), [], "10.213.0.9")
    assert "udp dport 53" not in no_rules and no_rules.count("elements") == 1  # only the private ranges


def test_the_hosts_rules_refuse_the_host_the_sandboxes_and_link_local():
    host = network.HostNet(ipaddress.IPv4Network("10.213.0.0/16"), ipaddress.IPv4Address("10.213.0.1"))
    text = network.host_rules(host)
    assert f'iifname "{network.BRIDGE}" reject' in text  # nothing delivered to the host itself
    assert f'iifname "{network.BRIDGE}" oifname "{network.BRIDGE}" reject' in text
    assert "169.254.0.0/16" in text and "127.0.0.0/8" in text and "10.213.0.0/16" in text
    assert "masquerade" in text
    assert network.veth_name(host, ipaddress.IPv4Address("10.213.1.2")) == "ae000102"
    first = network._candidates(host, "10.213.7.7")[0]
    assert str(first) == "10.213.7.7"
    assert all(host.gateway < a < host.subnet.broadcast_address for a in network._candidates(host, "10.99.0.1"))


def test_nameservers_come_from_the_environment_or_the_hosts_non_loopback_ones(monkeypatch):
    monkeypatch.setenv(network.DNS_ENV, "198.51.100.2, 198.51.100.3")
    assert network.nameservers() == ["198.51.100.2", "198.51.100.3"]
    monkeypatch.setenv(network.DNS_ENV, "none")
    assert network.nameservers() == []
    assert "no resolver" in network.resolv_conf([])
    assert network.resolv_conf(["1.2.3.4"]) == "nameserver 1.2.3.4\n"
    monkeypatch.setenv(network.SUBNET_ENV, "10.0.0.0/30")
    with pytest.raises(Exception, match="/8 to /24"):
        network.subnet()


def test_host_names_can_be_resolved_from_etc_hosts_alone(monkeypatch):
    monkeypatch.setenv(netpolicy.RESOLVE_ENV, "hosts")
    assert netpolicy.resolve_ipv4("localhost") == ["127.0.0.1"]
    with pytest.raises(OSError, match="not in /etc/hosts"):
        netpolicy.resolve_ipv4("nowhere.invalid")
