"""The agent loop on Tool-v0 over a fake sandbox backend, with a scripted OpenAI-compatible policy in process:
token alignment (no re-tokenisation drift), rewards, limits, and infrastructure failures carrying no reward."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx
import pytest

from envs import ToolEnv
from policy import chat
from policy.client import PolicyClient
from rollout import scripted
from rollout.agent import AgentConfig, LocalTokenizer, run_episode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "envs"))
from fakes import FakeBackend  # noqa: E402

TOK = LocalTokenizer()


def solve_calc(prompt: str, turn: int) -> str:
    if turn == 0:
        return "Let me compute." + scripted.tool_call("calculator", {"expression": "37 * 1234 - 5678"})
    return scripted.tool_call("answer", {"answer": "39980"})


def policy_for(script, **kw) -> PolicyClient:
    app = scripted.create_app(script, TOK, **kw)
    return PolicyClient("http://scripted", transport=httpx.ASGITransport(app=app), max_retries=0)


def play(script, env=None, config=None, **kw):
    env = env or ToolEnv(task="calc-001", api=FakeBackend())

    async def go():
        async with policy_for(script) as policy:
            return await run_episode(env, policy, TOK, config or AgentConfig(), env_id="agentenv/Tool-v0", keep_messages=True, **kw)

    try:
        return asyncio.run(go())
    finally:
        env.close()


def test_a_scripted_episode_is_rewarded_and_its_tokens_are_the_template_rendering():
    t = play(solve_calc)
    assert (t.finish_reason, t.reward, t.task_id) == ("submitted", 1.0, "calc-001")
    assert len(t.turns) == 2 and t.tool_calls == 2 and t.malformed_calls == 0
    # generated ids and logprobs are exactly what the server returned, where the mask says so
    gen = [i for i, m in zip(t.token_ids, t.loss_mask, strict=True) if m]
    expected = (TOK.encode_assistant(solve_calc("", 0)) + [TOK.eos_id] + TOK.encode_assistant(solve_calc("", 1))
                + [TOK.eos_id])
    assert gen == expected
    assert {lp for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if m} == {scripted.LOGPROB}
    # the tool results came back as K3 tool messages with the calls' ids
    tool_msgs = [m for m in t.metadata["messages"] if m["role"] == "tool"]
    assert tool_msgs[0]["tool_call_id"] == "functions.calculator:0" and "39980" in tool_msgs[0]["content"]


def _tools():
    env = ToolEnv(task="calc-001", api=FakeBackend())
    try:
        return env.toolbox.specs
    finally:
        env.close()


def test_the_whole_conversation_decodes_to_its_rendering_byte_for_byte():
    t = play(solve_calc)
    msgs = t.metadata["messages"]
    # the episode ended on the answer: the rendering has no generation prompt after the last turn
    rendered = chat.render_chat(msgs, _tools(), add_generation_prompt=False)
    assert TOK.decode(t.token_ids) == rendered


def test_a_wrong_answer_scores_zero_and_malformed_text_is_counted():
    def wrong(prompt, turn):
        return '<|open|>call tool="oops' if turn == 0 else scripted.tool_call("answer", {"answer": "1"})

    t = play(wrong)
    assert (t.finish_reason, t.reward) == ("submitted", 0.0)
    assert t.malformed_calls == 1 and t.turns[0].malformed


def test_limits_of_the_loop_end_the_episode_as_a_task_failure():
    def chatter(prompt, turn):
        return scripted.tool_call("calculator", {"expression": "1 + 1"})

    t = play(chatter, config=AgentConfig(max_turns=3))
    assert (t.finish_reason, t.reward, len(t.turns)) == ("max_turns", 0.0, 3)
    t = play(chatter, config=AgentConfig(max_total_tokens=30))
    assert t.finish_reason == "max_tokens" and t.reward == 0.0 and t.generated_tokens <= 30


def test_env_and_policy_failures_carry_no_reward():
    class Broken(ToolEnv):
        def step(self, action):
            raise ConnectionError("the env server went away")

    t = play(solve_calc, env=Broken(task="calc-001", api=FakeBackend()))
    assert (t.finish_reason, t.reward) == ("env_error", None) and "went away" in t.error

    async def go():
        async with PolicyClient("http://127.0.0.1:9", max_retries=0, connect_timeout=1.0) as policy:
            env = ToolEnv(task="calc-001", api=FakeBackend())
            try:
                return await run_episode(env, policy, TOK, AgentConfig())
            finally:
                env.close()

    t = asyncio.run(go())
    assert (t.finish_reason, t.reward) == ("policy_error", None) and t.error


@pytest.mark.parametrize("turns", [1, 3])
def test_every_turn_records_its_weight_version_and_timings(turns):
    def script(prompt, turn):
        if turn < turns - 1:
            return scripted.tool_call("calculator", {"expression": "2 * 3"})
        return scripted.tool_call("answer", {"answer": "39980"})

    t = play(script)
    assert t.weight_versions == [0] * turns
    assert all(turn.policy_s >= 0 and turn.env_s >= 0 and turn.generated > 0 for turn in t.turns)
    assert t.turns[0].start == t.prompt_len


class RecordingTransport(httpx.AsyncBaseTransport):
    """The scripted server's transport, keeping each request body."""

    def __init__(self, app) -> None:
        self.inner, self.bodies = httpx.ASGITransport(app=app), []

    async def handle_async_request(self, request):
        import json
        self.bodies.append(json.loads(request.content or b"{}"))
        return await self.inner.handle_async_request(request)


def test_each_policy_call_carries_a_seed_from_the_groups_seed_its_place_and_its_turn():
    from rollout.agent import sampling_seed
    from rollout.trajectory import Trajectory

    def seeds_of(seed, index):
        transport = RecordingTransport(scripted.create_app(solve_calc, TOK))
        env = ToolEnv(task="calc-001", api=FakeBackend())

        async def go():
            async with PolicyClient("http://scripted", transport=transport, max_retries=0) as policy:
                return await run_episode(env, policy, TOK, AgentConfig(), env_id="agentenv/Tool-v0", seed=seed,
                                         group_index=index)
        try:
            asyncio.run(go())
        finally:
            env.close()
        return [b.get("seed") for b in transport.bodies if "prompt" in b or "messages" in b]

    first = seeds_of(7, 0)
    assert len(first) == 2 and None not in first and len(set(first)) == 2      # one per turn, each its own
    assert seeds_of(7, 0) == first                                             # the same run: the same seeds
    assert set(seeds_of(7, 1)).isdisjoint(first) and set(seeds_of(8, 0)).isdisjoint(first)
    assert seeds_of(None, 0) == [None, None]                                   # no group seed: the engine draws
    assert all(0 <= s < 2**62 for s in first)
    assert sampling_seed(Trajectory("t", "e", seed=3)) == sampling_seed(Trajectory("u", "f", seed=3))
