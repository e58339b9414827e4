"""Fixtures shared by the policy tests: the tokenizer, and our server in-process (an app on a real EP=1 engine,
with prefix reuse and without) for clients that talk to it through ``httpx.ASGITransport``, or a test client
(``client``) and ``post(path, body)`` that returns the JSON of a 200 answer."""

import pytest
from fastapi.testclient import TestClient

from policy.config import k3_mini
from policy.engine import Engine
from policy.server import create_app
from policy.tokenizer import load_tokenizer

TOKEN = "t"


@pytest.fixture(scope="session")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="session")
def engine_pair(tok):
    cfg = k3_mini(vocab_size=tok.vocab_size, eos_token_id=tok.eos_id)
    reuse = Engine(cfg, tok, seed=0, max_context=512)
    plain = Engine(cfg, tok, seed=0, max_context=512, prefix_cache_bytes=0)
    yield reuse, plain
    reuse.close()
    plain.close()


@pytest.fixture(scope="session")
def server_app(engine_pair):
    """(app with prefix reuse, app without), both serving k3-mini with bearer token ``t``."""
    reuse, plain = engine_pair
    return create_app(reuse, TOKEN), create_app(plain, TOKEN)


@pytest.fixture(scope="module")
def client(server_app):
    return TestClient(server_app[0])


@pytest.fixture(scope="module")
def post(client):
    """``post(path, body)``: the JSON answer of the app with prefix reuse (model and token set), which must be 200."""

    def send(path: str, body: dict) -> dict:
        r = client.post(path, headers={"Authorization": f"Bearer {TOKEN}"}, json={"model": "k3-mini", **body})
        assert r.status_code == 200, r.text
        return r.json()

    return send
