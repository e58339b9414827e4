"""What the env-server fleet refuses before touching Ray, and the token fingerprint
(the fleet itself runs on a real Ray cluster in tests/integration/rollout/test_fleet.py)."""

from __future__ import annotations

import pytest

import agentenv
from agentenv.errors import Unauthorized
from agentenv.remote import fleet as found
from agentenv.server import fleet

TOKEN = "fleet-token-" + "x" * 20


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "example.org"])
def test_up_refuses_an_address_no_node_can_share(host):
    with pytest.raises(found.FleetError, match="neither loopback"):
        fleet.up(TOKEN, host=host)


def test_up_refuses_no_token_unknown_options_and_bad_ports():
    with pytest.raises(Unauthorized):
        fleet.up("")
    with pytest.raises(found.FleetError, match="unknown server option"):
        fleet.up(TOKEN, server={"max_sandbox": 3})
    with pytest.raises(found.FleetError, match="out of range"):
        fleet.up(TOKEN, port=70000)


def test_the_fingerprint_tells_a_wrong_token_without_holding_the_token():
    infos = [{"url": "http://127.0.0.1:1", "token": found.fingerprint(TOKEN)}]
    assert TOKEN not in found.fingerprint(TOKEN) and found.fingerprint(TOKEN) != found.fingerprint(TOKEN + "y")
    found.check_token(infos, TOKEN)
    with pytest.raises(Unauthorized, match="127.0.0.1:1"):
        found.check_token(infos, TOKEN + "y")


def test_pool_from_ray_needs_a_token(monkeypatch):
    monkeypatch.delenv("AGENTENV_TOKEN", raising=False)
    with pytest.raises(Unauthorized):
        agentenv.Pool.from_ray()

