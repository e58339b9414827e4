"""A networked sandbox's link to the outside: its own namespace, a veth pair on agentenv's bridge, NAT out.

Every sandbox has a network namespace of its own (runc makes it, owned by the sandbox's user namespace, and
``hostcalls.bind_netns`` names it in the bundle once the sandbox runs); one made with network also gets:

- a veth pair: ``eth0`` inside, with the sandbox's own address on ``$AGENTENV_SUBNET`` (10.213.0.0/16 by
  default) and a default route through the bridge's address; the host end, ``ae<offset>`` (the address's
  offset in the subnet, in hex: the kernel's refusal of a name in use is what keeps two sandboxes off one
  address), is a port of the bridge ``agentenv0``, isolated from every other port (no sandbox reaches another,
  even on the same segment), with the sandbox's bundle as its alias (what recovery and the leak check read);
- the host's rules (the table ``inet agentenv``, made once a process and replaced whole): nothing from the
  bridge is delivered to the host itself (any of its addresses: loopback services, the env server, Ray, the
  host's own interfaces), nothing is forwarded from one sandbox to another, to loopback, link-local or metadata
  addresses or into the sandboxes from outside (replies excepted), no IPv6, and what leaves is masqueraded;
- its own rules (``agentenv.netpolicy``), in a table of its namespace, which the keeper cannot change: no process
  of the sandbox holds CAP_NET_ADMIN (not in its bounding set, and seccomp lets none make a user namespace
  where it would have it). They are loaded before ``eth0`` comes up: a restored sandbox's processes already run;
- a resolv.conf naming the host's resolvers (``$AGENTENV_DNS`` overrides them, "none" for none), which the
  sandbox's rules let it reach on port 53 only.

The veth goes with the namespace: ``detach`` deletes it at once, and the kernel deletes it anyway when the
namespace ends. A start runs ``ip`` once (the pair and the bridge port); what happens inside the namespace is done
from a thread that entered it, in-process: ioctls for the address and route, libnftables for the rules.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import ipaddress
import os
import random
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from agentenv import netpolicy
from agentenv.errors import NetworkUnavailable
from agentenv.host.hostcalls import configure_ipv4, on_thread

BRIDGE = "agentenv0"
SUBNET_ENV, DEFAULT_SUBNET = "AGENTENV_SUBNET", "10.213.0.0/16"
DNS_ENV = "AGENTENV_DNS"
VETH_PREFIX = "ae"
CMD_TIMEOUT = 30.0  # seconds an ip or nft run may take
ATTEMPTS = 64  # addresses tried before giving up (each taken one is refused at once by the kernel)
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)
_T = TypeVar("_T")


@dataclass(frozen=True)
class HostNet:
    """The host side every networked sandbox shares: the subnet and the bridge's address on it."""

    subnet: ipaddress.IPv4Network
    gateway: ipaddress.IPv4Address

    @property
    def never(self) -> tuple[str, ...]:
        """Networks no sandbox reaches besides ``netpolicy.NEVER``: the sandboxes' own subnet."""
        return (str(self.subnet),)


def subnet() -> ipaddress.IPv4Network:
    text = os.environ.get(SUBNET_ENV, DEFAULT_SUBNET)
    try:
        net = ipaddress.IPv4Network(text)
    except ValueError as e:
        raise NetworkUnavailable(f"${SUBNET_ENV}={text!r} is not an IPv4 network: {e}") from e
    if net.prefixlen > 24 or net.prefixlen < 8:
        raise NetworkUnavailable(f"${SUBNET_ENV}={text!r}: the sandboxes' subnet must be /8 to /24")
    return net


def _run(cmd: list[str], stdin: str = "") -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=CMD_TIMEOUT, check=False)
    except FileNotFoundError as e:
        raise NetworkUnavailable(f"{cmd[0]} is not installed", fix="run scripts/bootstrap.sh (iproute2, nftables)") from e
    except subprocess.TimeoutExpired as e:
        raise NetworkUnavailable(f"{' '.join(cmd[:3])} did not finish within {CMD_TIMEOUT:g} s") from e


def _must(r: subprocess.CompletedProcess[str], what: str) -> None:
    if r.returncode != 0:
        raise NetworkUnavailable(f"{what} failed: {(r.stderr or r.stdout).strip()[:400]}",
                                 fix="agentenv needs root, iproute2 and nftables (scripts/bootstrap.sh)")


def in_netns(netns: Path, fn: Callable[[], _T]) -> _T:
    """Run ``fn`` on a thread that entered the network namespace bound on ``netns`` (programs it starts are
    there too); the thread ends with it, and no other thread changes namespace."""
    def inside() -> _T:
        fd = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if _libc.setns(fd, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns({netns}): {os.strerror(err)}")
        finally:
            os.close(fd)
        return fn()

    return on_thread(inside, "agentenv-netns-setup")


def host_rules(host: HostNet) -> str:
    """The host's table (see the module doc), for ``nft -f``: replaced whole, atomically."""
    never = ", ".join((*netpolicy.NEVER, *host.never))
    return f"""table inet agentenv {{}}
delete table inet agentenv
table inet agentenv {{
  chain input {{
    type filter hook input priority filter - 10; policy accept;
    iifname "{BRIDGE}" ct state established,related accept
    iifname "{BRIDGE}" reject
  }}
  chain forward {{
    type filter hook forward priority filter - 10; policy accept;
    iifname "{BRIDGE}" oifname "{BRIDGE}" reject
    oifname "{BRIDGE}" ct state established,related accept
    oifname "{BRIDGE}" reject
    iifname "{BRIDGE}" meta nfproto ipv6 reject
    iifname "{BRIDGE}" ip saddr != {host.subnet} drop
    iifname "{BRIDGE}" ip daddr {{ {never} }} reject
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    ip saddr {host.subnet} oifname != "{BRIDGE}" masquerade
  }}
}}
"""


@functools.cache
def ensure_host() -> HostNet:
    """Make (once a process; idempotent across processes) the bridge, the host's rules and forwarding."""
    net = subnet()
    host = HostNet(net, next(net.hosts()))
    _check_routes(net)
    if not Path(f"/sys/class/net/{BRIDGE}").exists():
        r = _run(["ip", "link", "add", BRIDGE, "type", "bridge"])
        if r.returncode != 0 and "File exists" not in r.stderr:
            _must(r, f"making the bridge {BRIDGE}")
    r = _run(["ip", "addr", "replace", f"{host.gateway}/{net.prefixlen}", "dev", BRIDGE])
    _must(r, f"giving {BRIDGE} its address")
    _must(_run(["ip", "link", "set", BRIDGE, "up"]), f"bringing {BRIDGE} up")
    nft(host_rules(host))  # this thread is in the host's namespace
    try:
        Path("/proc/sys/net/ipv4/ip_forward").write_text("1")
    except OSError as e:
        raise NetworkUnavailable(f"could not turn on IPv4 forwarding: {e}") from e
    _open_forward_filter()
    return host


def _check_routes(net: ipaddress.IPv4Network) -> None:
    """NetworkUnavailable if the sandboxes' subnet overlaps a route of the host's other than the bridge's."""
    r = _run(["ip", "-4", "-o", "route", "show", "table", "all"])
    for line in r.stdout.splitlines():
        words = line.split()
        dest = words[0] if words and words[0] not in ("default", "local", "broadcast", "unicast") else (
            words[1] if len(words) > 1 and words[0] in ("local", "broadcast", "unicast") else None)
        if dest is None or "dev" not in words or words[words.index("dev") + 1] == BRIDGE:
            continue
        with contextlib.suppress(ValueError):
            other = ipaddress.IPv4Network(dest, strict=False)
            if other.prefixlen > 0 and other.overlaps(net):
                raise NetworkUnavailable(f"the sandboxes' subnet {net} overlaps the host's route {line.strip()!r}",
                                         fix=f"set ${SUBNET_ENV} to a free private /16")


def _open_forward_filter() -> None:
    """Where iptables' FORWARD policy drops (Docker sets it), accept the bridge's traffic in DOCKER-USER (or
    FORWARD): our table has already refused what must be, and a drop in any table would be final."""
    r = _run(["iptables", "-S", "FORWARD"])
    if r.returncode != 0 or "-P FORWARD DROP" not in r.stdout:
        return
    chain = "DOCKER-USER" if _run(["iptables", "-S", "DOCKER-USER"]).returncode == 0 else "FORWARD"
    for rule in (["-i", BRIDGE, "-j", "ACCEPT"], ["-o", BRIDGE, "-j", "ACCEPT"]):
        if _run(["iptables", "-C", chain, *rule]).returncode != 0:
            _must(_run(["iptables", "-I", chain, "1", *rule]), f"letting {BRIDGE}'s traffic through iptables' {chain}")


def describe() -> str:
    """The networking mode in one line, for a server's start-up log."""
    try:
        net = str(subnet())
    except NetworkUnavailable as e:
        net = f"unusable ({e})"
    dns = ", ".join(nameservers()) or "none"
    return (f"networking: every sandbox in a network namespace of its own (loopback only by default); network=True "
            f"on the isolated bridge {BRIDGE} ({net}, NAT out; the host, other sandboxes, loopback and link-local "
            f"addresses refused; private ranges only where allowed); resolvers: {dns}")


def nameservers() -> list[str]:
    """The resolvers a networked sandbox uses: ``$AGENTENV_DNS`` (comma-separated; "none"), else the host's
    IPv4 ones that are not on loopback (systemd-resolved's upstreams behind its stub)."""
    env = os.environ.get(DNS_ENV)
    if env is not None:
        return [] if env.strip() in ("", "none") else [str(ipaddress.IPv4Address(a.strip())) for a in env.split(",")]
    for conf in (Path("/etc/resolv.conf"), Path("/run/systemd/resolve/resolv.conf")):
        found = nameservers_in(conf)
        if found:
            return found
    return []


def nameservers_in(conf: Path) -> list[str]:
    """The IPv4 resolvers off loopback that the resolv.conf ``conf`` names (none if it cannot be read): also
    what a sandbox's own resolv.conf, written at its start, gives its rules."""
    found = []
    with contextlib.suppress(OSError):
        for line in conf.read_text().splitlines():
            words = line.split()
            if len(words) >= 2 and words[0] == "nameserver":
                with contextlib.suppress(ValueError):
                    addr = ipaddress.ip_address(words[1])
                    if addr.version == 4 and not addr.is_loopback:
                        found.append(str(addr))
    return found


def resolv_conf(dns: Iterable[str]) -> str:
    servers = "".join(f"nameserver {a}\n" for a in dns)
    return servers or "# agentenv: no resolver for this sandbox ($AGENTENV_DNS, or the host's /etc/resolv.conf)\n"


def veth_name(host: HostNet, address: ipaddress.IPv4Address) -> str:
    return f"{VETH_PREFIX}{int(address) - int(host.subnet.network_address):06x}"


def _candidates(host: HostNet, want: str | None) -> list[ipaddress.IPv4Address]:
    """Addresses to try: ``want`` (a restored sandbox's own) first, then random ones of the subnet."""
    first, last = int(host.gateway) + 1, int(host.subnet.broadcast_address) - 1
    out = []
    if want:
        with contextlib.suppress(ValueError):
            a = ipaddress.IPv4Address(want)
            if first <= int(a) <= last:
                out.append(a)
    out += [ipaddress.IPv4Address(random.randint(first, last)) for _ in range(ATTEMPTS)]
    return out


def attach(netns: Path, tag: str, rules: netpolicy.Rules, dns: list[str], want: str | None = None) -> dict[str, Any]:
    """Give the namespace on ``netns`` its link (a free address, ``want`` if it is), DNS and rules; returns the
    link's record ``{"address", "veth"}``. ``tag``: what the host end's alias names (the sandbox's bundle).

    One run of ``ip`` on the host makes the pair and the bridge port; inside, ioctls give ``eth0`` its address and
    route (``hostcalls.configure_ipv4``) and libnftables loads the rules: ~5 ms in all."""
    host = ensure_host()
    netmask = str(host.subnet.netmask)
    for address in _candidates(host, want):
        veth = veth_name(host, address)
        r = _run(["ip", "-batch", "-"], f"link add {veth} type veth peer name eth0 netns {netns}\n"
                                        f"link set {veth} master {BRIDGE}\n"
                                        f"link set dev {veth} type bridge_slave isolated on\n"
                                        f"link set dev {veth} alias {tag}\n"
                                        f"link set {veth} up\n")
        if r.returncode != 0 and "File exists" in r.stderr:
            continue  # the name, so the address, is another sandbox's: nothing was made
        link = {"address": str(address), "veth": veth}
        try:
            _must(r, f"making the sandbox's veth pair ({veth} on {BRIDGE})")

            def inside(address: ipaddress.IPv4Address = address) -> None:
                nft(netpolicy.ruleset(rules, dns, str(address)))  # first: a restored sandbox's processes run
                try:
                    configure_ipv4("eth0", str(address), netmask, str(host.gateway))
                except OSError as e:
                    raise NetworkUnavailable(f"configuring the sandbox's eth0 ({address}) failed: {e}") from e

            in_netns(netns, inside)
        except BaseException:
            detach(link)
            raise
        return link
    raise NetworkUnavailable(f"no free address for a sandbox on {host.subnet} after {ATTEMPTS} tries",
                             fix=f"close sandboxes, or set ${SUBNET_ENV} to a larger subnet")


def apply(netns: Path, rules: netpolicy.Rules, link: dict[str, Any]) -> None:
    """Replace the rules of the namespace whose link is ``link`` with ``rules`` (atomically: the old ones hold
    until the new are in)."""
    script = netpolicy.ruleset(rules, list(link.get("dns") or []), str(link["address"]), replace=True)
    in_netns(netns, lambda: nft(script))


@functools.cache
def _libnftables() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libnftables.so.1")
    except OSError as e:
        raise NetworkUnavailable(f"libnftables is not installed ({e})", fix="run scripts/bootstrap.sh (nftables)") from e
    lib.nft_ctx_new.restype, lib.nft_ctx_new.argtypes = ctypes.c_void_p, [ctypes.c_uint32]
    lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_get_error_buffer.restype, lib.nft_ctx_get_error_buffer.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
    lib.nft_run_cmd_from_buffer.restype = ctypes.c_int
    lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    return lib


def nft(script: str) -> None:
    """Run an nftables script in the calling thread's network namespace, in-process (libnftables, as ``nft -f``
    would: one transaction); NetworkUnavailable with nft's message if the kernel refuses it."""
    lib = _libnftables()
    ctx = lib.nft_ctx_new(0)
    if not ctx:
        raise NetworkUnavailable("libnftables could not make a context")
    try:
        lib.nft_ctx_buffer_error(ctx)
        if lib.nft_run_cmd_from_buffer(ctx, script.encode()) != 0:
            msg = (lib.nft_ctx_get_error_buffer(ctx) or b"").decode(errors="replace").strip()
            raise NetworkUnavailable(f"loading the sandbox's network rules (nftables) failed: {msg[:400]}",
                                     fix="agentenv needs root and a kernel with nf_tables (scripts/bootstrap.sh)")
    finally:
        lib.nft_ctx_free(ctx)


def detach(link: dict[str, Any] | None) -> None:
    """Delete the host end of a sandbox's veth (and so the pair); nothing if it is gone already."""
    veth = (link or {}).get("veth")
    if veth and Path(f"/sys/class/net/{veth}").exists():
        _run(["ip", "link", "del", veth])


def links(prefix: str) -> dict[str, str]:
    """The host ends of sandboxes' veths whose alias (their bundle) starts with ``prefix``: name to alias."""
    out = {}
    with contextlib.suppress(FileNotFoundError):
        for dev in os.listdir("/sys/class/net"):
            if not dev.startswith(VETH_PREFIX):
                continue
            with contextlib.suppress(OSError):
                alias = Path(f"/sys/class/net/{dev}/ifalias").read_text().strip()
                if alias.startswith(prefix):
                    out[dev] = alias
    return out


def sweep(prefix: str) -> list[str]:
    """Delete the veths under ``prefix`` whose sandbox's bundle is gone (a process killed mid-start); their
    names."""
    gone = [dev for dev, alias in links(prefix).items() if not Path(alias).exists()]
    for dev in gone:
        detach({"veth": dev})
    return gone
