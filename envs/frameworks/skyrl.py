"""agentenv's envs as SkyRL environments (``skyrl_gym``): ``BaseTextEnv`` subclasses, registered with
``skyrl_gym.register`` and made with ``skyrl_gym.make``.

    import envs.frameworks.skyrl   # registers agentenv/SWE-v0, agentenv/Tool-v0 and agentenv/Lookup-v0
    env = skyrl_gym.make("agentenv/Lookup-v0", env_config={}, extras={"task": "lookup-1-1000001"})
    chat, meta = env.init([])                  # the task's first observation as a user message
    out = env.step(llm_text)                   # {"observations", "reward", "done", "metadata"}

SkyRL makes an env per trajectory with ``skyrl_gym.make(env_class, env_config=..., extras=row)``: ``extras`` is
the dataset row. Its ``task`` is the agentenv task of the episode (an id, a record, or for SWE-v0 a ``Task``);
without one the env draws a task as ``gymnasium.make(id).reset()`` does. ``env_config`` holds the agentenv env's
constructor arguments (``max_steps``, ``levels``, ``api``, sandbox settings...), passed to ``gymnasium.make``.
Nothing else is read from ``extras`` (SkyRL's own fields are its business: the reward is our grader's, so a
``reward_spec`` with a ``ground_truth``, which would not be used, is refused), and a row without ``task`` is a
draw, said in ``metadata["task"]``.

``init(prompt)`` resets the env (a fresh sandbox) and returns ``prompt`` (SkyRL's system messages, say) followed
by a user message holding the env's first observation: the question or issue lives in the env, which made the
sandbox for it. ``step(action)`` passes the LLM's text as the env's action (K3 tool-call text, or JSON of one
call); ``observations`` is the tool output as a user message, empty once ``done``. ``reward`` is what the env
gives: for SWE-v0 the grade of the patch (1.0 resolved, else 0.0) at ``submit`` or the last step; for Lookup-v0
1.0 for the right code. ``metadata`` is the env's ``info``. ``max_turns`` is the env's step limit. ``close()``
closes the sandbox.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import gymnasium
import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput, ConversationType

import envs  # noqa: F401  (registers the Gymnasium ids)

ENV_IDS = ("agentenv/SWE-v0", "agentenv/Tool-v0", "agentenv/Lookup-v0")


class AgentenvTextEnv(BaseTextEnv):
    """One agentenv episode as a SkyRL text env (``env_id``: the Gymnasium id of the agentenv env it runs)."""

    def __init__(self, env_config: Mapping[str, Any] | None = None, extras: Mapping[str, Any] | None = None, *,
                 env_id: str) -> None:
        super().__init__()
        if env_id not in ENV_IDS:
            raise ValueError(f"env_id is one of {ENV_IDS}, got {env_id!r}")
        self.env_id = env_id
        kwargs = dict(env_config or {})
        self.env = gymnasium.make(env_id, **kwargs)
        spec = (extras or {}).get("reward_spec")
        if isinstance(spec, Mapping) and spec.get("ground_truth") is not None:
            raise ValueError(f"{env_id} is graded by agentenv's grader, which never reads a row's reward_spec: a "
                             "ground_truth there would be ignored; drop it from the dataset (or give it no ground_truth)")
        self.task = (extras or {}).get("task")
        limit = getattr(self.env.unwrapped, "max_steps", None)
        self.max_turns = int(limit) if limit is not None else 0  # 0: the env sets no step limit
        self.done = False

    def init(self, prompt: ConversationType | None = None) -> tuple[ConversationType, dict[str, Any]]:
        """A fresh episode: ``prompt`` then the env's first observation as a user message; the env's reset info."""
        options = {"task": self.task} if self.task is not None else None
        obs, info = self.env.reset(options=options)
        self.turns, self.done = 0, False
        return [*(prompt or []), {"role": "user", "content": obs}], dict(info)

    def step(self, action: str) -> BaseTextEnvStepOutput:
        """One LLM turn as the env's action: its output, the env's reward, whether the episode ended."""
        if not isinstance(action, str):
            raise TypeError(f"a SkyRL action is the LLM's text (str), got {type(action).__name__}")
        self.turns += 1
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.done = bool(terminated or truncated)
        observations: ConversationType = [] if self.done else [{"role": "user", "content": obs}]
        return BaseTextEnvStepOutput(observations=observations, reward=float(reward), done=self.done,
                                     metadata={**info, "observation": obs, "truncated": bool(truncated)},
                                     postprocessed_action=None)

    def get_metrics(self) -> dict[str, Any]:
        return {"turns": self.turns, "done": self.done}

    def close(self) -> None:
        self.env.close()


def register() -> None:
    """Register each agentenv env with ``skyrl_gym`` under its Gymnasium id (done at import; again: nothing)."""
    for env_id in ENV_IDS:
        if env_id not in skyrl_gym.registry:
            skyrl_gym.register(id=env_id, entry_point=f"{__name__}:AgentenvTextEnv", kwargs={"env_id": env_id})


register()
