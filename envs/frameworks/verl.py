"""agentenv's envs as verl agent loops (verl 0.9.1, ``verl.experimental.agent_loop``): ``agentenv_swe`` runs an
``agentenv/SWE-v0`` episode, ``agentenv_lookup`` an ``agentenv/Lookup-v0`` one.

Why an agent loop and not a verl ``BaseTool``: verl's ``ToolAgentLoop`` creates a tool instance and releases it
around each call, so a sandbox made there would be lost between turns (the edits of one ``bash`` gone at the next).
Here one loop instance owns ONE agentenv env (one sandbox) for the whole multi-turn episode, made in ``run`` and
closed when it returns.

``run(sampling_params, **row)`` (what ``AgentLoopWorker`` calls, the row's non-tensor fields as keywords):
the task is the row's ``extra_info["task"]`` (an id or record; none: the env draws one); the prompt is
``raw_prompt`` (the row's messages, a system prompt say) followed by a user message with the env's first
observation, rendered in K3's chat format with the env's tool declarations (the envs read K3 tool-call text, so
the policy must speak it, and the tokenizer must know K3's special tokens). The token ids are made by
``policy.chat.ChatEncoder`` over verl's tokenizer: control ids come from the template alone, and a control-token
string in a task or a tool output is tokenised as the characters it is. Each turn is one call of the
server manager's ``generate(request_id, prompt_ids=..., sampling_params=...)`` (token ids in, ``TokenOutput``
out; one request id for the episode, so the server's prefix cache sticks), its text is the env's action, and the
env's observation goes back as a K3 tool message. ``response_mask`` is 1 over generated tokens and 0 over the
tool messages (and an ``<|im_end|>`` the loop adds when a generation stopped without one); ``response_logprobs``
are the server's where it gave them (0.0 under masked tokens). ``reward_score`` is our grader's: the env's reward
at the end of the episode (SWE-v0: 1.0 resolved; Lookup-v0: 1.0 the right code); an episode cut by
``rollout.response_length`` is graded as it stands (SWE-v0: the patch then; Lookup-v0 with no answer: 0.0).

Config (verl's ``agent_loop_config_path`` YAML, read by ``AgentLoopWorker``)::

    - name: agentenv_swe
      _target_: envs.frameworks.verl.SWEAgentLoop
      env_kwargs: {max_steps: 20}        # gymnasium.make keywords (optional)

Importing this module registers both names with ``verl.experimental.agent_loop.agent_loop.register``; rows pick
one with ``agent_name``. Multimodal inputs are refused (the envs are text).
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar
from uuid import uuid4

import gymnasium
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register

import envs  # noqa: F401  (registers the Gymnasium ids)
from policy import chat

MULTIMODAL = ("multi_modal_data", "images", "videos", "audios")


class _AgentenvAgentLoop(AgentLoopBase):
    """One agentenv episode (one sandbox) per ``run``; subclasses name the Gymnasium id."""

    env_id: ClassVar[str]

    def __init__(self, *args: Any, env_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.env_kwargs = dict(env_kwargs or {})
        self.response_length = int(self.rollout_config.response_length)
        self.encoder = chat.ChatEncoder.wrap(self.tokenizer)   # k3-mini's as is, a Hugging Face one wrapped


    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        given = [k for k in MULTIMODAL if kwargs.get(k)]
        if given:
            raise ValueError(f"{self.env_id} is a text env; multimodal inputs are not supported: {given}")
        task = (kwargs.get("extra_info") or {}).get("task")
        env = await asyncio.to_thread(gymnasium.make, self.env_id, **self.env_kwargs)
        try:
            return await self._episode(env, task, list(kwargs.get("raw_prompt") or []), sampling_params)
        finally:
            await asyncio.to_thread(env.close)

    async def _episode(self, env: Any, task: Any, messages: list[dict[str, Any]],
                       sampling_params: dict[str, Any]) -> AgentLoopOutput:
        obs, _ = await asyncio.to_thread(env.reset, options={"task": task} if task is not None else None)
        prompt_ids = self.encoder.encode_chat([*messages, {"role": "user", "content": obs}],
                                              tools=env.unwrapped.toolbox.specs)
        ids: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        end_ids = [self.encoder.eos_id]
        request_id, turns, reward = uuid4().hex, 1, None
        while len(ids) < self.response_length:
            out = await self.server_manager.generate(request_id=request_id, prompt_ids=prompt_ids + ids,
                                                     sampling_params=sampling_params)
            ids += out.token_ids
            mask += [1] * len(out.token_ids)
            logprobs += list(out.log_probs) if out.log_probs else [0.0] * len(out.token_ids)
            turns += 1
            text = self.encoder.decode(out.token_ids)
            if not text.endswith(chat.IM_END):
                ids, mask, logprobs = ids + end_ids, mask + [0] * len(end_ids), logprobs + [0.0] * len(end_ids)
            action = text.removesuffix(chat.IM_END)
            obs, r, terminated, truncated, _ = await asyncio.to_thread(env.step, action)
            if terminated or truncated:
                reward = float(r)
                break
            calls = chat.parse_assistant(action).tool_calls
            tool_ids = self.encoder.encode_chat([{"role": "tool", "tool_call_id": calls[0]["id"] if calls else "",
                                                  "content": obs}])
            ids, mask, logprobs = ids + tool_ids, mask + [0] * len(tool_ids), logprobs + [0.0] * len(tool_ids)
            turns += 1
        if reward is None:  # cut by response_length: graded as it stands
            reward = await asyncio.to_thread(self._unfinished_reward, env)
        n = self.response_length
        return AgentLoopOutput(prompt_ids=prompt_ids, response_ids=ids[:n], response_mask=mask[:n],
                               response_logprobs=logprobs[:n], reward_score=reward, num_turns=turns,
                               metrics={}, extra_fields={"turn_scores": [], "tool_rewards": []})

    def _unfinished_reward(self, env: Any) -> float:
        return 0.0


@register("agentenv_swe")
class SWEAgentLoop(_AgentenvAgentLoop):
    """``agentenv/SWE-v0``: fix a repository in /testbed; graded like SWE-bench (1.0: resolved)."""

    env_id = "agentenv/SWE-v0"

    def _unfinished_reward(self, env: Any) -> float:
        return float(env.unwrapped.grade().reward)


@register("agentenv_lookup")
class LookupAgentLoop(_AgentenvAgentLoop):
    """``agentenv/Lookup-v0``: find a code in the files of /data, then answer it (1.0: the right code)."""

    env_id = "agentenv/Lookup-v0"
