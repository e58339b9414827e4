"""SkyRL (``skyrl_gym``): SWE-v0 and Lookup-v0 episodes through ``skyrl_gym.make`` / ``init`` / ``step`` on real
sandboxes, rewarded by our grader: the gold patch 1, a bare submit 0; the right code 1, a wrong one 0."""

from __future__ import annotations

import pytest

skyrl_gym = pytest.importorskip("skyrl_gym")

import envs.frameworks.skyrl  # noqa: E402,F401  (registers the agentenv envs with skyrl_gym)
from envs.task import Task  # noqa: E402

from .conftest import call, gold_actions  # noqa: E402

pytestmark = pytest.mark.integration


def episode(env_id: str, task: object, actions: list[str]) -> tuple[list[dict], list[dict]]:
    """Run ``actions`` through SkyRL's interface; the first chat and every step's output."""
    env = skyrl_gym.make(env_id, env_config={}, extras={"task": task})
    try:
        chat, _ = env.init([{"role": "system", "content": "You are an agent."}])
        outs = [env.step(a) for a in actions]
    finally:
        env.close()
    assert isinstance(env, skyrl_gym.Env) and env.spec.id == env_id
    assert [o["done"] for o in outs] == [False] * (len(actions) - 1) + [True]
    return chat, outs


def test_swe_v0_through_skyrl_gym_gold_patch_1_bare_submit_0(swe_task: Task) -> None:
    chat, outs = episode("agentenv/SWE-v0", swe_task, gold_actions(swe_task))
    assert chat[0]["role"] == "system" and swe_task.problem_statement.strip() in chat[1]["content"]
    assert "applied" in outs[1]["observations"][0]["content"]
    assert outs[-1]["reward"] == 1.0 and outs[-1]["observations"] == []
    assert outs[-1]["metadata"]["resolved"] is True
    _, outs = episode("agentenv/SWE-v0", swe_task, [call("submit")])
    assert outs[-1]["reward"] == 0.0 and outs[-1]["metadata"]["resolved"] is False


def test_lookup_v0_through_skyrl_gym_right_code_1_wrong_0(lookup_task) -> None:
    read = call("bash", command=f"cat {lookup_task.key}")
    chat, outs = episode("agentenv/Lookup-v0", lookup_task.id, [read, call("answer", answer=lookup_task.answer)])
    assert chat[1]["content"] == lookup_task.question
    assert outs[0]["observations"][0]["content"].strip() == lookup_task.answer  # read in the sandbox
    assert outs[-1]["reward"] == 1.0 and outs[-1]["metadata"]["correct"] is True
    wrong = next(w for w in ("python", "project") if w != lookup_task.answer)
    _, outs = episode("agentenv/Lookup-v0", lookup_task.id, [read, call("answer", answer=wrong)])
    assert outs[-1]["reward"] == 0.0 and outs[-1]["metadata"]["expected"] == lookup_task.answer


def test_an_unknown_env_id_and_a_non_text_action_are_refused() -> None:
    with pytest.raises(ValueError, match="env_id is one of"):
        envs.frameworks.skyrl.AgentenvTextEnv(env_id="agentenv/Shell-v0")
    with pytest.raises(ValueError, match="reward_spec"):  # a ground truth our grader would never read
        skyrl_gym.make("agentenv/Lookup-v0", env_config={},
                       extras={"task": "lookup-0-1", "reward_spec": {"method": "rule", "ground_truth": "42"}})
    env = skyrl_gym.make("agentenv/Lookup-v0", env_config={}, extras={"task": "lookup-0-1"})
    try:
        env.init([])
        with pytest.raises(TypeError, match="LLM's text"):
            env.step({"name": "answer"})  # type: ignore[arg-type]
    finally:
        env.close()
