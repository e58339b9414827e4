"""The env side of grading on a fake backend: the pristine snapshot's life (taken at reset, shared with forks,
deleted by the last holder), restoring a snapshot of a task from a file in a fresh env (issue 9 §2), and
Tool-v0's answers scored on the host from the env's task, whatever happens in its sandbox."""

from __future__ import annotations

import json

import pytest

from envs import SWEEnv, ToolEnv
from envs.swe_env import PRISTINE_LABEL, TASK_FILE_LABEL
from envs.task import Task, TaskError

from .fakes import HEAD, FakeBackend

RECORD = {"instance_id": "mine__repo-7", "repo": "mine/repo", "base_commit": HEAD[:12], "patch": "--- a/x\n+++ b/x\n",
          "problem_statement": "Fix it.", "FAIL_TO_PASS": ["tests/test_a.py::test_a"], "image": "agentenv/swe-mine:1",
          "test_command": "python3 -m pytest -rA {tests}"}
BASH = {"name": "bash", "arguments": {"command": "echo hi"}}


@pytest.fixture
def backend():
    b = FakeBackend()
    yield b
    assert b.sandboxes == {}, "an env left a sandbox open"
    assert b.snapshots == {}, "an env left a snapshot behind"


@pytest.fixture
def task_file(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps(RECORD) + "\n" + json.dumps({**RECORD, "instance_id": "mine__repo-8"}) + "\n")
    return path


def pristine_snapshots(backend, *envs):
    for env in envs:  # the snapshot is taken while reset returns: reading env.sandbox waits for it
        assert env.sandbox is not None
    return [s for s in backend.snapshots.values() if s.labels.get(PRISTINE_LABEL)]


def test_the_pristine_state_is_taken_at_reset_shared_by_forks_and_deleted_by_the_last(backend):
    env = SWEEnv(task=Task.from_json(RECORD), api=backend)
    env.reset()
    (snap,) = pristine_snapshots(backend, env)
    assert snap.labels["agentenv.task"] == "mine__repo-7"
    env.step(BASH)
    env.reset()  # the same task again: restored from its pristine state, not set up again
    assert pristine_snapshots(backend, env) == [snap] and env.sandbox.image == "restored"
    kids = env.fork(2)
    env.close()
    assert pristine_snapshots(backend) == [snap]  # the forks still hold it
    _, reward, terminated, _, info = kids[0].step({"name": "submit", "arguments": {}})
    assert terminated and reward == 0.0 and info["grading"]["dropped"] == [] and "grade_error" in info
    kids[0].close()
    assert pristine_snapshots(backend) == [snap]
    kids[1].close()
    assert pristine_snapshots(backend) == []


def test_an_env_that_moves_to_another_task_lets_the_old_pristine_state_go(backend, task_file):
    env = SWEEnv(tasks=task_file, api=backend)
    env.reset(options={"task": "mine__repo-7"})
    first = pristine_snapshots(backend, env)
    env.reset(options={"task": "mine__repo-8"})
    second = pristine_snapshots(backend, env)
    assert len(first) == len(second) == 1 and first != second
    env.close()


def test_a_snapshot_of_a_task_from_a_file_restores_in_a_fresh_env(backend, task_file):
    env = SWEEnv(api=backend)
    env.reset(options={"task": f"{task_file}::mine__repo-7"})
    env.step(BASH)
    snap = env.snapshot()
    assert snap.labels[TASK_FILE_LABEL] == str(task_file.resolve())
    env.reset(options={"task": f"{task_file}::mine__repo-8"})  # another task, then back by the snapshot
    env.restore(snap)
    assert env.task is not None and env.task.instance_id == "mine__repo-7" and env.steps == 1
    env.close()

    for fresh in (SWEEnv(tasks=task_file, api=backend), SWEEnv(tasks=[RECORD], api=backend),
                  SWEEnv(task=Task.from_json(RECORD), api=backend), SWEEnv(api=backend)):
        obs, info = fresh.reset(options={"snapshot": snap.id})
        assert info == {"task": "mine__repo-7", "steps": 1} and "Restored snapshot" in obs
        assert fresh.step({"name": "submit", "arguments": {}})[2]  # it grades: a pristine state is taken then
        fresh.close()
    snap.delete()


def test_a_task_the_env_cannot_find_says_how_to_pass_it(backend, task_file):
    env = SWEEnv(api=backend)
    env.reset(options={"task": f"{task_file}::mine__repo-7"})
    snap = env.snapshot()
    env.close()
    task_file.unlink()
    fresh = SWEEnv(api=backend)
    with pytest.raises(TaskError, match=r"SWEEnv\(task=.*tasks=") as e:
        fresh.reset(options={"snapshot": snap.id})
    assert "mine__repo-7" in str(e.value)
    fresh.close()
    snap.delete()
    with pytest.raises(TaskError, match="a list of tasks, a datasets.Dataset, or the path of a task file"):
        SWEEnv(tasks="no-such-file.jsonl", api=backend)


# --- Tool-v0: the answer is checked on the host ------------------------------------------------------

def test_tool_answers_are_scored_on_the_host_whatever_the_sandbox_says(backend):
    env = ToolEnv(task="py-006", api=backend)
    env.reset()
    expected = env.task.answer  # type: ignore[union-attr]
    obs, *_ = env.step({"name": "python", "arguments": {"code": f"print('correct! Answer recorded: {expected}')"}})
    env.sandbox.write_file("/tmp/answer.txt", expected)  # anything the agent leaves in its sandbox
    env.sandbox.files["/docs/tasks.jsonl"] = json.dumps({"id": "py-006", "answer": "anything"})
    _, reward, terminated, _, info = env.step({"name": "answer", "arguments": {"answer": "not it"}})
    assert (reward, terminated, info["correct"]) == (0.0, True, False)
    env.reset(options={"task": "py-006"})
    env.step({"name": "python", "arguments": {"code": "import os; os.kill(1, 9)"}})
    env.sandbox.close()  # the sandbox is gone (killed, crashed): the answer does not need it
    _, reward, *_ = env.step({"name": "answer", "arguments": {"answer": expected}})
    assert reward == 1.0
    env.close()
