"""Helpers of the rollout integration tests: scripted policies, task files, what a run left on this host."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentenv import Sandbox, Snapshot
from rollout import scripted
from rollout.ownership import RUN_LABEL

# --- scripts ------------------------------------------------------------------------------------------------


def calc_script(prompt: str, turn: int) -> str:
    """Tool-v0: the calculator, then the answer (no sandbox)."""
    if turn == 0:
        return scripted.tool_call("calculator", {"expression": "6 * 7"})
    return scripted.tool_call("answer", {"answer": "42"})


def python_script(prompt: str, turn: int) -> str:
    """Tool-v0: the python tool (starts the episode's sandbox), then the answer."""
    if turn == 0:
        return scripted.tool_call("python", {"code": "print(6 * 7)"})
    return scripted.tool_call("answer", {"answer": "42"})


def tool_tasks(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"id": f"q{i}", "question": f"What is 6 * 7? (#{i})", "answer": "42",
                                        "match": "numeric"}) + "\n" for i in range(n)))
    return path


def labelled(run_id: str) -> dict[str, list[str]]:
    """Sandboxes and snapshots of this host that carry the run's label (a store not made yet holds none)."""
    def listed(factory: Any) -> list[Any]:
        try:
            return list(factory.list())
        except FileNotFoundError:
            return []

    return {"sandboxes": [s.id for s in listed(Sandbox) if s.labels.get(RUN_LABEL) == run_id],
            "snapshots": [s.id for s in listed(Snapshot) if s.labels.get(RUN_LABEL) == run_id]}


def wait_for(cond: Callable[[], Any], limit: float = 120.0, every: float = 0.1) -> Any:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            value = cond()
            if value:
                return value
        time.sleep(every)
    raise AssertionError("the condition did not hold in time")
