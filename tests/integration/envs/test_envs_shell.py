"""ShellEnv: the Gymnasium contract over a real sandbox."""

from __future__ import annotations

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

import agentenv
import envs

pytestmark = pytest.mark.integration


def test_shell_env_passes_gymnasium_check_env():
    env = gymnasium.make("agentenv/Shell-v0", max_steps=3)
    try:
        check_env(env.unwrapped, skip_render_check=True)
    finally:
        env.close()
    assert agentenv.Sandbox.list() == []


def test_shell_env_episode():
    env = envs.ShellEnv(max_steps=2, timeout=2)
    try:
        obs, info = env.reset(seed=0)
        assert obs == "" and info["sandbox_id"]
        obs, reward, terminated, truncated, info = env.step("echo hello; printf '\\377'; exit 3")
        assert obs == "hello\n?" and info == {"exit_code": 3, "timed_out": False}
        assert env.observation_space.contains(obs) and reward == 0.0 and not terminated and not truncated
        obs, _, _, truncated, info = env.step("sleep 10")
        assert info["timed_out"] and "timed out" in obs and truncated  # max_steps reached
        snap = env.sandbox.snapshot()
        obs, info = env.reset(options={"snapshot": snap.id})
        assert env.sandbox.id == info["sandbox_id"]
        snap.delete()
    finally:
        env.close()
    assert agentenv.Sandbox.list() == []
