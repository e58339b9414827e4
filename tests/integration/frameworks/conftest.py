"""Fixtures of the RL-framework adapters' tests: a real SWE-v0 task (toolz, its image built) and a Lookup-v0 task,
and the LLM text of the tool calls a scripted policy sends (K3's tool-call section)."""

from __future__ import annotations

from typing import Any

import pytest

from envs.images import build_image
from envs.lookup_env import make_task
from envs.task import Task, shipped_tasks
from envs.tasks.libraries import load_libraries
from policy.chat import render_tool_calls


@pytest.fixture(scope="session")
def swe_task() -> Task:
    """A shipped SWE-v0 task of toolz, with its image built (cached by input hash: seconds when nothing changed)."""
    task = next(t for t in shipped_tasks() if t.metadata["library"] == "toolz")
    build_image(next(lib for lib in load_libraries() if lib.name == "toolz").recipe)
    return task


@pytest.fixture(scope="session")
def lookup_task() -> Any:
    """A held-out level-1 Lookup-v0 task: ``cat NAME`` shows the code to answer."""
    return make_task(1, 1_000_001)


def call(name: str, **arguments: Any) -> str:
    """The LLM text of one tool call (what a K3 policy writes)."""
    return render_tool_calls([{"function": {"name": name, "arguments": arguments}}])


GOLD_PATH = "/testbed/.fix.patch"


def gold_actions(task: Task) -> list[str]:
    """Apply the task's gold patch, then submit: the episode an expert plays."""
    return [call("create", path=GOLD_PATH, file_text=task.patch),
            call("bash", command=f"git apply {GOLD_PATH} && rm {GOLD_PATH} && echo applied"), call("submit")]
