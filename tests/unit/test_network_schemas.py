"""The network body over the wire, without Docker: the native schema (``network`` of a create, the rules of
``PUT /network``), the remote client's body, and E2B's ``allow_internet_access`` / ``network`` mapping."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from agentenv import errors, server
from agentenv.api import Network
from agentenv.netpolicy import MAX_ENTRIES
from agentenv.remote.client import _network_body
from agentenv.server.schemas import CreateRequest, NetworkRequest, NetworkRules

TOKEN = "unit-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_create_takes_a_bool_or_the_two_rule_lists() -> None:
    assert CreateRequest().network is False
    assert CreateRequest(network=True).network is True
    rules = CreateRequest.model_validate({"network": {"allow_out": ["198.51.100.7"], "deny_out": ["0.0.0.0/0"]}})
    assert isinstance(rules.network, NetworkRules)
    assert rules.network.model_dump() == {"allow_out": ["198.51.100.7"], "deny_out": ["0.0.0.0/0"]}
    assert CreateRequest.model_validate({"network": {}}).network == NetworkRules()  # no rules: like True


@pytest.mark.parametrize(("network", "says"), [
    ({"allow_out": ["1.2.3.4"], "mask_request_host": "x"}, "mask_request_host"),  # nothing accepted and ignored
    ({"allowOut": ["1.2.3.4"]}, "allowOut"),  # E2B's spelling belongs to E2B's routes
    ({"allow_out": "1.2.3.4"}, "allow_out"),
    ({"allow_out": [1]}, "allow_out"),
    ({"deny_out": ["a\x00b"]}, "deny_out"),
    ({"deny_out": [""]}, "deny_out"),
    ({"allow_out": [f"10.0.{i // 256}.{i % 256}" for i in range(MAX_ENTRIES + 1)]}, "allow_out"),
    ("yes", "network"), (1, "network"), (None, "network"),
])
def test_create_refuses_other_network_shapes_naming_them(network: object, says: str) -> None:
    with pytest.raises(ValidationError) as e:
        CreateRequest.model_validate({"network": network})
    assert says in str(e.value)


def test_the_update_body_is_the_rules_whole() -> None:
    assert NetworkRequest.model_validate({}).model_dump() == {"allow_out": [], "deny_out": []}
    with pytest.raises(ValidationError, match="only allow_out and deny_out"):
        NetworkRequest.model_validate({"allow_out": [], "dns_servers": ["1.1.1.1"]})


def test_bad_network_bodies_are_422_with_the_reason(client) -> None:
    r = client.post("/v1/sandboxes", json={"network": {"allow_out": [], "egress_proxy": "p:1080"}}, headers=AUTH)
    assert r.status_code == 422 and "egress_proxy" in r.json()["message"], r.text
    r = client.post("/v1/sandboxes", json={"network": "on"}, headers=AUTH)
    assert r.status_code == 422 and "network" in r.json()["message"], r.text
    r = client.put("/v1/sandboxes/sb-x/network", json={"allow_out": [], "surprise": 1}, headers=AUTH)
    assert r.status_code == 422 and "surprise" in r.json()["message"], r.text
    r = client.put("/v1/sandboxes/sb-x/network", json={"allow_out": ["1.2.3.4"]}, headers=AUTH)
    assert r.status_code == 404 and r.json()["error"] == "SandboxNotFound"


def test_openapi_documents_the_network_route_and_body(client) -> None:
    spec = client.get("/openapi.json").json()
    op = spec["paths"]["/v1/sandboxes/{sandbox_id}/network"]["put"]
    assert {"400", "401", "404", "409", "422"} <= set(op["responses"])
    assert "NetworkRuleError" in op["responses"]["400"]["description"]
    rules = spec["components"]["schemas"]["NetworkRules"]
    assert rules["additionalProperties"] is False and set(rules["properties"]) == {"allow_out", "deny_out"}
    create = spec["components"]["schemas"]["CreateRequest"]["properties"]["network"]
    assert {"type": "boolean"} in create["oneOf"]


def test_the_remote_client_sends_a_bool_or_the_two_lists() -> None:
    assert _network_body(False) is False and _network_body(True) is True and _network_body(None) is False
    assert _network_body(Network(allow_out=("a.example",), deny_out=("0.0.0.0/0",))) == {
        "allow_out": ["a.example"], "deny_out": ["0.0.0.0/0"]}
    assert _network_body({"deny_out": ("10.0.0.0/8",)}) == {"allow_out": [], "deny_out": ["10.0.0.0/8"]}
    for bad in [{"allow_out": [], "allowPublicTraffic": True}, {"allow_out": "1.2.3.4"}, "yes", 1,
                Network(address="10.213.0.5")]:
        with pytest.raises(errors.NetworkRuleError):
            _network_body(bad)  # type: ignore[arg-type]


e2b_control = pytest.importorskip("agentenv.server.e2b.control", reason="the E2B SDK is an extra")
ports = pytest.importorskip("agentenv.server.e2b.ports", reason="the E2B SDK is an extra")


def _asked(body: dict) -> object:
    return e2b_control.NewSandbox.model_validate({"templateID": "base", **body}).network_asked()


def test_e2b_create_maps_internet_access_and_rules() -> None:
    assert _asked({}) is True  # E2B's default: internet access
    assert _asked({"allow_internet_access": True}) is True
    assert _asked({"allow_internet_access": False}) is False  # loopback only
    assert _asked({"allow_internet_access": False, "network": {"denyOut": ["10.0.0.0/8"]}}) is False
    assert _asked({"allow_internet_access": False, "network": {"allowOut": ["198.51.100.7"]}}) == {
        "allow_out": ["198.51.100.7"], "deny_out": ["0.0.0.0/0"]}  # E2B: false is denyOut 0.0.0.0/0
    assert _asked({"network": {"allowOut": ["198.51.100.7"], "denyOut": ["0.0.0.0/0"]}}) == {
        "allow_out": ["198.51.100.7"], "deny_out": ["0.0.0.0/0"]}
    assert _asked({"network": {"allow_out": ["a.example"]}}) == {"allow_out": ["a.example"], "deny_out": []}
    assert _asked({"network": {"allowPublicTraffic": False, "egressProxy": None, "rules": {}, "httpsPorts": []}}) is True


@pytest.mark.parametrize(("network", "named"), [
    ({"dnsServers": []}, "dnsServers"), ({"dnsServers": ["1.1.1.1"]}, "dnsServers"),
    ({"egressProxy": {"address": "p.example:1080"}}, "egressProxy"),
    ({"rules": {"api.example.com": [{}]}}, "rules"), ({"httpsPorts": [3000]}, "httpsPorts"),
    ({"allowOut": ["1.2.3.4"], "somethingNew": 1}, "somethingNew"),
])
def test_e2b_network_options_agentenv_does_not_enforce_are_refused_by_name(network: dict, named: str) -> None:
    with pytest.raises(e2b_control.E2BError) as e:
        _asked({"network": network})
    assert e.value.code == 400 and named in e.value.message


def test_e2b_public_traffic_and_host_mask_become_the_sandboxs_labels() -> None:
    asked = e2b_control.NetworkConfig.model_validate({"allowPublicTraffic": True, "maskRequestHost": "${PORT}-a.example"})
    assert asked.labels() == {ports.PUBLIC_LABEL: "true", ports.MASK_LABEL: "${PORT}-a.example"}
    assert e2b_control.NetworkConfig.model_validate({"allowPublicTraffic": False}).labels() == {}
    assert _asked({"network": {"allowPublicTraffic": True, "maskRequestHost": "h:${PORT}"}}) is True  # no rules


def test_e2b_routes_refuse_unenforced_options_before_touching_a_sandbox(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("AGENTENV_HOME", str(tmp_path))
    with TestClient(server.create_app(TOKEN, max_sandboxes=0, reap_interval=60, e2b=True)) as c:
        key = {"X-API-KEY": TOKEN}
        r = c.put("/sandboxes/sb-x/network", json={"allowOut": [], "dnsServers": ["1.1.1.1"]}, headers=key)
        assert r.status_code == 400 and "dnsServers" in r.json()["message"], r.text
        r = c.post("/v2/sandboxes", json={"templateID": "base", "network": {"rules": {"h": [{}]}}}, headers=key)
        assert r.status_code == 400 and "rules" in r.json()["message"], r.text
        for only_at_create in ({"maskRequestHost": "h"}, {"allowPublicTraffic": True}):  # E2B's update has neither
            r = c.put("/sandboxes/sb-x/network", json=only_at_create, headers=key)
            assert r.status_code == 400 and next(iter(only_at_create)) in r.json()["message"], r.text
        r = c.post("/v2/sandboxes", json={"templateID": "base", "network": {"maskRequestHost": "a b"}}, headers=key)
        assert r.status_code == 400, r.text  # a Host with a space is no Host
        r = c.put("/sandboxes/sb-x/network", json={"allowOut": "1.2.3.4"}, headers=key)
        assert r.status_code == 400, r.text
        r = c.put("/sandboxes/sb-x/network", json={"denyOut": ["0.0.0.0/0"]}, headers=key)
        assert r.status_code == 404, r.text
