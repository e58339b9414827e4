"""Token fidelity against the real engine: k3-mini served by our policy server (its own process, random weights),
the gateway in front, the official SDKs as the harness (Chat Completions streaming and not, Anthropic Messages
streamed, Responses). The engine writes its own record of every sequence it generated (``--echo``, by the
policy-server process, never the gateway): every call the gateway recorded must be, id for id and logprob for
logprob, a sequence the engine generated; each session exports as records the trainer (``Trainer.score``, the same
weights) scores to the recorded logprobs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import anthropic
import openai
import pytest

from policy.config import model_config
from rollout.gateway import export
from rollout.gateway.sessions import SessionConfig
from rollout.gateway.upstream import Sampling
from trainer.algorithm.batch import Sample
from trainer.train import TrainConfig, Trainer

from ..server_fixtures import k3_mini_server

pytestmark = pytest.mark.integration
TOKEN = "gateway-fidelity-token"
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a command.", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}}}}]
CONFIG = SessionConfig(sampling=Sampling(temperature=1.0, max_tokens=12))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    echo = tmp_path_factory.mktemp("echo") / "echo.jsonl"
    with k3_mini_server(TOKEN, ep=1, max_model_len=1024, extra_args=["--echo", str(echo)]) as spec:
        spec.echo = echo
        yield spec


def chat_session(gw, stream_turns: list[bool]):
    s = gw.gateway.open(CONFIG)
    client = openai.OpenAI(base_url=gw.openai_url(s), api_key=s.key, max_retries=0)
    messages: list[dict] = [{"role": "system", "content": "You run commands."}, {"role": "user", "content": "ls"}]
    for stream in stream_turns:
        if stream:
            chunks = [c for c in client.chat.completions.create(model="k3", messages=messages, tools=TOOLS,
                                                                stream=True) if c.choices]
            content = "".join(c.choices[0].delta.content or "" for c in chunks)
            calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
            msg = {"role": "assistant", "content": content}
            if calls:
                msg["tool_calls"] = [{"id": t.id, "type": "function", "function": {
                    "name": t.function.name, "arguments": t.function.arguments}} for t in calls]
        else:
            msg = client.chat.completions.create(model="k3", messages=messages, tools=TOOLS).choices[0].message
            msg = msg.model_dump(exclude_none=True)
        messages.append(msg)
        for call in msg.get("tool_calls") or []:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "a.txt b.txt"})
        messages.append({"role": "user", "content": "go on"})
    return s


def anthropic_session(gw):
    s = gw.gateway.open(CONFIG)
    client = anthropic.Anthropic(base_url=gw.anthropic_url(s), api_key=s.key, max_retries=0)
    messages: list[dict] = [{"role": "user", "content": "ls"}]
    for _ in range(2):
        with client.messages.stream(model="claude", max_tokens=64, messages=messages) as st:
            r = st.get_final_message()
        content = [b.model_dump(exclude_none=True) for b in r.content]
        messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "go on"}]
    return s


def responses_session(gw):
    s = gw.gateway.open(CONFIG)
    client = openai.OpenAI(base_url=gw.openai_url(s), api_key=s.key, max_retries=0)
    items: list[dict] = [{"role": "user", "content": "ls"}]
    for _ in range(2):
        r = client.responses.create(model="k3", input=items)
        items += [o.model_dump(exclude_none=True) for o in r.output] + [{"role": "user", "content": "go on"}]
    return s


def test_every_recorded_call_is_what_the_engine_generated_and_the_trainer_agrees(engine, serve_gateway):
    gw = serve_gateway(engine.base_url, TOKEN)
    sessions = [chat_session(gw, [False, True, False]), chat_session(gw, [True, True]), anthropic_session(gw),
                responses_session(gw)]
    echoed = [json.loads(line) for line in engine.echo.read_text().splitlines()]
    by_prompt = {(tuple(e["prompt_ids"]), tuple(e["output_ids"])): e for e in echoed}
    nodes = [n for s in sessions for n in s.tape.nodes]
    assert len(nodes) == 9 and all(n.done for n in nodes)
    for n in nodes:                               # 100% of calls: ids and logprobs are the engine's own
        e = by_prompt.get((tuple(n.prompt_ids), tuple(n.output_ids)))
        assert e is not None, f"call {n.index}: no sequence of the engine has these prompt and sampled ids"
        assert e["logprobs"] == n.logprobs and e["weight_version"] == n.weight_version == 0
        assert e["sampling"]["temperature"] == 1.0 and e["sampling"]["max_tokens"] == n.sampling["max_tokens"]
    records = [t for s in sessions for t in export.trajectories(s, task_id="ls", reward=0.0)]
    summaries = [export.session_summary(s) for s in sessions]
    # an append-only harness merges: random text may make a malformed call the harness cannot echo back as it was
    # said, and that break is labelled; most calls extend
    assert sum(x["causes"].get("extend", 0) for x in summaries) >= 4, summaries
    with Trainer(model_config("k3-mini"), TrainConfig(seed=0)) as trainer:
        samples = [Sample.from_trajectory(t) for t in records]
        scored = trainer.score(samples, temperature=1.0)
    deltas = [abs(a - b) for s, sc in zip(samples, scored, strict=True)
              for a, b, m in zip(sc.logprobs, s.logprobs, s.loss_mask, strict=True) if m]
    assert len(deltas) == sum(len(n.output_ids) for n in nodes)
    assert max(deltas) < 1e-3, f"max |logprob delta| {max(deltas)}"
    if os.environ.get("AGENTENV_GATEWAY_FIGURES"):   # bench/gateway.py keeps this run's figures
        causes: dict[str, int] = {}
        for x in summaries:
            for k, v in x["causes"].items():
                causes[k] = causes.get(k, 0) + v
        later = sum(x["calls"] - 1 for x in summaries)
        figures = {"calls": len(nodes), "ids_equal_engine_share": 1.0, "sampled_tokens": len(deltas),
                   "max_abs_logprob_delta": max(deltas), "mean_abs_logprob_delta": sum(deltas) / len(deltas),
                   "merge_rate": causes.get("extend", 0) / later, "causes": causes}
        Path(os.environ["AGENTENV_GATEWAY_FIGURES"]).write_text(json.dumps(figures))
