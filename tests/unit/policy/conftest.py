"""Fixtures shared by the policy tests: the tokenizer, and our server in-process (an app on a real EP=1 engine,
with prefix reuse and without) for clients that talk to it through ``httpx.ASGITransport``."""

import pytest

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
