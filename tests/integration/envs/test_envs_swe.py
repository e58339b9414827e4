"""SWEEnv and ToolEnv on real sandboxes: check_env, grading of shipped tasks, bad actions, branching."""

from __future__ import annotations

import json
import time

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

import envs  # noqa: F401  (registers the gym ids)
from envs.images import build_image
from envs.swe_env import SWEEnv
from envs.task import shipped_tasks
from envs.tasks import build
from envs.tasks.libraries import load_libraries
from envs.tasks.validate import validate
from envs.tool_env import ToolEnv

pytestmark = pytest.mark.integration
SAMPLE_BUDGET_S = 240  # CI validates a time-boxed sample; `agentenv tasks validate --all` does all


@pytest.fixture(scope="module")
def tasks():
    ts = shipped_tasks()
    for lib in load_libraries():  # cached by input hash: seconds when nothing changed
        build_image(lib.recipe)
    return ts


@pytest.fixture(scope="module")
def task(tasks):
    return next(t for t in tasks if t.metadata["library"] == "toolz")


def k3(name: str, **args) -> str:
    return (f'<|open|>tools<|sep|><|open|>call tool="{name}" index="0"<|sep|><|open|>json type="object"<|sep|>'
            + json.dumps(args) + "<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>")


def apply_gold(env: SWEEnv) -> str:
    assert env.task is not None
    obs, *_ = env.step({"name": "create", "arguments": {"path": "/testbed/.fix.patch", "file_text": env.task.patch}})
    obs, *_ = env.step(k3("bash", command="git apply .fix.patch && rm .fix.patch && echo applied"))
    return obs


def test_check_env_passes_for_both(task):
    env = gymnasium.make("agentenv/SWE-v0", task=task.instance_id, max_steps=5)
    try:
        check_env(env.unwrapped, skip_render_check=True)
    finally:
        env.close()
    tool = gymnasium.make("agentenv/Tool-v0")
    try:
        check_env(tool.unwrapped, skip_render_check=True)
    finally:
        tool.close()


def test_a_sample_of_shipped_tasks_validates(tasks):
    chosen = build.sample(tasks, 6, seed=int(time.time()) % 1000)  # one per library, a different one each run
    verdicts = validate(chosen, budget=SAMPLE_BUDGET_S)
    assert verdicts, "no task validated within the budget"
    bad = [f"{v.instance_id}: {v.detail}" for v in verdicts if not v.ok]
    assert not bad, bad


def test_reset_gives_the_base_commit_and_hides_the_fix(task):
    with SWEEnv(task=task) as env:
        obs, info = env.reset()
        assert info == {"task": task.instance_id, "steps": 0}
        assert task.problem_statement.strip() in obs and "str_replace" in obs
        obs, *_ = env.step(k3("bash", command="git rev-parse HEAD; git log --oneline | wc -l; git status --short"))
        head, commits, *rest = obs.split("\n")
        assert head == task.base_commit and commits == "1" and not [r for r in rest if r.strip()]


def test_gold_fix_through_tools_resolves_and_no_fix_does_not(task):
    with SWEEnv(task=task) as env:
        env.reset()
        assert "applied" in apply_gold(env)
        obs, reward, terminated, truncated, info = env.step(k3("submit"))
        assert (reward, terminated, truncated, info["resolved"]) == (1.0, True, False, True)
        assert set(info["FAIL_TO_PASS"].values()) == {"PASSED"} and set(info["PASS_TO_PASS"].values()) <= {"PASSED"}
        assert info["patch"].startswith("diff --git") and "Graded: resolved" in obs
        assert info["grading"]["dropped"] == [] and info["grading"]["tampering"] is False
        assert info["grading"]["canary"] == "FAILED"  # the grader's own test that must fail did
        assert env.step(k3("bash", command="true"))[2] is True  # the episode is over
        env.reset()
        obs, reward, terminated, _, info = env.step({"name": "submit", "arguments": {}})
        assert reward == 0.0 and terminated and not info["resolved"] and info["patch"] == ""
        assert any(s != "PASSED" for s in info["FAIL_TO_PASS"].values())


def test_bad_actions_never_crash_and_each_step_counts(task):
    with SWEEnv(task=task, max_steps=50, bash_timeout=2.0) as env:
        env.reset()
        target = task.FAIL_TO_PASS[0].split("::")[0]
        bad = [
            ("unknown tool", k3("rm_everything", path="/"), "unknown tool"),
            ("malformed JSON", k3("bash").replace("{}", "{command: ls"), "not valid JSON"),
            ("missing argument", {"name": "view", "arguments": {}}, "missing required"),
            ("wrong type", {"name": "bash", "arguments": {"command": 5}}, "must be a string"),
            ("outside testbed", k3("view", path="/etc/passwd"), "outside /testbed"),
            ("escape by ..", k3("create", path="../root/x", file_text="x"), "outside /testbed"),
            ("non-unique old", k3("str_replace", path=target, old_str="def ", new_str="def  "), "occurs"),
            ("missing old", k3("str_replace", path=target, old_str="no such text 123", new_str=""), "not found"),
            ("hanging command", k3("bash", command="sleep 600"), "timed out after 2 s"),
            ("prose", "I think the bug is in line 3.", "no tool call"),
        ]
        for n, (label, action, words) in enumerate(bad, 1):
            obs, reward, terminated, truncated, info = env.step(action)
            assert words in obs, (label, obs)
            assert info["steps"] == n and reward == 0.0 and not terminated and not truncated, label
        assert env.step(k3("bash", command="echo still alive"))[0].startswith("still alive")


def test_long_output_is_truncated_with_a_marker(task):
    with SWEEnv(task=task, max_output=3000) as env:
        env.reset()
        obs, *_ = env.step(k3("bash", command="seq 1 100000"))
        assert len(obs) <= 3000 and "characters truncated" in obs and obs.startswith("1\n2\n")


def test_step_limit_grades_and_truncates(task):
    with SWEEnv(task=task, max_steps=2) as env:
        env.reset()
        env.step(k3("bash", command="true"))
        obs, reward, terminated, truncated, info = env.step(k3("bash", command="true"))
        assert truncated and not terminated and info["resolved"] is False and "step limit" in obs


def test_snapshot_fork_and_restore_branch_an_episode(task):
    env = SWEEnv(task=task)
    kids: list[SWEEnv] = []
    try:
        env.reset()
        env.step(k3("create", path="notes.txt", file_text="branch point\n"))
        snap = env.snapshot()
        kids = env.fork(2)
        assert [k.steps for k in kids] == [1, 1]
        apply_gold(kids[0])
        assert kids[0].step(k3("submit"))[1] == 1.0
        assert kids[1].step(k3("submit"))[1] == 0.0
        env.step(k3("bash", command="rm notes.txt"))
        env.restore(snap)
        assert env.steps == 1
        assert env.step(k3("bash", command="cat notes.txt"))[0] == "branch point\n"
        snap.delete()
    finally:
        for k in kids:
            k.close()
        env.close()


def test_a_snapshot_of_a_task_from_a_file_restores_and_grades_in_a_fresh_env(task, tmp_path):
    """Issue 9 §2: the env's own task source, not only the shipped tasks; the restored env, which never saw the
    task's pristine state, takes it at its first grade."""
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({**task.to_json(), "instance_id": "mine__toolz-1"}) + "\n")
    with SWEEnv() as env:
        env.reset(options={"task": f"{path}::mine__toolz-1"})
        env.step(k3("create", path="notes.txt", file_text="branch point\n"))
        snap = env.snapshot()
    try:
        with SWEEnv() as fresh:
            fresh.reset(options={"snapshot": snap.id})
            assert fresh.task is not None and fresh.task.instance_id == "mine__toolz-1" and fresh.steps == 1
            assert fresh.step(k3("bash", command="cat notes.txt"))[0] == "branch point\n"
            apply_gold(fresh)
            assert fresh.step(k3("submit"))[1] == 1.0
    finally:
        snap.delete()


def test_tool_env_scores_the_answer_on_the_host_whatever_the_sandbox_does():
    chaos = ("import os, signal\nopen('/docs/answer.txt', 'w').write('7311')\nprint('correct! Answer recorded: 7311')\n"
             "for pid in os.listdir('/proc'):\n    if pid.isdigit() and int(pid) != os.getpid():\n"
             "        try:\n            os.kill(int(pid), signal.SIGKILL)\n        except OSError:\n            pass\n")
    with ToolEnv(timeout=5.0) as env:
        env.reset(options={"task": "doc-001"})
        obs, *_ = env.step(k3("python", code=chaos))
        _, reward, terminated, _, info = env.step(k3("answer", answer="7312"))
        assert (reward, terminated, info["correct"]) == (0.0, True, False)
        env.reset(options={"task": "doc-001"})
        env.step(k3("python", code=chaos))
        assert env.step(k3("answer", answer="7311"))[1] == 1.0


def test_tool_env_rewards_right_answers_and_survives_bad_calls():
    with ToolEnv(timeout=2.0) as env:
        env.reset(options={"task": "doc-001"})
        obs, *_ = env.step(k3("search", query="default port"))
        assert "7311" in obs
        obs, *_ = env.step(k3("python", code="while True: pass"))
        assert "timed out" in obs
        obs, *_ = env.step(k3("calculator", expression="__import__('os')"))
        assert "calculator" in obs and "Error" in obs
        obs, reward, terminated, _, info = env.step(k3("answer", answer="7311"))
        assert reward == 1.0 and terminated and info["correct"]
        env.reset(options={"task": "py-006"})
        obs, *_ = env.step(k3("python", code="print(''.join(sorted('reinforcement')))"))
        assert env.step(k3("answer", answer=obs.strip()))[1] == 1.0
        env.reset(options={"task": "calc-001"})
        assert env.step(k3("answer", answer="12"))[1] == 0.0
