"""TRL: SWE-v0 and Lookup-v0 rollouts through the ``environment_factory`` contract of ``GRPOTrainer`` (TRL 1.16)
on real sandboxes: the tools TRL finds on the class and their schemas (transformers' ``get_json_schema``, which
TRL's chat templating uses), ``reset(**row)``, tool calls by name with the model's arguments, ``get_reward()``."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

pytest.importorskip("trl")
from transformers.utils import get_json_schema  # noqa: E402

from envs.frameworks.trl import LookupEnvironment, SWEEnvironment  # noqa: E402
from envs.task import Task  # noqa: E402

from .conftest import GOLD_PATH  # noqa: E402

pytestmark = pytest.mark.integration


def tools_as_trl_finds_them(env: Any) -> dict[str, Any]:
    """What ``GRPOTrainer`` exposes as tools: the class's public functions but ``reset`` and ``get_reward``."""
    return {name: getattr(env, name) for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")}


def rollout(factory: Any, row: dict[str, Any], calls: list[tuple[str, dict[str, Any]]]) -> tuple[str, list[str], float]:
    """One rollout as TRL runs it: reset with the row, each tool call by name, then the reward."""
    env = factory()
    try:
        tools = tools_as_trl_finds_them(env)
        first = env.reset(**row)
        outputs = [tools[name](**arguments) for name, arguments in calls]
        return first, outputs, env.get_reward()
    finally:
        env._close()


def test_the_tools_trl_finds_and_their_schemas() -> None:
    swe, lookup = (SWEEnvironment.__new__(SWEEnvironment), LookupEnvironment.__new__(LookupEnvironment))
    assert sorted(tools_as_trl_finds_them(swe)) == ["bash", "create", "str_replace", "submit", "view"]
    assert sorted(tools_as_trl_finds_them(lookup)) == ["answer", "bash"]
    schema = get_json_schema(SWEEnvironment.bash)["function"]
    assert schema["name"] == "bash" and schema["parameters"]["required"] == ["command"]
    assert get_json_schema(LookupEnvironment.answer)["function"]["parameters"]["required"] == ["answer"]


def test_swe_v0_rollouts_gold_patch_1_unsubmitted_no_op_0(swe_task: Task) -> None:
    row = {"prompt": [{"role": "user", "content": "Fix the issue."}], "task": swe_task.instance_id}
    first, outs, reward = rollout(SWEEnvironment, row, [
        ("create", {"path": GOLD_PATH, "file_text": swe_task.patch}),
        ("bash", {"command": f"git apply {GOLD_PATH} && rm {GOLD_PATH} && echo applied"}), ("submit", {})])
    assert swe_task.problem_statement.strip() in first and "applied" in outs[1] and reward == 1.0
    _, outs, reward = rollout(SWEEnvironment, row, [("bash", {"command": "git status --short | wc -l"})])
    assert outs[0].strip() == "0" and reward == 0.0  # never submitted: graded as it stands (unchanged)


def test_lookup_v0_rollouts_right_code_1_wrong_0_none_0(lookup_task: Any) -> None:
    row = {"prompt": [{"role": "user", "content": ""}], "task": lookup_task.id}
    read = ("bash", {"command": f"cat {lookup_task.key}"})
    first, outs, reward = rollout(LookupEnvironment, row, [read, ("answer", {"answer": lookup_task.answer})])
    assert first == lookup_task.question and outs[0].strip() == lookup_task.answer and reward == 1.0
    wrong = next(w for w in ("python", "project") if w != lookup_task.answer)
    assert rollout(LookupEnvironment, row, [read, ("answer", {"answer": wrong})])[2] == 0.0
    assert rollout(LookupEnvironment, row, [read])[2] == 0.0  # no answer




def test_an_instance_is_reused_across_rollouts_and_a_stray_column_is_refused(lookup_task: Any) -> None:
    env = LookupEnvironment()
    try:
        for answer, reward in ((lookup_task.answer, 1.0), ("nothing", 0.0)):
            env.reset(task=lookup_task.id, prompt=[])
            env.answer(answer)
            assert env.get_reward() == reward
        with pytest.raises(TypeError, match=r"unknown columns: \['solution'\]"):
            env.reset(task=lookup_task.id, solution="x")
    finally:
        env._close()
