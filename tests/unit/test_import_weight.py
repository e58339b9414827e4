"""Each room imports only what it needs: the sandbox library alone needs no Gymnasium, web stack or torch."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _loaded(statement: str, modules: list[str]) -> list[str]:
    code = f"import sys; {statement}; print(' '.join(m for m in {modules!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return out.split()


@pytest.mark.parametrize(("statement", "absent"), [
    ("import agentenv", ["gymnasium", "fastapi", "pydantic", "torch", "httpx", "envs", "policy"]),
    ("import agentenv.api", ["docker", "msgpack", "gymnasium", "torch"]),
    ("import envs", ["torch", "fastapi", "tokenizers"]),
    ("from policy import chat", ["torch", "numpy", "pydantic", "agentenv", "envs"]),
])
def test_imports_stay_in_their_room(statement, absent):
    assert _loaded(statement, absent) == []


def test_the_remote_api_loads_on_first_use():
    assert _loaded("import agentenv; agentenv.connect", ["httpx"]) == ["httpx"]
