"""Fixtures shared by unit tests: an env server app in this process, with no sandbox capacity (no Docker)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from agentenv import server

TOKEN = "unit-token"  # the tests' modules send it as "Authorization: Bearer unit-token"


@pytest.fixture
def client(tmp_path, monkeypatch) -> Iterator[TestClient]:
    """The app on a home of its own under ``tmp_path``, behind ``TOKEN``."""
    monkeypatch.setenv("AGENTENV_HOME", str(tmp_path))
    with TestClient(server.create_app(TOKEN, max_sandboxes=0, reap_interval=60)) as c:
        yield c
