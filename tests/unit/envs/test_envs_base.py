"""SandboxEnv's lifecycle on a fake backend: check_env for the three envs, guards, the step limit with and
without TimeLimit, snapshot / fork / restore, render, and that everything an env starts is closed."""

from __future__ import annotations

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env
from gymnasium.wrappers import TimeLimit

import envs
from envs import ShellEnv, SWEEnv, ToolEnv
from envs.base import ENV_TTL
from envs.task import Task

from .fakes import HEAD, FakeBackend

TASK = Task(instance_id="fake__repo-1", repo="fake/repo", base_commit=HEAD[:12], patch="", test_patch="",
            problem_statement="Make it work.", FAIL_TO_PASS=("tests/test_a.py::test_a",), PASS_TO_PASS=(),
            image="agentenv/swe-fake:1", test_command="pytest -rA {tests}")
CALC = {"name": "calculator", "arguments": {"expression": "1 + 1"}}


@pytest.fixture
def backend():
    b = FakeBackend()
    yield b
    assert b.sandboxes == {}, "an env left a sandbox open"


@pytest.mark.parametrize("make", [lambda api: ShellEnv(api=api, max_steps=3), lambda api: ToolEnv(api=api),
                                  lambda api: SWEEnv(task=TASK, api=api, max_steps=5)])
def test_check_env_passes_for_all_three(backend, make):
    env = make(backend)
    try:
        check_env(env, skip_render_check=True)
    finally:
        env.close()


def test_guards(backend):
    env = ToolEnv(task="calc-001", api=backend)
    with pytest.raises(RuntimeError, match=r"call reset\(\) before step\(\)"):
        env.step(CALC)
    env.reset()
    _, reward, terminated, _, info = env.step({"name": "answer", "arguments": {"answer": "39980"}})
    assert (reward, terminated, info["correct"]) == (1.0, True, True)
    obs, reward, terminated, truncated, info = env.step(CALC)
    assert obs == "The episode is over; call reset()." and (reward, terminated, truncated) == (0.0, True, False)
    assert info == {"task": "calc-001", "error": True}
    env.close()
    with pytest.raises(RuntimeError, match="call reset"):
        env.step(CALC)


def test_a_directly_made_env_keeps_the_registered_limit_unless_told(backend):
    with ToolEnv(task="calc-001", api=backend) as env:
        env.reset()
        assert [env.step(CALC)[3] for _ in range(10)] == [False] * 9 + [True]
    with ToolEnv(task="calc-001", api=backend, max_steps=None) as env:
        env.reset()
        assert all(env.step(CALC)[3] is False for _ in range(30))


def test_make_wraps_in_time_limit_and_the_env_knows_the_limit(backend):
    for env_id, (_, steps) in envs.REGISTERED.items():
        assert gymnasium.spec(env_id).max_episode_steps == gymnasium.spec(env_id).kwargs["max_steps"] == steps
    env = gymnasium.make("agentenv/Tool-v0", task="calc-001", api=backend)
    assert isinstance(env, TimeLimit) and env.spec is not None and env.spec.max_episode_steps == 10
    assert env.unwrapped.max_steps == 10  # type: ignore[attr-defined]
    env.reset()
    flags = [env.step(CALC)[2:4] for _ in range(10)]
    assert flags == [(False, False)] * 9 + [(False, True)]
    env.close()


def test_swe_grades_on_the_last_step_under_time_limit(backend):
    env = gymnasium.make("agentenv/SWE-v0", task=TASK, api=backend)
    env.reset()
    for _ in range(49):
        obs, reward, terminated, truncated, info = env.step("thinking aloud")
        assert "no tool call" in obs and not truncated and "resolved" not in info
    obs, reward, terminated, truncated, info = env.step("thinking aloud")
    assert truncated and not terminated and info["resolved"] is False and info["steps"] == 50
    assert "step limit reached; graded" in obs and obs.endswith("Graded: not resolved.")
    env.close()


def test_snapshot_fork_and_restore_carry_the_task_and_the_step(backend):
    env = ToolEnv(task="py-006", api=backend, render_mode="ansi")
    env.reset()
    env.step({"name": "python", "arguments": {"code": "print(1)"}})  # starts the sandbox
    snap = env.snapshot()
    assert snap.labels == {"agentenv.task": "py-006", "agentenv.steps": "1"}
    kids = env.fork(2)
    assert [(k.task, k.steps, k.render()) for k in kids] == [(env.task, 1, env.render())] * 2
    assert len({id(k.sandbox) for k in [env, *kids]}) == 3
    kids[0].step({"name": "python", "arguments": {"code": "print(2)"}})
    assert kids[0].sandbox.files["/tmp/main.py"] == "print(2)" and env.sandbox.files["/tmp/main.py"] == "print(1)"
    assert kids[1].steps == 1 and kids[0].step({"name": "answer", "arguments": {"answer": "x"}})[2]
    fresh = ToolEnv(api=backend, render_mode="ansi")
    obs, info = fresh.reset(options={"snapshot": snap.id})
    assert fresh.task is not None and fresh.task.id == "py-006" and fresh.steps == 1 and info == {"task": "py-006"}
    assert obs == fresh.render() == f"Restored snapshot {snap.id} of task py-006 at step 1."
    assert fresh.sandbox.labels == {"agentenv.task": "py-006"}
    for e in (env, *kids, fresh):
        e.close()


def test_shell_env_on_a_fake_backend(backend):
    env = ShellEnv(api=backend, max_steps=2, render_mode="ansi")
    obs, info = env.reset(seed=0)
    assert obs == "" and info == {"sandbox_id": env.sandbox.id}
    obs, reward, terminated, truncated, info = env.step("printf 'hello\\n\\377'; exit 3")
    assert obs == env.render() == "hello\n?" and info == {"exit_code": 3, "timed_out": False}
    assert env.observation_space.contains(obs) and (reward, terminated, truncated) == (0.0, False, False)
    obs, _, _, truncated, info = env.step("sleep 10")
    assert info["timed_out"] and "timed out after 30 s" in obs and truncated
    assert env.step("true")[0] == "The episode is over; call reset()."
    with pytest.raises(TypeError, match="shell command"):
        env.reset()
        env.step(42)
    snap = env.sandbox.snapshot()  # no labels: the env's image
    _, info = env.reset(options={"snapshot": snap})
    assert info == {"sandbox_id": env.sandbox.id} and env.steps == 0
    env.close()


def test_observations_are_cut_to_the_space(backend):
    with ShellEnv(api=backend) as env:
        env.reset()
        obs = env.step("yes")[0]
        assert 8000 < len(obs) <= env.observation_space.max_length and "characters truncated" in obs


@pytest.mark.parametrize("make", [lambda api, **kw: ShellEnv(api=api, **kw), lambda api, **kw: ToolEnv(api=api, **kw),
                                  lambda api, **kw: SWEEnv(task=TASK, api=api, **kw)])
def test_an_envs_sandboxes_share_memory_where_possible_unless_it_opts_out(backend, make):
    """share_memory is fixed when a sandbox is made: the env asks for it at reset (None: where the host can,
    ``agentenv.host.ksm``), and its kwargs (``--env-arg``, ``[env] kwargs``) opt out or insist."""
    for kwargs, asked in (({}, None), ({"share_memory": False}, False), ({"share_memory": True}, True)):
        env = make(backend, **kwargs)
        env.reset()
        env.box()
        assert backend.created[-1][1]["share_memory"] is asked
        env.close()



def test_an_envs_sandboxes_its_forks_and_restores_get_its_deadline_and_each_step_moves_it_on(backend):
    """An env's sandboxes live ``ttl`` (ENV_TTL by default, not the library's short default), forks and restores
    too, and a step moves the deadline on from now once a quarter of it has gone by: the thinking between two
    steps (a slow CPU generation, a weight push) never counts against it. ttl=None: none, only when asked."""
    with ToolEnv(task="calc-001", api=backend) as env:
        env.reset()
        env.box()
        assert backend.created[-1][1]["ttl"] == ENV_TTL
        snap = env.snapshot()
        kids = env.fork(2)
        env.restore(snap)
        assert [k.sandbox.ttl for k in kids] + [env.sandbox.ttl] == [ENV_TTL] * 3
        for k in kids:
            k.close()
    with ToolEnv(task="calc-001", api=backend, ttl=1e-9) as env:  # a quarter of it is gone by the first step
        env.reset()
        env.box()
        env.step(CALC)
        env.step(CALC)
        assert env.sandbox.ttl_moves == [1e-9, 1e-9]
    with ToolEnv(task="calc-001", api=backend, ttl=None) as env:
        env.reset()
        env.box()
        env.step(CALC)
        assert backend.created[-1][1]["ttl"] is None and env.sandbox.ttl_moves == []
