"""A networked sandbox's outbound rules: what a user may ask for, checked and resolved, and the nftables
ruleset that enforces them inside the sandbox's network namespace.

The shape is E2B's: ``allow_out`` and ``deny_out``, lists of IPv4 addresses, CIDR blocks and (in
``allow_out`` only) host names; an allowed destination wins over a denied one, so ``deny_out=["0.0.0.0/0"]``
with an ``allow_out`` list is an allowlist. On top of the rules, and above them:

- never reachable, whatever a rule says (``agentenv.host.network`` enforces this on the host, where the sandbox
  cannot touch it): the host itself (every one of its addresses), loopback, the other sandboxes, link-local
  and metadata addresses, multicast and reserved ranges. An ``allow_out`` entry lying wholly inside that set is
  refused; one that overlaps it is enforced for the rest;
- reachable only where ``allow_out`` names them: the private ranges (10/8, 172.16/12, 192.168/16, 100.64/10);
- everything else: reachable unless ``deny_out`` names it.

A host name is resolved (on the host, IPv4) when the rule is set, and the rule holds the addresses it had
then: it is not refreshed later (resolve it again with ``update_network``). Sandboxes have no IPv6 route, so an
IPv6 entry cannot be enforced as an allow and is refused; wildcard names would need the TLS server name of
each connection and are refused too. Nothing asked for is accepted and ignored.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentenv.api import Network
from agentenv.errors import NetworkRuleError

MAX_ENTRIES = 256  # entries in each list, as E2B's limit
PRIVATE = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10")
NEVER = ("0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4", "240.0.0.0/4")  # the host's rules add more
ALL_TRAFFIC = "0.0.0.0/0"
_NAME = re.compile(r"^(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*\.?$")

Resolver = Callable[[str], list[str]]
RESOLVE_ENV = "AGENTENV_RESOLVE"  # "hosts": host names in rules are looked up in /etc/hosts only (no DNS query)


def resolve_ipv4(name: str) -> list[str]:
    """The IPv4 addresses ``name`` has now, as this host resolves it (its /etc/hosts, its resolver; /etc/hosts
    alone with ``$AGENTENV_RESOLVE=hosts``, as the test suite runs, so that no rule sends a query off the host)."""
    if os.environ.get(RESOLVE_ENV) == "hosts":
        found = set()
        with open("/etc/hosts") as f:
            for line in f:
                words = line.split("#", 1)[0].split()
                if len(words) >= 2 and name in (w.lower() for w in words[1:]):
                    try:
                        if ipaddress.ip_address(words[0]).version == 4:
                            found.add(words[0])
                    except ValueError:
                        continue
        if not found:
            raise OSError(f"{name} is not in /etc/hosts (${RESOLVE_ENV}=hosts: no DNS query is made)")
        return sorted(found)
    infos = socket.getaddrinfo(name, None, family=socket.AF_INET, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


@dataclass(frozen=True)
class Rules:
    """Checked outbound rules: the entries as given, and the networks each list stands for (host names
    resolved in ``resolved``, name to addresses)."""

    allow_out: tuple[str, ...] = ()
    deny_out: tuple[str, ...] = ()
    resolved: dict[str, list[str]] = field(default_factory=dict)

    def nets(self, which: str) -> list[ipaddress.IPv4Network]:
        """The networks of ``allow_out`` or ``deny_out``, host names as the addresses they resolved to."""
        out: list[ipaddress.IPv4Network] = []
        for entry in getattr(self, which):
            for text in self.resolved.get(entry, [entry]):
                out.append(ipaddress.IPv4Network(text, strict=False))
        return out

    def to_json(self) -> dict[str, Any]:
        return {"allow_out": list(self.allow_out), "deny_out": list(self.deny_out),
                "resolved": {k: list(v) for k, v in self.resolved.items()}}

    @classmethod
    def from_json(cls, d: Mapping[str, Any] | None) -> Rules:
        d = d or {}
        return cls(tuple(d.get("allow_out") or ()), tuple(d.get("deny_out") or ()),
                   {k: list(v) for k, v in (d.get("resolved") or {}).items()})


def asked(network: bool | Network | Mapping[str, Any] | None) -> tuple[list[str], list[str]] | None:
    """The ``(allow_out, deny_out)`` lists ``Sandbox.create(network=...)`` asks for, None for no network
    (False/None): True is no rules, else a ``Network`` or a mapping with those keys (any other key is refused).
    Only the shape is checked here (NetworkRuleError), as a client does before sending; ``check`` reads the
    entries."""
    if network is None or network is False:
        return None
    if network is True:
        return [], []
    if isinstance(network, Network):
        if network.address is not None or network.resolved:
            raise NetworkRuleError("a sandbox's address and resolved names are the host's to set, not asked for")
        return list(network.allow_out), list(network.deny_out)
    if isinstance(network, Mapping):
        unknown = sorted(str(k) for k in set(network) - {"allow_out", "deny_out"})
        if unknown:
            raise NetworkRuleError(f"unknown network option(s) {unknown}: only allow_out and deny_out are enforced")
        return _entries(network.get("allow_out"), "allow_out"), _entries(network.get("deny_out"), "deny_out")
    raise NetworkRuleError(f"network must be a bool, a Network or a mapping, got {type(network).__name__}")


def requested(network: bool | Network | Mapping[str, Any] | None, *, never: Sequence[str] = (),
              resolve: Resolver = resolve_ipv4) -> Rules | None:
    """The checked rules of ``Sandbox.create(network=...)`` (``asked``, then ``check``); None for no network."""
    lists = asked(network)
    return None if lists is None else check(*lists, never=never, resolve=resolve)


def check(allow_out: Iterable[str] | None = None, deny_out: Iterable[str] | None = None, *,
          never: Sequence[str] = (), resolve: Resolver = resolve_ipv4) -> Rules:
    """Check and resolve rules; NetworkRuleError naming the entry and why for anything that cannot be enforced.
    ``never``: networks no sandbox reaches on this host besides ``NEVER`` (the sandboxes' own subnet)."""
    allow = _entries(allow_out, "allow_out")
    deny = _entries(deny_out, "deny_out")
    forbidden = [ipaddress.IPv4Network(n) for n in (*NEVER, *never)]
    resolved: dict[str, list[str]] = {}
    for which, entries in (("allow_out", allow), ("deny_out", deny)):
        for entry in entries:
            net = _network(entry)
            if net is not None:
                if which == "allow_out" and any(net.subnet_of(f) for f in forbidden):
                    raise NetworkRuleError(f"allow_out entry {entry!r} lies wholly inside addresses no sandbox may "
                                           "reach (the host, loopback, other sandboxes, link-local/metadata)",
                                           fix="remove it: those are never reachable from a sandbox")
                continue
            if which == "deny_out":
                raise NetworkRuleError(f"deny_out entry {entry!r} is a host name: only addresses and CIDR blocks "
                                       "can be denied (a name's addresses change, and others share them)",
                                       fix="deny its addresses, or allow only what you want with "
                                           "deny_out=['0.0.0.0/0']")
            resolved[entry] = _resolve(entry, resolve, forbidden)
    return Rules(tuple(allow), tuple(deny), resolved)


def _entries(value: Iterable[str] | None, which: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise NetworkRuleError(f"{which} must be a list of strings, got {type(value).__name__}")
    out: list[str] = []
    for entry in value:
        if not isinstance(entry, str) or not entry.strip():
            raise NetworkRuleError(f"{which} entries must be non-empty strings, got {entry!r}")
        entry = entry.strip().lower()
        if entry not in out:
            out.append(entry)
    if len(out) > MAX_ENTRIES:
        raise NetworkRuleError(f"{which} has {len(out)} entries; at most {MAX_ENTRIES}")
    return out


def _network(entry: str) -> ipaddress.IPv4Network | None:
    """The IPv4 network an address or CIDR entry names; None for a host name; NetworkRuleError for IPv6 and for
    what is neither."""
    try:
        net = ipaddress.ip_network(entry, strict=False)
    except ValueError:
        if entry.startswith("*"):
            raise NetworkRuleError(f"{entry!r}: wildcard names are not supported (they would need each "
                                   "connection's TLS server name, which agentenv does not inspect)",
                                   fix="name the hosts, or allow their address ranges") from None
        if not _NAME.match(entry) or entry.replace(".", "").isdigit() or "/" in entry:
            raise NetworkRuleError(f"{entry!r} is neither an IPv4 address, a CIDR block nor a host name") from None
        return None
    if net.version != 4:
        raise NetworkRuleError(f"{entry!r} is IPv6: sandboxes have IPv4 only here, so an IPv6 rule cannot be "
                               "enforced as asked", fix="use IPv4 addresses (IPv6 is never reachable)")
    return net


def _resolve(name: str, resolve: Resolver, forbidden: list[ipaddress.IPv4Network]) -> list[str]:
    try:
        addrs = resolve(name)
    except OSError as e:
        raise NetworkRuleError(f"allow_out host name {name!r} does not resolve on this host: {e}",
                               fix="check the name, or give its addresses") from e
    kept = [a for a in addrs if not any(ipaddress.IPv4Address(a) in f for f in forbidden)]
    if not kept:
        raise NetworkRuleError(f"allow_out host name {name!r} resolves only to addresses no sandbox may reach "
                               f"({', '.join(addrs) or 'none'})")
    return kept


def ruleset(rules: Rules, dns: Sequence[str], address: str, replace: bool = False) -> str:
    """The nftables script (for ``nft -f``) of the sandbox namespace's table with these rules: loopback first, then
    nothing leaves but from the sandbox's own ``address`` (a socket bound elsewhere with IP_FREEBIND, which needs no
    capability, would impersonate another sandbox), DNS to ``dns`` (port 53), then allowed, denied, private; IPv6
    is refused outright. A refused connection is
    rejected (the caller sees ECONNREFUSED at once, not a timeout). With ``replace``, the table there (its chain and its
    sets) is flushed and filled anew in the same transaction (atomic; deleting it instead costs the kernel an RCU grace period, 5-25 ms
    against 0.5 ms here)."""
    # a table flush empties its chains but not its sets: their elements are flushed too, or an update could only add
    lines = ["flush table inet agentenv", "flush set inet agentenv allow", "flush set inet agentenv deny"] \
        if replace else []
    lines.append("table inet agentenv {")
    for name, nets in (("allow", rules.nets("allow_out")), ("deny", rules.nets("deny_out")),
                       ("private", [ipaddress.IPv4Network(p) for p in PRIVATE])):
        lines.append(f"  set {name} {{ type ipv4_addr; flags interval; auto-merge;")
        if nets:
            lines.append("    elements = { " + ", ".join(str(n) for n in nets) + " }")
        lines.append("  }")
    lines += ["  chain out {", "    type filter hook output priority filter; policy accept;",
              '    oifname "lo" accept', f"    ip saddr != {ipaddress.IPv4Address(address)} drop",
              "    meta nfproto ipv6 reject"]
    if dns:
        servers = ", ".join(dns)
        lines += [f"    ip daddr {{ {servers} }} udp dport 53 accept", f"    ip daddr {{ {servers} }} tcp dport 53 accept"]
    lines += ["    ip daddr @allow accept", "    ip daddr @deny reject", "    ip daddr @private reject", "  }", "}"]
    return "\n".join(lines) + "\n"
