"""The multi-turn agent loop, token-in/token-out: an env and a policy endpoint make one trajectory.

reset → render the tool declarations and the task with the K3 template → ask the policy (token ids
in) → append its token ids verbatim → hand the text to ``env.step`` (the env parses the tool calls with
``policy.chat``) → render the tool results as K3 tool messages and append only those new tokens → …
until the env ends the episode (submit, its step limit) or a limit of the loop is reached (turns,
generated tokens, context length).

No retokenisation drift: the conversation lives as token ids; earlier turns are never tokenised again.
Every piece the loop tokenises starts and ends at a special token, so ``decode(token_ids)`` is exactly
``render_chat`` of the same conversation (``conversation()`` rebuilds it; a test checks the equality).

Failures: an exception from the env is ``env_error``, one from the policy ``policy_error``; both carry
``reward=None`` (an infrastructure failure is not a task failure). Stopping on a limit of the loop is a
task failure: reward 0.0 unless the env graded the episode itself.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from policy import chat
from policy.client import PolicyClient, PolicyError
from rollout.trajectory import Trajectory, Turn

BASH_TOOL = chat.tool_spec("bash", "Run a shell command and see its output.", {"command": {"type": "string"}},
                           ["command"])


class Tokenizer(Protocol):
    """Text ↔ token ids, as the policy endpoint tokenises (``LocalTokenizer`` for k3-mini)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    @property
    def eos_id(self) -> int: ...


@dataclass(frozen=True)
class AgentConfig:
    """The loop's limits and sampling settings."""

    max_turns: int = 30
    max_new_tokens: int = 512          # per policy call
    max_total_tokens: int = 8192       # generated over the whole episode
    context_limit: int = 32768         # prompt + generated, the policy's context
    temperature: float = 1.0
    top_p: float = 1.0
    system_prompt: str | None = None
    return_routed_experts: bool = False
    policy_timeout: float = 600.0


def observation_messages(obs: str, info: dict[str, Any], text: str = "") -> list[dict[str, Any]]:
    """The K3 messages for an env's answer: one tool message per tool call it ran; for an env that ran the
    text's one call without saying so (a shell), that call's result; else a user message."""
    calls = info.get("calls") or []
    if calls:
        return [{"role": "tool", "tool_call_id": c.get("id") or f"functions.{c.get('name')}:{i}",
                 "content": str(c.get("output", ""))} for i, c in enumerate(calls)]
    parsed = chat.parse_assistant(text).tool_calls if text else []
    if parsed:
        return [{"role": "tool", "tool_call_id": parsed[0]["id"], "content": obs}]
    return [{"role": "user", "content": obs}]


def _toolbox(env: Any) -> Any | None:
    """The env's toolbox (envs whose actions are K3 tool-call text), or None (a shell env: actions are commands)."""
    try:
        return getattr(getattr(env, "unwrapped", env), "toolbox", None)
    except NotImplementedError:
        return None


def env_tools(env: Any) -> list[dict[str, Any]]:
    """The tool declarations the policy sees: the env's toolbox, or one bash tool for a shell env."""
    toolbox = _toolbox(env)
    return list(toolbox.specs) if toolbox is not None else [BASH_TOOL]


def env_action(env: Any, text: str) -> Any:
    """The action for ``env``: the policy's text itself when the env parses tool calls; for a shell env, the
    command of the text's first bash call (text without one is passed on, and fails as a command)."""
    if _toolbox(env) is not None:
        return text
    for call in chat.parse_assistant(text).tool_calls:
        if call["function"]["name"] == "bash":
            return str(json.loads(call["function"]["arguments"]).get("command", ""))
    return text


class Episode:
    """One episode's conversation as token ids plus the messages that render to them."""

    def __init__(self, tokenizer: Tokenizer, tools: list[dict[str, Any]], traj: Trajectory) -> None:
        self.tokenizer, self.tools, self.traj = tokenizer, tools, traj
        self.messages: list[dict[str, Any]] = []

    def start(self, first: list[dict[str, Any]]) -> None:
        self.messages.extend(first)
        text = chat.render_chat(self.messages, self.tools, add_generation_prompt=True)
        self.traj.append(self.tokenizer.encode(text), generated=False)
        self.traj.prompt_len = len(self.traj.token_ids)

    def add_generation(self, ids: list[int], logprobs: list[float]) -> str:
        """Append the policy's ids verbatim; close the turn with ``<|im_end|>`` if the server did not."""
        self.traj.append(ids, generated=True, logprobs=logprobs)
        body_ids = ids[:-1] if ids and ids[-1] == self.tokenizer.eos_id else ids
        text = self.tokenizer.decode(body_ids)
        if not ids or ids[-1] != self.tokenizer.eos_id:
            self.traj.append([self.tokenizer.eos_id], generated=False)
        self.messages.append({"role": "assistant", "content": text})
        return text

    def add_observation(self, messages: list[dict[str, Any]]) -> None:
        self.messages.extend(messages)
        text = chat.render_chat(messages, None, add_generation_prompt=True)
        self.traj.append(self.tokenizer.encode(text), generated=False)

    def conversation(self) -> str:
        """The K3 rendering of the conversation so far (what ``decode(token_ids)`` must equal)."""
        return chat.render_chat(self.messages, self.tools, add_generation_prompt=True)


async def run_episode(env: Any, policy: PolicyClient, tokenizer: Tokenizer, config: AgentConfig = AgentConfig(), *,
                      task_id: str = "", env_id: str = "", first_observation: str | None = None,
                      reset_options: dict[str, Any] | None = None, seed: int | None = None,
                      group_id: str = "", group_index: int = 0, keep_messages: bool = False) -> Trajectory:
    """Play one episode of ``env`` with ``policy``; the env is reset unless ``first_observation`` is given
    (a forked env continues from its parent's reset). Never raises for env or policy failures: they are
    the trajectory's finish reason. ``keep_messages`` stores the conversation as messages in
    ``metadata["messages"]`` (its K3 rendering is exactly ``decode(token_ids)``)."""
    traj = await _play(env, policy, tokenizer, config, task_id, env_id, first_observation, reset_options, seed,
                       group_id, group_index, keep_messages)
    return traj.check()


async def _play(env: Any, policy: PolicyClient, tokenizer: Tokenizer, config: AgentConfig, task_id: str,
                env_id: str, first_observation: str | None, reset_options: dict[str, Any] | None, seed: int | None,
                group_id: str, group_index: int, keep_messages: bool) -> Trajectory:
    traj = Trajectory(task_id=task_id, env_id=env_id, seed=seed, group_id=group_id, group_index=group_index)
    try:
        if first_observation is None:
            first_observation, info = await asyncio.to_thread(env.reset, seed=seed, options=reset_options)
            traj.task_id = traj.task_id or str(info.get("task") or "")
    except Exception as e:  # noqa: BLE001 - an env that cannot start is the episode's result
        return _failed(traj, "env_error", e)
    episode = Episode(tokenizer, env_tools(env), traj)
    if keep_messages:
        traj.metadata["messages"] = episode.messages
    first = ([{"role": "system", "content": config.system_prompt}] if config.system_prompt else []) + [
        {"role": "user", "content": first_observation}]
    episode.start(first)
    for _turn in range(config.max_turns):
        room = min(config.max_new_tokens, config.max_total_tokens - traj.generated_tokens,
                   config.context_limit - len(traj.token_ids))
        if room <= 0:
            traj.finish_reason = "max_tokens" if traj.generated_tokens >= config.max_total_tokens else "context_limit"
            traj.reward = 0.0
            return traj
        start, t0 = len(traj.token_ids), time.perf_counter()
        try:
            completion = await policy.complete(traj.token_ids, max_tokens=room, temperature=config.temperature,
                                               top_p=config.top_p, stop_token_ids=[tokenizer.eos_id],
                                               return_routed_experts=config.return_routed_experts,
                                               timeout=config.policy_timeout)
        except PolicyError as e:
            return _failed(traj, "policy_error", e)
        policy_s = time.perf_counter() - t0
        sample = completion.samples[0]
        if sample.logprobs is None or len(sample.logprobs) != len(sample.token_ids):
            return _failed(traj, "policy_error", RuntimeError("the policy returned no logprob per generated token"))
        text = episode.add_generation(sample.token_ids, sample.logprobs)
        if config.return_routed_experts and sample.routed_experts is not None:
            traj.routed_experts = (traj.routed_experts or []) + list(sample.routed_experts)
        turn = Turn(start=start, generated=len(sample.token_ids), weight_version=completion.weight_version or 0,
                    policy_s=policy_s, finish=sample.finish_reason or "")
        traj.turns.append(turn)
        t1 = time.perf_counter()
        try:
            obs, reward, terminated, truncated, info = await asyncio.to_thread(env.step, env_action(env, text))
        except Exception as e:  # noqa: BLE001 - the env failed, not the policy's task
            turn.env_s = time.perf_counter() - t1
            return _failed(traj, "env_error", e)
        turn.env_s = time.perf_counter() - t1
        calls = info.get("calls") or []
        turn.tool_calls, turn.malformed = len(calls), bool(chat.parse_assistant(text).malformed)
        traj.tool_calls += turn.tool_calls
        traj.malformed_calls += int(turn.malformed)
        if terminated or truncated:
            traj.reward = float(reward)
            traj.finish_reason = "submitted" if terminated else "max_turns"
            traj.grade = {k: info[k] for k in ("resolved", "FAIL_TO_PASS", "PASS_TO_PASS", "grading", "correct",
                                               "expected", "answer") if k in info}
            return traj
        episode.add_observation(observation_messages(obs, info, text))
    traj.finish_reason, traj.reward = "max_turns", 0.0
    return traj


def _failed(traj: Trajectory, reason: str, error: BaseException) -> Trajectory:
    traj.finish_reason, traj.reward = reason, None
    traj.error = f"{type(error).__name__}: {error}"[:2000]
    return traj


class LocalTokenizer:
    """k3-mini's tokenizer (``policy.tokenizer``), for a policy served by ``agentenv policy serve``."""

    def __init__(self) -> None:
        from policy.tokenizer import load_tokenizer

        self._tok = load_tokenizer()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))

    @property
    def eos_id(self) -> int:
        return int(self._tok.eos_id)
