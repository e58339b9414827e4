"""Fixtures shared by unit tests: an env server app in this process, with no sandbox capacity (no Docker), and
the sandbox keeper run as a plain process on a temporary socket."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from agentenv import server
from agentenv.host.keeper_start import keeper_file
from agentenv.sandbox.channel import Channel, Gate

TOKEN = "unit-token"  # the tests' modules send it as "Authorization: Bearer unit-token"


@pytest.fixture
def client(tmp_path, monkeypatch) -> Iterator[TestClient]:
    """The app on a home of its own under ``tmp_path``, behind ``TOKEN``."""
    monkeypatch.setenv("AGENTENV_HOME", str(tmp_path))
    with TestClient(server.create_app(TOKEN, max_sandboxes=0, reap_interval=60)) as c:
        yield c


@pytest.fixture
def ch(tmp_path: Path) -> Iterator[Channel]:
    """The joined keeper as a plain process (no container) and the host's channel to it, heartbeats every 0.1 s."""
    path = str(tmp_path / "keeper" / "agent.sock")  # the folder is the keeper's own: the file API refuses it
    proc = subprocess.Popen([sys.executable, str(keeper_file(tmp_path)), path], env={**os.environ, "AGENTENV_HEARTBEAT": "0.1"})
    channel = Channel(lambda: "/", Gate(), path)
    channel.connect(wait=10).close()
    yield channel
    proc.kill()
    proc.wait()
