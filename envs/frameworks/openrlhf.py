"""agentenv's envs as OpenRLHF agents (OpenRLHF 0.11.2, ``openrlhf.utils.agent``): ``SWEAgentExecutor`` runs
``agentenv/SWE-v0`` episodes, ``LookupAgentExecutor`` ``agentenv/Lookup-v0`` ones.

OpenRLHF loads ``--train.agent_func_path FILE.py`` and makes its ``AgentExecutor`` class (no arguments); a
``MultiTurnAgentExecutor`` makes one ``AgentInstanceBase`` per prompt and calls ``reset(states)`` once, then
``step(states)`` after each generation until ``done``. The agent file is one line::

    from envs.frameworks.openrlhf import SWEAgentExecutor as AgentExecutor

Each instance owns ONE agentenv env (one sandbox) for its prompt. ``reset`` takes the task from the row's label
(OpenRLHF's ``--data.label_key`` column: a task id, or empty to draw one), resets the env, and returns as the
observation the prompt as given followed by the env's first observation as a K3 user message with the env's tool
declarations and the assistant header (the envs read K3 tool-call text, so the policy must speak K3's format;
give prompts already rendered, without ``--data.apply_chat_template``, or empty). ``step`` passes the generated text
(without a trailing ``<|im_end|>``) to the env as its action; its ``environment_feedback`` is the tool output as a
K3 tool message and the next assistant header (OpenRLHF masks feedback tokens out of the loss: only
``action_ranges`` train). ``rewards``/``scores`` are 0 until the episode ends, then our grader's reward (SWE-v0:
1.0 resolved; Lookup-v0: 1.0 the right code), so OpenRLHF's sum is the grade. The sandbox is closed when the
episode ends, or when the instance is collected (an episode OpenRLHF cuts at ``max_length`` never ends: its
reward is 0, even for SWE-v0's patch as it stands, because OpenRLHF never asks again).
"""

from __future__ import annotations

import weakref
from typing import Any, ClassVar

import gymnasium
import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

import envs  # noqa: F401  (registers the Gymnasium ids)
from policy import chat


class _AgentenvInstance(AgentInstanceBase):
    """One agentenv episode (one sandbox) for one prompt; subclasses name the Gymnasium id."""

    env_id: ClassVar[str]
    env_kwargs: ClassVar[dict[str, Any]] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if args or kwargs:
            raise TypeError(f"{type(self).__name__} takes no arguments (set env_kwargs on a subclass)")
        self.env: Any = gymnasium.make(self.env_id, **self.env_kwargs)
        self._finalizer = weakref.finalize(self, self.env.close)
        self.done = False

    async def reset(self, states: dict, **kwargs: Any) -> dict:
        label = states.get("label")
        obs, _ = self.env.reset(options={"task": label} if label else None)
        user = chat.render_chat([{"role": "user", "content": obs}], tools=self.env.unwrapped.toolbox.specs)
        return {**states, "observation": (states.get("observation") or "") + user}

    async def step(self, states: dict, **kwargs: Any) -> dict:
        if self.done:
            raise RuntimeError(f"{self.env_id}: step after the episode ended")
        text = states["action_text"]
        action = text.removesuffix(chat.IM_END)
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.done = bool(terminated or truncated)
        end = "" if text.endswith(chat.IM_END) else chat.IM_END
        if self.done:
            self._finalizer()  # the episode is graded: the sandbox goes now
            feedback = end
        else:
            calls = chat.parse_assistant(action).tool_calls
            feedback = end + chat.render_chat([{"role": "tool", "tool_call_id": calls[0]["id"] if calls else "",
                                                "content": obs}])
        r = torch.tensor(float(reward) if self.done else 0.0)
        return {"rewards": r, "scores": r, "environment_feedback": feedback, "done": self.done,
                "sampling_params": states.get("sampling_params"),
                "extra_logs": {"truncated": float(bool(truncated))}}


class SWEAgentInstance(_AgentenvInstance):
    """``agentenv/SWE-v0``: fix a repository in /testbed; graded like SWE-bench (1.0: resolved)."""

    env_id = "agentenv/SWE-v0"


class LookupAgentInstance(_AgentenvInstance):
    """``agentenv/Lookup-v0``: find a code in the files of /data, then answer it (1.0: the right code)."""

    env_id = "agentenv/Lookup-v0"


class SWEAgentExecutor(MultiTurnAgentExecutor):
    """OpenRLHF's ``AgentExecutor`` for SWE-v0 (one ``SWEAgentInstance`` per prompt)."""

    def __init__(self) -> None:
        super().__init__(SWEAgentInstance)


class LookupAgentExecutor(MultiTurnAgentExecutor):
    """OpenRLHF's ``AgentExecutor`` for Lookup-v0 (one ``LookupAgentInstance`` per prompt)."""

    def __init__(self) -> None:
        super().__init__(LookupAgentInstance)
