"""Importing what a server's client needs loads nothing of the host: ``from agentenv import connect, Pool``.

``agentenv`` imports its local API (``Sandbox``, ``Snapshot``: the sandbox, snapshot and host rooms) on first use, and the
client, the pool and the wire format they share with the server import neither room (``test_layout.py`` holds them
to it by their source; this test by what a fresh interpreter actually loads).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOST_ROOMS = ("agentenv.host", "agentenv.snapshot", "agentenv.sandbox")


def loaded_after(statement: str) -> list[str]:
    """The modules of the host rooms that a fresh interpreter holds once it ran ``statement`` (from the repository
    root, so it imports this checkout's packages)."""
    code = f"{statement}; import sys, json; print(json.dumps(sorted(m for m in sys.modules if m.startswith({HOST_ROOMS!r}))))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_remote_api_loads_nothing_of_the_host():
    assert loaded_after("from agentenv import connect, Pool") == []


def test_the_contract_and_the_wire_load_nothing_of_the_host():
    assert loaded_after("import agentenv, agentenv.api, agentenv.wire; from agentenv import Process, errors") == []


def test_the_local_api_is_still_there_on_first_use():
    """``agentenv.Sandbox`` and ``agentenv.Snapshot`` are the host's classes, loaded when asked for."""
    assert "agentenv.sandbox.core" in loaded_after("from agentenv import Sandbox, Snapshot")
