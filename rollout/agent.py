"""The multi-turn agent loop, token-in/token-out: an env and a policy endpoint make one trajectory.

reset → render the tool declarations and the task with the K3 template → ask the policy (token ids
in) → append its token ids verbatim → hand the text to ``env.step`` (the env parses the tool calls with
``policy.chat``) → render the tool results as K3 tool messages and append only those new tokens → …
until the env ends the episode (submit, its step limit) or a limit of the loop is reached (turns,
generated tokens, context length).

No retokenisation drift: the conversation lives as token ids; earlier turns are never tokenised again.
Every piece the loop tokenises starts and ends at a special token, so ``decode(token_ids)`` is exactly
``render_chat`` of the same conversation (``metadata["messages"]`` rebuilds it; a test checks the equality).

Text is text: the task, the env's observations and tool output are tokenised by ``encode_chat`` (``policy.chat``'s
``ChatEncoder``), where a control-token string inside them (a sandbox that prints ``<|im_end|><|im_system|>...``)
stays ordinary characters. The control ids of a trajectory are the template's and the ones the policy generated.

Failures: an exception from the env is ``env_error``, one from the policy ``policy_error``; both carry
``reward=None`` (an infrastructure failure is not a task failure). Stopping on a limit of the loop is a
task failure: reward 0.0 unless the env graded the episode itself.

A generation cut off by a weight update (``finish_reason == "abort"``: our server with ``sync_mode = "abort"``,
vLLM's and SGLang's aborted requests) is not the agent's answer: ``Episode.ask`` drops it and asks again, on the
new weights, up to ``AgentConfig.abort_retries`` times; then the episode ends as ``policy_error``. The env never
sees, let alone grades, the truncated text, and the turn records the version of the generation that was kept.

Weight versions: a turn records the version the server reports for its generation. vLLM and SGLang report none;
for them ``play`` takes ``served_version()``, the version the caller knew to be loaded when the request was sent
(the training loop's, which it raises only after a push returned): a lower bound of the weights that served it,
so staleness is never underestimated.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from envs.protocol import GymEnv, ToolMessage, tool_messages, unwrap
from envs.tools import Toolbox
from policy import chat
from policy.client import Completion, PolicyClient, PolicyError, PolicyProtocolError, Sample
from rollout.trajectory import Trajectory, Turn

BASH_TOOL = chat.tool_spec("bash", "Run a shell command and see its output.", {"command": {"type": "string"}},
                           ["command"])


class Tokenizer(Protocol):
    """Messages → token ids and back, as the policy endpoint tokenises (``LocalTokenizer`` for k3-mini; any
    ``policy.chat.ChatEncoder``)."""

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True) -> list[int]: ...

    def encode_assistant(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def decode_pieces(self, ids: Sequence[int]) -> list[chat.Piece]: ...

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
    abort_retries: int = 3             # a generation aborted by a weight update is asked again this many times


DEFAULT_CONFIG = AgentConfig()


def sampling_seed(traj: Trajectory) -> int | None:
    """The seed of an episode's next policy call, from its group's seed, its place in the group and its turn, so
    that a run's sampling repeats (None without a group seed: the engine draws one)."""
    if traj.seed is None:
        return None
    digest = hashlib.blake2b(f"{traj.seed}:{traj.group_index}:{len(traj.turns)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 2   # below 2**62: every engine takes it


def observation_messages(obs: str, replies: Sequence[ToolMessage],
                         said: chat.AssistantMessage) -> list[dict[str, Any]]:
    """The K3 messages for an env's answer: its tool messages (``info["tool_messages"]``, one per call it ran); for
    an env that ran the text's call as a plain command (a shell), that call's result; else a user message."""
    if replies:
        return [m.to_chat() for m in replies]
    if said.tool_calls:
        return [{"role": "tool", "tool_call_id": said.tool_calls[0]["id"], "content": obs}]
    return [{"role": "user", "content": obs}]


def _toolbox(env: GymEnv) -> Toolbox | None:
    """The env's toolbox (envs whose actions are K3 tool-call text), or None (a shell env: actions are commands)."""
    try:
        return unwrap(env).toolbox
    except NotImplementedError:
        return None


def env_tools(env: GymEnv) -> list[dict[str, Any]]:
    """The tool declarations the policy sees: the env's toolbox, or one bash tool for a shell env."""
    toolbox = _toolbox(env)
    return list(toolbox.specs) if toolbox is not None else [BASH_TOOL]


def env_action(env: GymEnv, text: str, said: chat.AssistantMessage) -> Any:
    """The action for ``env``: the policy's text itself when the env parses tool calls; for a shell env, the
    command of the text's first bash call (``said``: the text parsed; text without one is passed on, and fails
    as a command)."""
    if _toolbox(env) is not None:
        return text
    for call in said.tool_calls:
        if call["function"]["name"] == "bash":
            return str(json.loads(call["function"]["arguments"]).get("command", ""))
    return text


class EnvFailed(Exception):
    """The env raised while stepping (the episode's finish reason becomes ``env_error``)."""


@dataclass
class Step:
    """What ``env.step`` answered for one policy turn."""

    text: str
    observation: str
    reward: float
    done: bool
    terminated: bool
    info: dict[str, Any]


class Episode:
    """One episode's conversation as token ids plus the messages that render to them, and the turn
    primitives the loop (``run_episode``) and the search (``rollout.search``) are made of."""

    def __init__(self, tokenizer: Tokenizer, tools: list[dict[str, Any]], traj: Trajectory) -> None:
        self.tokenizer, self.tools, self.traj = tokenizer, tools, traj
        self.messages: list[dict[str, Any]] = []

    def start(self, first_observation: str, system_prompt: str | None = None) -> None:
        self.messages.extend(([{"role": "system", "content": system_prompt}] if system_prompt else [])
                             + [{"role": "user", "content": first_observation}])
        self.traj.append(self.tokenizer.encode_chat(self.messages, self.tools, add_generation_prompt=True),
                         generated=False)
        self.traj.prompt_len = len(self.traj.token_ids)

    def copy(self) -> Episode:
        """An independent copy (a branch of the conversation), sharing nothing mutable."""
        twin = Episode(self.tokenizer, self.tools, copy.deepcopy(self.traj))
        twin.messages = copy.deepcopy(self.messages)
        if "messages" in self.traj.metadata:
            twin.traj.metadata["messages"] = twin.messages
        return twin

    def room(self, config: AgentConfig) -> int:
        """How many tokens the next policy call may generate (0: a limit of the loop is reached)."""
        t = self.traj
        return min(config.max_new_tokens, config.max_total_tokens - t.generated_tokens,
                   config.context_limit - len(t.token_ids))

    def limit_reached(self, config: AgentConfig) -> str:
        return "max_tokens" if self.traj.generated_tokens >= config.max_total_tokens else "context_limit"

    async def ask(self, policy: PolicyClient, config: AgentConfig, n: int = 1) -> tuple[Completion, float]:
        """``n`` continuations of the conversation from the policy (raises PolicyError); and the seconds it took."""
        t0 = time.perf_counter()
        for attempt in range(config.abort_retries + 1):
            completion = await policy.complete(self.traj.token_ids, max_tokens=self.room(config), n=n,
                                               temperature=config.temperature, top_p=config.top_p,
                                               seed=sampling_seed(self.traj),
                                               stop_token_ids=[self.tokenizer.eos_id],
                                               return_routed_experts=config.return_routed_experts,
                                               timeout=config.policy_timeout)
            aborted = [s for s in completion.samples if s.finish_reason == "abort"]
            if not aborted:
                break
            self.traj.metadata["aborted_generations"] = int(self.traj.metadata.get("aborted_generations", 0)) + 1
            if attempt == config.abort_retries:
                raise PolicyError(f"the generation was aborted {attempt + 1} times "
                                  f"({aborted[0].abort_reason or 'no reason given'}); not graded")
        for sample in completion.samples:
            if sample.logprobs is None or len(sample.logprobs) != len(sample.token_ids):
                raise PolicyProtocolError("the policy returned no logprob per generated token")
        return completion, time.perf_counter() - t0

    def take(self, sample: Sample, weight_version: int | None, policy_s: float,
             prompt_routing: list[Any] | None = None) -> tuple[str, Turn]:
        """Append a generated sample verbatim as this episode's next turn; returns its text and the turn.
        ``prompt_routing``: the answer's ``prompt_routed_experts`` (positions 0..len(prompt) - 2), recorded with the
        sample's own routing into ``traj.routing`` (positions seen in an earlier turn keep their first routing)."""
        start = len(self.traj.token_ids)
        ids, logprobs = sample.token_ids, sample.logprobs or []
        self.traj.append(ids, generated=True, logprobs=logprobs)
        body_ids = ids[:-1] if ids and ids[-1] == self.tokenizer.eos_id else ids
        text = self.tokenizer.decode(body_ids)
        if not ids or ids[-1] != self.tokenizer.eos_id:
            self.traj.append([self.tokenizer.eos_id], generated=False)  # close the turn as the template does
        self.messages.append({"role": "assistant", "content": text})
        if sample.routed_experts is not None:
            prompt = list(prompt_routing or [])[:start - 1]
            self.traj.record_routing(prompt + [None] * (start - 1 - len(prompt)) + list(sample.routed_experts))
        turn = Turn(start=start, generated=len(ids), weight_version=weight_version or 0, policy_s=policy_s,
                    finish=sample.finish_reason or "")
        self.traj.turns.append(turn)
        return text, turn

    async def act(self, env: GymEnv, text: str, turn: Turn) -> Step:
        """Step ``env`` with the turn's text (raises EnvFailed); a step that does not end the episode appends
        the observation as K3 tool messages."""
        said = chat.parse_assistant(text)  # the policy's text, read once: its action and the call it answers
        t1 = time.perf_counter()
        try:
            obs, reward, terminated, truncated, info = await asyncio.to_thread(env.step, env_action(env, text, said))
            replies = tool_messages(info)
        except Exception as e:  # noqa: BLE001 - the env failed, not the policy's task
            raise EnvFailed(f"{type(e).__name__}: {e}") from e
        finally:
            turn.env_s = time.perf_counter() - t1
        turn.tool_calls, turn.malformed = len(replies), said.malformed
        self.traj.tool_calls += turn.tool_calls
        self.traj.malformed_calls += int(turn.malformed)
        done = bool(terminated or truncated)
        if done:
            self.traj.reward = float(reward)
            self.traj.finish_reason = "submitted" if terminated else "max_turns"
            self.traj.grade = {k: info[k] for k in GRADE_KEYS if k in info}
        else:
            self.add_observation(observation_messages(obs, replies, said))
        return Step(text, obs, float(reward), done, bool(terminated), info)

    def add_observation(self, messages: list[dict[str, Any]]) -> None:
        self.messages.extend(messages)
        self.traj.append(self.tokenizer.encode_chat(messages, None, add_generation_prompt=True), generated=False)

    def fail(self, reason: str, error: BaseException) -> Trajectory:
        """End the episode on an infrastructure failure: no reward (None, not 0)."""
        self.traj.finish_reason, self.traj.reward = reason, None
        self.traj.error = f"{type(error).__name__}: {error}"[:2000]
        return self.traj

    def stop(self, reason: str) -> Trajectory:
        """End the episode on a limit of the loop: a task failure, reward 0.0."""
        self.traj.finish_reason, self.traj.reward = reason, 0.0
        return self.traj


GRADE_KEYS = ("resolved", "FAIL_TO_PASS", "PASS_TO_PASS", "grading", "correct", "expected", "answer")


async def begin(env: GymEnv, tokenizer: Tokenizer, config: AgentConfig, traj: Trajectory,
                first_observation: str | None, reset_options: dict[str, Any] | None,
                keep_messages: bool = False) -> Episode:
    """The episode's start: reset the env unless ``first_observation`` is given (raises EnvFailed)."""
    if first_observation is None:
        try:
            obs, info = await asyncio.to_thread(env.reset, seed=traj.seed, options=reset_options)
        except Exception as e:  # noqa: BLE001 - an env that cannot start is the episode's result
            raise EnvFailed(f"{type(e).__name__}: {e}") from e
        first_observation = str(obs)
        traj.task_id = traj.task_id or str(info.get("task") or "")
    episode = Episode(tokenizer, env_tools(env), traj)
    if keep_messages:
        traj.metadata["messages"] = episode.messages
    episode.start(first_observation, config.system_prompt)
    return episode


async def run_episode(env: GymEnv, policy: PolicyClient, tokenizer: Tokenizer, config: AgentConfig = DEFAULT_CONFIG, *,
                      task_id: str = "", env_id: str = "", first_observation: str | None = None,
                      reset_options: dict[str, Any] | None = None, seed: int | None = None,
                      group_id: str = "", group_index: int = 0, keep_messages: bool = False) -> Trajectory:
    """Play one episode of ``env`` with ``policy``; the env is reset unless ``first_observation`` is given
    (a forked env continues from its parent's reset). Never raises for env or policy failures: they are
    the trajectory's finish reason. ``keep_messages`` stores the conversation as messages in
    ``metadata["messages"]`` (its K3 rendering is exactly ``decode(token_ids)``)."""
    traj = Trajectory(task_id=task_id, env_id=env_id, seed=seed, group_id=group_id, group_index=group_index)
    try:
        episode = await begin(env, tokenizer, config, traj, first_observation, reset_options, keep_messages)
    except EnvFailed as e:
        traj.finish_reason, traj.reward, traj.error = "env_error", None, str(e)
        return traj.check()
    await play(episode, env, policy, config)   # no should_pause: it plays to the end
    return episode.traj.check()


async def play(episode: Episode, env: GymEnv, policy: PolicyClient, config: AgentConfig,
               should_pause: Callable[[], bool] | None = None,
               served_version: Callable[[], int] | None = None) -> Trajectory | None:
    """Turns until the env ends the episode, a limit of the loop is reached, or something fails (the trajectory);
    or until ``should_pause()`` says so between two turns (None: a partial rollout, continued later with the same
    ``episode``). Turns taken before a pause count toward ``max_turns``. ``served_version()``, read before each
    request, is the turn's version when the server reports none (see the module docstring)."""
    while len(episode.traj.turns) < config.max_turns:
        if should_pause is not None and should_pause():
            return None
        if episode.room(config) <= 0:
            return episode.stop(episode.limit_reached(config))
        known = served_version() if served_version is not None else None
        try:
            completion, policy_s = await episode.ask(policy, config)
        except PolicyError as e:
            return episode.fail("policy_error", e)
        version = completion.weight_version if completion.weight_version is not None else known
        text, turn = episode.take(completion.samples[0], version, policy_s, completion.prompt_routed_experts)
        try:
            step = await episode.act(env, text, turn)
        except EnvFailed as e:
            return episode.fail("env_error", e)
        if step.done:
            return episode.traj
    return episode.stop("max_turns")


class LocalTokenizer:
    """k3-mini's tokenizer (``policy.tokenizer``, loaded when made), for a policy served by ``agentenv policy serve``."""

    def __init__(self) -> None:
        from policy.tokenizer import load_tokenizer

        self._tok = load_tokenizer()

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True) -> list[int]:
        return self._tok.encode_chat(messages, tools, add_generation_prompt)

    def encode_assistant(self, text: str) -> list[int]:
        return self._tok.encode_assistant(text)

    def encode_text(self, text: str) -> list[int]:
        return self._tok.encode_text(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))

    def decode_pieces(self, ids: Sequence[int]) -> list[chat.Piece]:
        return self._tok.decode_pieces(ids)

    @property
    def eos_id(self) -> int:
        return int(self._tok.eos_id)
