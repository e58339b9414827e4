"""ToolEnv without a sandbox: the calculator, answer checking, the shipped tasks, calculator-only episodes."""

from __future__ import annotations

import pytest

from envs.task import TaskError
from envs.tool_env import ToolEnv, ToolTask, load_tool_tasks
from envs.tools import ActionError, calculate


@pytest.mark.parametrize(("expr", "want"), [("2 + 3 * 4", 14), ("2^10", 1024), ("sqrt(16) + factorial(5)", 124.0),
                                            ("-(7 // 2) % 5", 2), ("pi * 2", 6.283185307179586)])
def test_calculator(expr, want):
    assert calculate(expr) == pytest.approx(want)


@pytest.mark.parametrize(("expr", "words"), [("__import__('os')", "unsupported"), ("9 ** 9 ** 9", "too large"),
                                             ("1 / 0", "ZeroDivisionError"), ("2 +", "not an expression"),
                                             ("factorial(10**6)", "too large"), ("'a' * 3", "unsupported")])
def test_calculator_refuses_the_rest(expr, words):
    with pytest.raises(ActionError, match=words):
        calculate(expr)


def test_answers_match_exactly_or_within_tolerance():
    num = ToolTask("t", "q", "434", match="numeric", tolerance=0.01)
    assert num.score("434.0") == num.score(" 434.005 ") == num.score("434.") == 1.0
    assert num.score("435") == num.score("about 434") == 0.0
    assert ToolTask("t", "q", "1,229", match="numeric", tolerance=0).score("1229") == 1.0
    ex = ToolTask("t", "q", "Kestrel")
    assert ex.score("kestrel.") == ex.score("  'Kestrel' ") == 1.0 and ex.score("Heron") == 0.0


def test_tool_task_validation_names_the_field():
    with pytest.raises(TaskError) as e:
        ToolTask.from_json({"id": "x", "question": "q", "answer": "abc", "match": "numeric"})
    assert e.value.field == "answer" and e.value.task == "x"
    with pytest.raises(TaskError) as e:
        ToolTask.from_json({"id": "x", "question": "q", "answer": "1", "tolerance": -1})
    assert e.value.field == "tolerance"


def test_shipped_tool_tasks_load():
    tasks = load_tool_tasks()
    assert len(tasks) >= 25 and len({t.id for t in tasks}) == len(tasks)
    assert {t.id.split("-")[0] for t in tasks} >= {"calc", "py", "doc"}


def test_a_calculator_episode_needs_no_sandbox():
    env = ToolEnv(task="calc-001")
    obs, info = env.reset(seed=1)
    assert "37 * 1234 - 5678" in obs and info == {"task": "calc-001"}
    obs, reward, *_ = env.step({"name": "calculator", "arguments": {"expression": "37 * 1234 - 5678"}})
    assert obs == "39980" and reward == 0.0
    obs, reward, *_ = env.step({"name": "calculator", "arguments": {"expr": "1"}})
    assert "unknown argument" in obs
    obs, reward, terminated, truncated, info = env.step({"name": "answer", "arguments": {"answer": "39980"}})
    assert (reward, terminated, truncated, info["steps"]) == (1.0, True, False, 3)
    assert env.sandbox is None
    env.close()


def test_the_step_limit_truncates():
    env = ToolEnv(task="calc-002", max_steps=2)
    env.reset()
    assert env.step("hello")[3] is False
    _, reward, terminated, truncated, _ = env.step("hello again")
    assert (reward, terminated, truncated) == (0.0, False, True)
