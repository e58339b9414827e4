"""Which sandbox and port a request for E2B's sandbox traffic names, and which of its headers go on."""

from __future__ import annotations

import pytest

pytest.importorskip("e2b", reason="the E2B SDK is a test extra; bootstrap installs it")

from agentenv.server.e2b.ports import Refused, admitted, forwarded, host_route, masked, route_of  # noqa: E402
from agentenv.server.e2b.tokens import envd_token, traffic_token  # noqa: E402


@pytest.mark.parametrize(("host", "domain", "route"), [
    (b"8000-sb-abc.sandbox.test", "sandbox.test", ("sb-abc", "8000")),
    (b"8000-SB-abc.Sandbox.Test:443", "sandbox.test", ("sb-abc", "8000")),  # host names have no case
    (b"8000-sb-abc.sandbox.test:8700", "sandbox.test:8700", ("sb-abc", "8000")),
    (b"8000-sb-abc.other.test", "sandbox.test", None),
    (b"x.8000-sb-abc.sandbox.test", "sandbox.test", None),
    (b"sandbox.test", "sandbox.test", None),
    (b"-sb-abc.sandbox.test", "sandbox.test", None),
    (b"8000-sb-abc.sandbox.test", None, None),  # no --domain: Host names route nothing
])
def test_get_hosts_names_route_to_their_sandbox_and_port(host: bytes, domain: str | None, route: object) -> None:
    assert host_route(host, domain) == route


def test_the_routing_headers_come_first_and_default_to_envd() -> None:
    assert route_of({b"e2b-sandbox-id": b"sb-1", b"host": b"8000-sb-2.d"}, "d") == ("sb-1", "49983")
    assert route_of({b"e2b-sandbox-id": b"sb-1", b"e2b-sandbox-port": b"8000"}, None) == ("sb-1", "8000")
    assert route_of({b"host": b"127.0.0.1:8700"}, "d") is None


def test_admission_checks_the_token_and_the_port() -> None:
    ok = [(b"e2b-traffic-access-token", traffic_token("T", "sb-1").encode())]
    envd = [(b"x-access-token", envd_token("T", "sb-1").encode())]
    assert admitted(ok, ("sb-1", "8000"), "T") == ("sb-1", 8000, "traffic")
    assert admitted(envd, ("sb-1", "49983"), "T") == ("sb-1", 49983, "envd")
    # the interpreter's port takes either (its /execute then asks for envd's: interpreter.py)
    assert admitted(ok, ("sb-1", "49999"), "T") == ("sb-1", 49999, "traffic")
    assert admitted(envd + ok, ("sb-1", "49999"), "T") == ("sb-1", 49999, "envd")
    for headers, port, status in ((ok, "0", 502), (ok, "65536", 502), (ok, "8e3", 502), ([], "8000", 403),
                                  ([(b"e2b-traffic-access-token", traffic_token("T", "sb-2").encode())], "8000", 403),
                                  (envd, "8000", 403), ([(b"e2b-traffic-access-token", envd[0][1])], "8000", 403),
                                  ([], "49983", 401), ([], "49999", 401),  # envd's and the interpreter's own 401
                                  (ok, "49983", 401), ([(b"x-access-token", ok[0][1])], "49983", 401),
                                  (ok + ok, "8000", 400)):
        with pytest.raises(Refused) as e:
            admitted(headers, ("sb-1", port), "T")
        assert e.value.status == status, (headers, port)


def test_neither_hop_by_hop_nor_routing_headers_go_on() -> None:
    headers = [(b"host", b"h"), (b"connection", b"keep-alive"), (b"x-access-token", b"t"), (b"e2b-sandbox-id", b"s"),
               (b"transfer-encoding", b"chunked"), (b"x-mine", b"1")]
    assert forwarded(headers) == [(b"host", b"h"), (b"x-mine", b"1")]


def test_a_public_sandbox_opens_its_ports_without_the_token_but_never_envds() -> None:
    assert admitted([], ("sb-1", "8000"), "T", public=True) == ("sb-1", 8000, "public")
    with pytest.raises(Refused) as e:
        admitted([], ("sb-1", "49983"), "T", public=True)  # envd's own token still guards the sandbox's insides
    assert e.value.status == 401
    with pytest.raises(Refused) as e:
        admitted([], ("sb-1", "0"), "T", public=True)
    assert e.value.status == 502


def test_a_host_mask_replaces_the_host_with_the_port_put_in() -> None:
    headers = [(b"host", b"8000-sb-1.d"), (b"x-mine", b"1")]
    assert masked(headers, "custom.example.com:${PORT}", 8000) == [(b"x-mine", b"1"), (b"host", b"custom.example.com:8000")]
    assert masked([(b"x-mine", b"1")], "${PORT}-a.example", 3000) == [(b"x-mine", b"1"), (b"host", b"3000-a.example")]
    assert masked(headers, None, 8000) == headers
