"""The gateway's token fidelity, through ``Gateway.turn`` over the scripted policy app in process (token ids in,
streamed ids out): append-only histories merge into one branch whose record is the engine's ids; every prefix break
starts a branch labelled with its cause; retries never resample (body hash, in-flight coalescing); budgets end in a
final answer; calls wait while a weight push holds the gate. Property tests drive random conversations."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policy.tokenizer import load_tokenizer
from rollout import scripted
from rollout.gateway import export
from rollout.gateway.messages import Answer, Call
from rollout.gateway.sessions import Budget, SessionConfig
from rollout.gateway.turns import Gateway
from rollout.gateway.upstream import Sampling, Upstream

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout_fakes import TOK  # noqa: E402

ENC = load_tokenizer()
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]


def answers(text: str, turn: int) -> str:
    """The scripted engine: a tool call on even turns (by how many tool returns the prompt holds), text on odd."""
    n = text.count("## Return of")
    if n % 2 == 0:
        return f"step {n}" + scripted.tool_call("bash", {"command": f"echo {n}"})
    return f"<think>r{n}</think>said {n}"


class Engine:
    """The scripted app behind an Upstream, counting the generations it was asked for."""

    def __init__(self, script=answers) -> None:
        self.app = scripted.create_app(script, TOK)
        self.gateway = Gateway(Upstream("http://engine", transport=httpx.ASGITransport(app=self.app)), ENC)

    @property
    def calls(self) -> int:
        return int(self.app.state.calls)


async def ask(engine: Engine, session, messages, tools=TOOLS, body_hash: str | None = None) -> Answer:
    items = [i async for i in engine.gateway.turn(session, Call(messages, tools), body_hash or repr((messages, tools)))]
    final = items[-1]
    assert isinstance(final, Answer)
    return final


def as_message(a: Answer) -> dict:
    return a.message()


def tool_result(a: Answer, text: str) -> dict:
    return {"role": "tool", "tool_call_id": a.tool_calls[0]["id"], "content": text}


async def play(engine: Engine, session, turns: int, start: list[dict]) -> list[dict]:
    messages = list(start)
    for i in range(turns):
        a = await ask(engine, session, messages)
        messages.append(as_message(a))
        messages.append(tool_result(a, f"out {i}") if a.tool_calls else {"role": "user", "content": f"go on {i}"})
    return messages


@settings(max_examples=15, deadline=None)
@given(turns=st.integers(1, 6), system=st.text(min_size=1, max_size=30), task=st.text(min_size=1, max_size=60))
def test_an_append_only_harness_is_one_branch_whose_record_is_the_engines_ids(turns, system, task):
    engine = Engine()
    s = engine.gateway.open()
    asyncio.run(play(engine, s, turns, [{"role": "system", "content": system}, {"role": "user", "content": task}]))
    (traj,) = export.trajectories(s)
    nodes = s.tape.nodes
    assert [n.cause for n in nodes] == ["start"] + ["extend"] * (turns - 1)
    assert traj.token_ids == nodes[-1].full_ids(ENC.eos_id)
    sampled = [t for n in nodes for t in n.output_ids]   # every sampled id, in order, with mask 1, nothing else
    assert [t for t, m in zip(traj.token_ids, traj.loss_mask, strict=True) if m] == sampled
    assert export.session_summary(s)["merge_rate"] == 1.0


def test_each_prefix_break_is_a_branch_labelled_with_its_cause():
    engine = Engine()
    s = engine.gateway.open(SessionConfig(thinking="follow"))
    base = [{"role": "system", "content": "sys"}, {"role": "user", "content": "task"}]

    async def go() -> None:
        h = await play(engine, s, 2, base)                       # start, extend: a tool call, then reasoning + text
        assert h[4]["reasoning_content"] == "r1"                 # h: system, user, call, result, answer, user
        await ask(engine, s, [*h[:4], {**h[4], "reasoning_content": None}, h[5]])    # thinking dropped
        await ask(engine, s, [*h[:4], {**h[4], "content": "edited"}, h[5]])          # the answer changed
        await ask(engine, s, [*h[:4], {"role": "user", "content": "that was not a tool call"}])   # answer dropped
        await ask(engine, s, [h[0], {"role": "user", "content": "task (edited)"}, *h[2:]])   # an earlier message
        await ask(engine, s, [h[0], {"role": "user", "content": "summary of the work so far"}])   # compacted
        await ask(engine, s, [{"role": "system", "content": "you are a subagent"}, {"role": "user", "content": "x"}])
        await ask(engine, s, h[:2], tools=[])                    # the tools changed
        await ask(engine, s, h[:3] + [{"role": "tool", "tool_call_id": h[2]["tool_calls"][0]["id"],
                                       "content": "another result"}])   # a second continuation of call 0
        await ask(engine, s, h[:2], body_hash="again")           # the same prompt, not a retry (another body)

    asyncio.run(go())
    causes = [n.cause for n in s.tape.nodes]
    assert causes == ["start", "extend", "thinking_stripped", "answer_edited", "answer_dropped", "history_edited",
                      "compacted",
                      "subagent", "tools_changed", "sibling", "resample"]
    records = export.trajectories(s)
    assert len(records) == len(causes) - 1                       # one per branch: start+extend merged
    sibling = records[-2].metadata["gateway"]
    assert sibling["parent_call"] == 0 and sibling["parent_branch"] == 0
    # a sibling's shared prefix (call 0's sampled ids) is its prompt here: each sampled token is trained once
    assert sum(r.generated_tokens for r in records) == sum(len(n.output_ids) for n in s.tape.nodes)


def test_keep_thinking_extends_when_the_harness_drops_the_reasoning():
    engine = Engine()
    s = engine.gateway.open()                                    # thinking = "keep", the default

    async def go() -> None:
        h = await play(engine, s, 2, [{"role": "user", "content": "task"}])
        await ask(engine, s, [*h[:3], {**h[3], "reasoning_content": None}, h[4]])   # h: user, call, result, answer

    asyncio.run(go())
    assert [n.cause for n in s.tape.nodes] == ["start", "extend", "extend"]
    # the prompt kept the reasoning the model generated: the record is still the engine's ids, one branch
    assert len(export.trajectories(s)) == 1


def test_a_retry_is_answered_from_the_tape_and_concurrent_twins_are_one_generation():
    engine = Engine()
    s = engine.gateway.open()
    msgs = [{"role": "user", "content": "task"}]

    async def go() -> list[Answer]:
        first = await ask(engine, s, msgs, body_hash="h1")
        again = await ask(engine, s, msgs, body_hash="h1")       # a retry: same body
        twins = await asyncio.gather(*(ask(engine, s, [*msgs, {"role": "user", "content": "x"}], body_hash="h2")
                                       for _ in range(3)))
        return [first, again, *twins]

    first, again, *twins = asyncio.run(go())
    assert engine.calls == 2 and len(s.tape.nodes) == 2 and s.retries == 3
    assert again.content == first.content and again.tool_calls == first.tool_calls and again.node == first.node
    assert len({(t.node, t.content) for t in twins}) == 1


@pytest.mark.parametrize(("budget", "spent"), [(Budget(turns=2), "turns"), (Budget(tokens=5), "tokens")])
def test_a_spent_budget_is_a_final_answer_not_an_error(budget, spent):
    engine = Engine()
    s = engine.gateway.open(SessionConfig(budget=budget))

    async def go() -> Answer:
        h = await play(engine, s, 1 if spent == "tokens" else 2, [{"role": "user", "content": "task"}])
        return await ask(engine, s, h)

    final = asyncio.run(go())
    assert final.finish == "budget" and "budget is spent" in final.content and not final.tool_calls
    assert s.stopped == spent
    if spent == "tokens":   # the call that ran was cut to what was left
        assert s.tape.nodes[0].sampling["max_tokens"] == 5 and len(s.tape.nodes[0].output_ids) <= 5


def test_calls_wait_while_a_weight_push_holds_the_gate():
    engine = Engine()
    s = engine.gateway.open()

    async def go() -> None:
        async with engine.gateway.hold():
            call = asyncio.ensure_future(ask(engine, s, [{"role": "user", "content": "task"}]))
            while not engine.gateway.holding or not s.inflight:   # the call is waiting at the gate
                await asyncio.sleep(0)
            assert not call.done() and engine.calls == 0
        await call

    asyncio.run(go())
    assert engine.calls == 1 and s.tape.nodes[0].done


def test_sampling_is_the_runs_and_recorded_with_the_template():
    engine = Engine()
    cfg = SessionConfig(sampling=Sampling(temperature=0.7, max_tokens=64, extra={"top_k": -1}))
    s = engine.gateway.open(cfg)
    asyncio.run(ask(engine, s, [{"role": "user", "content": "task"}]))
    node = s.tape.nodes[0]
    assert node.sampling == {"temperature": 0.7, "top_p": 1.0, "max_tokens": 64, "seed": None, "top_k": -1}
    assert node.template == engine.gateway.template and len(node.template) == 16


OPS = st.lists(st.sampled_from(["turn", "retry", "compact", "subagent", "sibling", "strip"]), min_size=1, max_size=12)


@settings(max_examples=25, deadline=None)
@given(ops=OPS)
def test_random_harness_behaviour_keeps_the_tapes_invariants(ops):
    """Whatever a harness does (turns, retries of any earlier body, compactions, subagents, second continuations,
    dropped thinking), a body is generated once, every record is checked and every sampled token is in exactly one
    record with mask 1; a main conversation and a subagent interleaved each stay one branch of appends."""
    engine = Engine()
    s = engine.gateway.open(SessionConfig(thinking="follow"))
    sent: list[tuple[list[dict], str]] = []

    async def go() -> None:
        main = [{"role": "system", "content": "main"}, {"role": "user", "content": "task"}]
        sub = [{"role": "system", "content": "sub"}, {"role": "user", "content": "part"}]
        for i, op in enumerate(ops):
            if op == "retry":
                if sent:
                    msgs, h = sent[i % len(sent)]
                    await ask(engine, s, msgs, body_hash=h)
                continue
            if op == "compact":
                main[:] = [main[0], {"role": "user", "content": f"summary {i}"}]
            history = sub if op == "subagent" else main
            if op == "sibling" and len(history) > 3:
                history[:] = history[:-1] + [{"role": "user", "content": f"instead {i}"}]
            if op == "strip" and len(history) > 3 and history[-2].get("reasoning_content"):
                history[-2] = {**history[-2], "reasoning_content": None}
            h = f"body {i}"
            a = await ask(engine, s, list(history), body_hash=h)
            sent.append((list(history), h))
            history.append(a.message())
            history.append(tool_result(a, f"out {i}") if a.tool_calls else {"role": "user", "content": f"go {i}"})

    asyncio.run(go())
    assert engine.calls == len(s.tape.nodes) == len(sent)
    records = export.trajectories(s)
    assert sum(r.generated_tokens for r in records) == sum(len(n.output_ids) for n in s.tape.nodes)
    assert sum(len(r.metadata["gateway"]["calls_in_branch"]) for r in records) == len(s.tape.nodes)
    for r in records:
        ids = r.metadata["gateway"]["calls_in_branch"]
        assert r.token_ids == s.tape.nodes[ids[-1]].full_ids(ENC.eos_id)
    if set(ops) <= {"turn", "subagent", "retry"}:   # append-only: one branch per conversation
        assert len(records) == ("subagent" in ops) + ("turn" in ops)
