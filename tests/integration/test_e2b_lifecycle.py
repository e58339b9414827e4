"""The sandbox lifecycle as the ``e2b`` SDK (2.63) and E2B's own tests expect it, against a real ``agentenv serve``:
key shape, what a timeout does, fork of a paused sandbox, metrics, listing, file edge cases, strict bodies."""

from __future__ import annotations

import datetime as dt
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

e2b = pytest.importorskip("e2b", reason="the E2B SDK is a test extra; bootstrap installs it")

from e2b import Sandbox, SandboxQuery, SandboxState  # noqa: E402

from .server_fixtures import TOKEN, free_port, start_server_process  # noqa: E402


@pytest.fixture
def sandbox(e2b_url: str) -> Iterator[Sandbox]:
    sb = Sandbox.create(timeout=600)
    try:
        yield sb
    finally:
        Sandbox.kill(sb.sandbox_id)


def _wait(check: object, what: str, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.1)


def test_a_missing_token_file_gets_an_e2b_shaped_key_that_the_sdk_uses(tmp_path: Path) -> None:
    token_file = tmp_path / "new-token"
    port = free_port()
    proc = start_server_process(port, token_file, "--e2b")
    try:
        key = token_file.read_text().strip()
        assert re.fullmatch(r"e2b_[0-9a-f]{40}", key), key
        assert token_file.stat().st_mode & 0o077 == 0
        url = f"http://127.0.0.1:{port}"
        assert Sandbox.list(api_key=key, api_url=url).next_items() is not None
        with pytest.raises(e2b.AuthenticationException):
            Sandbox.list(api_key=TOKEN, api_url=url).next_items()
    finally:
        proc.terminate()
        proc.wait(30)
    proc = start_server_process(port, token_file, "--e2b")  # an existing file is read, not replaced
    try:
        assert token_file.read_text().strip() == key
    finally:
        proc.terminate()
        proc.wait(30)
