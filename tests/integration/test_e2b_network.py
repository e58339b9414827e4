"""E2B's network options through the real SDK: ``network`` allow/deny lists at create, ``update_network`` on a
running sandbox and ``allow_internet_access=False`` are enforced inside the sandbox (``agentenv.netpolicy``), and an
entry that cannot be enforced is E2B's 400 naming it. Every address is a test host on this machine (``net_hosts``)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from .net_hosts import Outside, outside_hosts
from .netprobe import probe, reached

e2b = pytest.importorskip("e2b", reason="the E2B SDK is a test extra; bootstrap installs it")

from e2b import Sandbox, SandboxException  # noqa: E402
from e2b.sandbox.commands.command_handle import CommandExitException  # noqa: E402

ALL = "0.0.0.0/0"


@dataclass
class Ran:
    exit_code: int
    stdout: str
    stderr: str


class Commands:
    """What ``netprobe.probe`` needs of a sandbox (``exec``), over the SDK's ``commands.run``."""

    def __init__(self, sb: Sandbox) -> None:
        self.sb = sb

    def exec(self, command: str, timeout: float) -> Ran:
        try:
            r = self.sb.commands.run(command, timeout=timeout)
        except CommandExitException as e:
            return Ran(e.exit_code, e.stdout, e.stderr)
        return Ran(r.exit_code, r.stdout, r.stderr)


@pytest.fixture(scope="module")
def outside() -> Iterator[Outside]:
    with outside_hosts() as o:
        yield o


def _targets(o: Outside) -> tuple[str, str]:
    return f"{o.allowed}:{o.http_port}", f"{o.denied}:{o.http_port}"


def test_an_allowlist_at_create_and_its_update_are_enforced(e2b_url: str, outside: Outside) -> None:
    allowed, denied = _targets(outside)
    sb = Sandbox.create(timeout=120, network={"allow_out": [outside.allowed], "deny_out": [ALL]})
    try:
        assert reached(probe(Commands(sb), [allowed, denied])) == [allowed]
        sb.update_network({"deny_out": [outside.allowed]})  # replaced whole: the allowlist is gone
        assert reached(probe(Commands(sb), [allowed, denied])) == [denied]
        sb.update_network({})  # cleared
        assert reached(probe(Commands(sb), [allowed, denied])) == sorted([allowed, denied])
    finally:
        sb.kill()


def test_no_internet_access_reaches_nothing_and_unenforceable_rules_are_refused(e2b_url: str,
                                                                               outside: Outside) -> None:
    allowed, denied = _targets(outside)
    sb = Sandbox.create(timeout=120, allow_internet_access=False)
    try:
        assert reached(probe(Commands(sb), [allowed, denied])) == []
    finally:
        sb.kill()
    with pytest.raises(SandboxException, match="2001:db8::1"):  # IPv6: sandboxes have no IPv6 route
        Sandbox.create(timeout=120, network={"allow_out": ["2001:db8::1"], "deny_out": [ALL]})
    sb = Sandbox.create(timeout=120, network={"deny_out": [outside.denied]})
    try:
        with pytest.raises(SandboxException, match=r"\*\.example\.com"):  # wildcard names are not enforced
            sb.update_network({"allow_out": ["*.example.com"]})
        assert reached(probe(Commands(sb), [allowed, denied])) == [allowed]  # the rules in force stay
    finally:
        sb.kill()
