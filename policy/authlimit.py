"""A budget of failed authentication per peer: one implementation for the env server (its bearer token, console
login, E2B API key, sandbox tokens and signed URLs) and the policy server (its bearer token).

It is a leaf of the standard library alone, so that both servers may import it: the policy package imports no
other package, and agentenv imports this one module of it (``tests/unit/test_layout.py``'s ``SHARED_LEAVES``, as
``envs`` imports ``policy.chat``). Here rather than in agentenv because importing agentenv starts its sandbox
stack, which a policy server on a GPU machine has no use for; importing ``policy.authlimit`` imports nothing else.

Which peer. On loopback every client is 127.0.0.1, so the address tells nobody apart, and one budget for all would
let any local user lock the operator out by flooding wrong tokens. What does tell local clients apart is the user
that owns the client's socket: the kernel answers it for the connection's other end (sock_diag's exact lookup,
what ``ss -e`` shows), and no user can make a socket that another owns. So a peer on this host is its uid, and a
peer on another host (or one the lookup cannot find) its address.

What a budget does. ``BURST`` wrong credentials, then ``RATE`` more a second (a token bucket). While a peer's budget
is spent, its requests that carry a credential are refused *before* it is checked (429, with Retry-After), the
right one too: answering them at all, however late, would answer its guesses. So one local user tries at most
``RATE`` tokens a second (where ~1,000 went before), and another user's requests, the operator's, are never
refused for it; nor is a right credential from a peer whose budget is not spent ever slowed or counted. A request
with no credential at all (a browser's, a probe's) is refused without counting: only a wrong one spends. What it
cannot tell apart is two clients of one uid: one that keeps sending a stale token spends the budget of its uid's
other clients (the 429 says so).
"""

from __future__ import annotations

import collections
import hmac
import math
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

RATE = 1.0  # wrong credentials a second a peer may send, once its BURST is spent
BURST = 60  # wrong credentials a peer may send at once (a minute's worth: room for a fuzzer's probes, a stale retry)
MAX_PEERS = 4096  # peers whose budgets are kept; the one heard from least recently goes first

Address = tuple[str, int]
Peer = tuple[str, object]  # ("uid", n) or ("address", host)

# sock_diag (linux/sock_diag.h, linux/inet_diag.h): an exact lookup of one TCP socket by its four-tuple
_NETLINK_SOCK_DIAG, _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, _NO_COOKIE = 4, 20, 1, 0xFFFFFFFF
_UID_AT = 16 + 4 + 48 + 12  # nlmsghdr, then inet_diag_msg: family/state/timer/retrans, sockid, expires/rqueue/wqueue


class Spent(Exception):
    """A peer's budget of failed authentication is spent: retry after ``retry_after`` seconds."""

    def __init__(self, retry_after: float) -> None:
        self.retry_after = retry_after
        self.seconds = max(1, math.ceil(retry_after))  # for a Retry-After header
        super().__init__(f"too many wrong credentials from this client (its user, on this host): none is checked for "
                         f"{self.seconds} s more; stop whatever sends a wrong token (a stale token file?)")


def socket_owner(local: Address, remote: Address) -> int | None:
    """The uid owning this host's TCP socket bound to ``local`` and connected to ``remote`` (the client's end of a
    connection this server accepted: ``local`` is the client's address); None if no socket of this network
    namespace is (a peer on another host) or the kernel cannot say."""
    try:
        family = socket.AF_INET6 if ":" in local[0] else socket.AF_INET
        src, dst = (socket.inet_pton(family, a).ljust(16, b"\0") for a in (local[0], remote[0]))
        sockid = struct.pack("!HH", local[1], remote[1]) + src + dst + struct.pack("=III", 0, _NO_COOKIE, _NO_COOKIE)
    except (OSError, ValueError, struct.error):
        return None  # not an IP address (a test client's name)
    req = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + sockid
    message = struct.pack("=IHHII", 16 + len(req), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 0, 0) + req
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, _NETLINK_SOCK_DIAG) as s:
            s.settimeout(1.0)
            s.send(message)
            answer = s.recv(4096)
    except OSError:
        return None
    if len(answer) < _UID_AT + 4 or struct.unpack_from("=H", answer, 4)[0] != _SOCK_DIAG_BY_FAMILY:
        return None  # an error message: no such socket here
    uid: int = struct.unpack_from("=I", answer, _UID_AT)[0]
    return uid


def peer_of(client: Address | None, server: Address | None) -> Peer:
    """Who a connection's other end is: the uid owning its socket when it is of this host, else its address."""
    if client is None:
        return ("address", "")
    uid = socket_owner(client, server) if server is not None else None
    return ("uid", uid) if uid is not None else ("address", client[0])


class AuthFailures:
    """The budgets of one server's peers (see the module's docstring); ``clock``: where time comes from."""

    def __init__(self, rate: float = RATE, burst: int = BURST, peer: Callable[[Address | None, Address | None],
                                                                                Peer] = peer_of) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError(f"a failure budget needs a rate > 0 and a burst >= 1, not {rate} and {burst}")
        self.rate, self.burst, self.peer = rate, burst, peer
        self.clock: Callable[[], float] = time.monotonic
        self._budgets: collections.OrderedDict[Peer, tuple[float, float]] = collections.OrderedDict()  # left, at
        self._spent: dict[Peer, float] = {}  # peers whose budget is spent: when they may try again
        self._lock = threading.Lock()

    def matches(self, scope: Mapping[str, Any], given: bytes, expected: bytes) -> bool:
        """Whether ``given`` is ``expected`` (in constant time) for the request of ASGI ``scope``: ``judge`` with the
        peer of its connection, ``given`` empty counting as nothing sent."""
        return self.judge(scope.get("client"), scope.get("server"), bool(given),
                          lambda: hmac.compare_digest(given, expected))

    def judge(self, client: Address | None, server: Address | None, sent: bool, right: Callable[[], bool]) -> bool:
        """``right()``, the check of a request's credential (``sent``: it carried one), around ``before`` and
        ``failed``: ``Spent`` instead of asking it while the peer's budget is spent, and a wrong one counted."""
        peer = self.before(client, server, sent)
        if right():
            return True
        if sent:
            self.failed(client, server, peer)
        return False

    def before(self, client: Address | None, server: Address | None, sent: bool) -> Peer | None:
        """Before a credential is checked: ``Spent`` when the request carries one (``sent``) and its peer's budget is
        spent; the peer, where it had to be looked up (only while some peer's budget is spent)."""
        if not (sent and self._spent):
            return None
        peer = self.peer(client, server)
        with self._lock:
            until = self._spent.get(peer)
            now = self.clock()
            if until is not None and now < until:
                raise Spent(until - now)
            self._spent.pop(peer, None)
        return peer

    def failed(self, client: Address | None, server: Address | None, peer: Peer | None = None) -> None:
        """Count a wrong credential against the peer (``peer``: as ``before`` found it, else looked up)."""
        peer = peer or self.peer(client, server)
        with self._lock:
            now = self.clock()
            left, at = self._budgets.pop(peer, (float(self.burst), now))
            left = min(float(self.burst), left + (now - at) * self.rate) - 1.0
            self._budgets[peer] = (left, now)
            if left < 1.0:
                self._spent[peer] = now + (1.0 - left) / self.rate
            while len(self._budgets) > MAX_PEERS:
                self._spent.pop(self._budgets.popitem(last=False)[0], None)
