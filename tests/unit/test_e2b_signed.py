"""Signed file URLs (``agentenv.server.e2b.signed``): the SDK's signatures check out for their sandbox alone."""

from __future__ import annotations

import urllib.parse

import pytest

pytest.importorskip("e2b", reason="the E2B SDK is an extra; bootstrap installs it")

from e2b.sandbox.signature import get_signature  # noqa: E402

from agentenv.server.e2b.ports import Refused  # noqa: E402
from agentenv.server.e2b.signed import sandbox_of, signed  # noqa: E402
from agentenv.server.e2b.tokens import envd_token  # noqa: E402
from policy.authlimit import AuthFailures  # noqa: E402

TOKEN = "server-token"


def _query(sid: str, path: str, op: str, user: str | None, expires_in: int | None = None) -> bytes:
    sig = get_signature(path, op, user, envd_token(TOKEN, sid), expires_in)  # type: ignore[arg-type]
    q = {"path": path, **({"username": user} if user else {}), "signature": sig["signature"],
         **({"signature_expiration": str(sig["expiration"])} if sig["expiration"] else {})}
    return urllib.parse.urlencode(q, quote_via=urllib.parse.quote).encode()


def test_the_sdks_signature_names_its_sandbox() -> None:
    q = _query("sb-1", "/home/user/a b+c.txt", "read", "user")
    assert signed("/files", q) and not signed("/filesystem.Filesystem/Stat", q)
    assert sandbox_of("GET", q, TOKEN, "sb-1") == "sb-1"
    assert sandbox_of("GET", _query("sb-1", "x", "read", None, 60), TOKEN, "sb-1") == "sb-1"
    assert sandbox_of("POST", _query("sb-1", "x", "write", None), TOKEN, "sb-1") == "sb-1"


@pytest.mark.parametrize(("method", "query", "named", "message"), [
    ("GET", _query("sb-1", "x", "read", "user"), "sb-2", "invalid signature"),  # another sandbox's token
    ("POST", _query("sb-1", "x", "read", "user"), "sb-1", "invalid signature"),  # a read used to write
    ("GET", _query("sb-1", "x", "read", "user").replace(b"path=x", b"path=y"), "sb-1", "invalid signature"),
    ("GET", _query("sb-1", "x", "read", "user", -120), "sb-1", "signature is already expired"),
    ("DELETE", _query("sb-1", "x", "read", "user"), "sb-1", "GET (read) or POST (write)"),
    ("GET", b"path=x&signature=", "sb-1", "missing signature"),
])
def test_wrong_or_expired_signatures_are_refused(method: str, query: bytes, named: str, message: str) -> None:
    with pytest.raises(Refused) as e:
        sandbox_of(method, query, TOKEN, named)
    assert e.value.status == 401 and message in e.value.message


def test_a_repeated_field_is_refused() -> None:
    with pytest.raises(Refused) as e:
        sandbox_of("GET", _query("sb-1", "x", "read", "user") + b"&path=y", TOKEN, "sb-1")
    assert e.value.status == 400


def test_signature_scans_run_in_threads_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """A signed URL needs no token, so its scan (a hash per sandbox) must not take the threads of the control
    plane or of a sandbox: ``SandboxPorts`` runs it under a limiter of its own, of ``SCAN_THREADS`` threads."""
    import anyio

    import agentenv.server.e2b as e2b_server
    from agentenv.server.e2b import bridge

    seen: list[object] = []

    def scan(*_: object) -> str:
        seen.append(bridge.threads.get())
        return "sb-1"

    monkeypatch.setattr(e2b_server, "sandbox_of", scan)
    ports = e2b_server.SandboxPorts(app=None, service=None, token=TOKEN, ports={},  # type: ignore[arg-type]
                                    failures=AuthFailures())
    scope = {"type": "http", "method": "GET", "path": "/files", "headers": [], "query_string": b"path=a&signature=v1_x"}
    assert anyio.run(ports._signed, scope, None, (None, None)) == ("sb-1", e2b_server.ENVD_PORT)
    assert seen == [ports.scans] and ports.scans.total_tokens == e2b_server.SCAN_THREADS
    assert bridge.threads.get() is None  # reset after the scan
