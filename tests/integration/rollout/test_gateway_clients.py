"""The LLM gateway driven by the real clients, unmodified: the official ``openai`` SDK (Chat Completions and
Responses, streaming and not), the official ``anthropic`` SDK (Messages with tools, streaming and not,
``count_tokens``), litellm as mini-swe-agent calls it, and mini-swe-agent's ``DefaultAgent`` itself on an agentenv
sandbox. The engine behind the gateway is a scripted policy served over HTTP (token ids in, streamed token ids out),
answering a two-turn tool task: look the value up, then say it, reasoning first. Every stream is also read raw and
checked by the API's own event rules (``sse_rules``), and every session must come out as one merged branch whose
record is exactly the engine's ids."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from rollout import scripted
from rollout.gateway import export

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "unit" / "rollout"))
import sse_rules  # noqa: E402

pytestmark = pytest.mark.integration
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a key up.", "parameters": {
    "type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}]
RESPONSES_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]
ANTHROPIC_TOOLS = [{"name": "lookup", "description": "Look a key up.",
                    "input_schema": TOOLS[0]["function"]["parameters"]}]
FINAL = "The value is 42."


def lookup_task(text: str, turn: int) -> str:
    if "## Return of" in text:
        return f"<think>The tool said 42.</think>{FINAL}"
    return "Let me look it up." + scripted.tool_call("lookup", {"key": "a"})


@pytest.fixture()
def gateway_for(serve_policy, serve_gateway):
    """A gateway in front of a scripted engine answering ``script``."""
    return lambda script: serve_gateway(serve_policy(script).url)


@pytest.fixture()
def gw(gateway_for):
    return gateway_for(lookup_task)


def one_merged_branch(session) -> None:
    """The session is one branch, every call after the first extended it, and its record is the engine's ids."""
    summary = export.session_summary(session)
    assert summary["calls"] == 2 and summary["branches"] == 1 and summary["merge_rate"] == 1.0, summary
    (traj,) = export.trajectories(session, task_id="lookup", reward=1.0)
    last = session.tape.nodes[-1]
    assert traj.token_ids == last.full_ids(session.tape.tokenizer.eos_id)
    assert traj.generated_tokens == sum(len(n.output_ids) for n in session.tape.nodes)


@pytest.mark.parametrize("stream", [False, True])
def test_openai_chat_completions_through_a_tool_task(gw, stream):
    s = gw.gateway.open()
    client = openai.OpenAI(base_url=gw.openai_url(s), api_key=s.key, max_retries=0)
    messages: list[dict] = [{"role": "system", "content": "Answer with the tool."}, {"role": "user", "content": "a?"}]
    for turn in range(2):
        if stream:
            chunks = list(client.chat.completions.create(model="gpt-4o", messages=messages, tools=TOOLS, stream=True,
                                                         stream_options={"include_usage": True}))
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            msg = {"role": "assistant", "content": content, "tool_calls": [
                {"id": t.id, "type": "function", "function": {"name": t.function.name, "arguments": t.function.arguments}}
                for t in calls]} if calls else {"role": "assistant", "content": content}
        else:
            r = client.chat.completions.create(model="gpt-4o", messages=messages, tools=TOOLS)
            assert r.model == "gpt-4o" and r.usage.prompt_tokens > 0
            msg, finish = r.choices[0].message.model_dump(exclude_none=True), r.choices[0].finish_reason
        messages.append(msg)
        if turn == 0:
            assert finish == "tool_calls" and msg["content"] == "Let me look it up."
            (call,) = msg["tool_calls"]
            assert call["function"]["name"] == "lookup" and json.loads(call["function"]["arguments"]) == {"key": "a"}
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "a = 42"})
    assert finish == "stop" and messages[-1]["content"] == FINAL
    one_merged_branch(s)
    assert s.asked_models == {"gpt-4o"}


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_messages_through_a_tool_task(gw, stream):
    s = gw.gateway.open()
    client = anthropic.Anthropic(base_url=gw.anthropic_url(s), api_key=s.key, max_retries=0)
    messages: list[dict] = [{"role": "user", "content": "a?"}]
    for turn in range(2):
        kw = dict(model="claude-sonnet-4-5", max_tokens=256, system="Answer with the tool.", messages=messages,
                  tools=ANTHROPIC_TOOLS)
        if stream:
            with client.messages.stream(**kw) as st:
                r = st.get_final_message()
        else:
            r = client.messages.create(**kw)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]})
        if turn == 0:
            assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["text", "tool_use"]
            use = r.content[1]
            assert use.name == "lookup" and use.input == {"key": "a"}
            messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                          "content": "a = 42"}]})
    assert r.stop_reason == "end_turn" and [b.type for b in r.content] == ["thinking", "text"]
    assert r.content[0].thinking == "The tool said 42." and r.content[1].text == FINAL
    one_merged_branch(s)
    counted = client.messages.count_tokens(model="claude-sonnet-4-5", messages=messages, tools=ANTHROPIC_TOOLS)
    assert counted.input_tokens > r.usage.input_tokens  # the history now holds the last answer too


@pytest.mark.parametrize("stream", [False, True])
def test_openai_responses_through_a_tool_task(gw, stream):
    s = gw.gateway.open()
    client = openai.OpenAI(base_url=gw.openai_url(s), api_key=s.key, max_retries=0)
    items: list[dict] = [{"role": "user", "content": "a?"}]
    for turn in range(2):
        kw = dict(model="gpt-5", instructions="Answer with the tool.", input=items, tools=RESPONSES_TOOLS)
        if stream:
            with client.responses.stream(**kw) as st:
                deltas = [e.delta for e in st if e.type == "response.output_text.delta"]
                r = st.get_final_response()
            assert "".join(deltas) == r.output_text
        else:
            r = client.responses.create(**kw)
        assert r.status == "completed"
        items += [o.model_dump(exclude_none=True) for o in r.output]
        if turn == 0:
            assert [o.type for o in r.output] == ["message", "function_call"]
            items.append({"type": "function_call_output", "call_id": r.output[1].call_id, "output": "a = 42"})
    assert [o.type for o in r.output] == ["reasoning", "message"] and r.output_text == FINAL
    one_merged_branch(s)


def test_responses_previous_response_id_continues_the_same_branch(gw):
    s = gw.gateway.open()
    client = openai.OpenAI(base_url=gw.openai_url(s), api_key=s.key, max_retries=0)
    first = client.responses.create(model="m", instructions="Answer with the tool.", input="a?", tools=RESPONSES_TOOLS)
    call = first.output[1]
    second = client.responses.create(model="m", previous_response_id=first.id, tools=RESPONSES_TOOLS, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "a = 42"}])
    assert second.output_text == FINAL
    one_merged_branch(s)
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model="m", previous_response_id="resp_nope", input="x")


def _raw_stream(gw, session, path: str, body: dict, anthropic_api: bool = False) -> str:
    headers = {"x-api-key": session.key, "anthropic-version": "2023-06-01"} if anthropic_api else \
        {"Authorization": f"Bearer {session.key}"}
    base = gw.anthropic_url(session) if anthropic_api else gw.openai_url(session)
    with httpx.stream("POST", base + path, json={**body, "stream": True}, headers=headers, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return r.read().decode()


@pytest.mark.parametrize("turn", [0, 1])
def test_each_apis_raw_stream_keeps_its_event_rules_and_equals_the_whole_answer(gw, turn):
    """Both turns of the task (tool calls; reasoning and text), each API: the stream read raw passes the API's
    validator and assembles to what the non-streaming call answers."""
    tail = [{"role": "assistant", "content": "Let me look it up.", "tool_calls": [
        {"id": "call_0_0", "type": "function", "function": {"name": "lookup", "arguments": "{\"key\": \"a\"}"}}]},
        {"role": "tool", "tool_call_id": "call_0_0", "content": "a = 42"}] if turn else []
    s = gw.gateway.open()
    chat_body = {"model": "m", "messages": [{"role": "user", "content": "a?"}, *tail], "tools": TOOLS,
                 "stream_options": {"include_usage": True}}
    whole = httpx.post(gw.openai_url(s) + "/chat/completions", json=chat_body,
                       headers={"Authorization": f"Bearer {s.key}"}, timeout=60).json()["choices"][0]
    got = sse_rules.chat_chunks(_raw_stream(gw, gw.gateway.open(), "/chat/completions", chat_body))
    assert got["content"] == (whole["message"]["content"] or "") and got["finish_reason"] == whole["finish_reason"]
    assert got["reasoning"] == (whole["message"].get("reasoning_content") or "")
    assert [c["name"] for c in got["tool_calls"]] == [c["function"]["name"] for c in whole["message"].get("tool_calls", [])]

    a_tail = [{"role": "assistant", "content": [{"type": "text", "text": "Let me look it up."}, {
        "type": "tool_use", "id": "toolu_0_0", "name": "lookup", "input": {"key": "a"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_0_0", "content": "a = 42"}]}] \
        if turn else []
    got = sse_rules.anthropic_events(_raw_stream(gw, gw.gateway.open(), "/v1/messages", {
        "model": "m", "max_tokens": 128, "messages": [{"role": "user", "content": "a?"}, *a_tail],
        "tools": ANTHROPIC_TOOLS}, anthropic_api=True))
    assert got["stop_reason"] == ("end_turn" if turn else "tool_use")

    r_tail = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look it up."}]},
              {"type": "function_call", "call_id": "call_0_0", "name": "lookup", "arguments": "{\"key\": \"a\"}"},
              {"type": "function_call_output", "call_id": "call_0_0", "output": "a = 42"}] if turn else []
    got = sse_rules.responses_events(_raw_stream(gw, gw.gateway.open(), "/responses", {
        "model": "m", "input": [{"role": "user", "content": "a?"}, *r_tail], "tools": RESPONSES_TOOLS}))
    assert [o["type"] for o in got["output"]] == (["reasoning", "message"] if turn else ["message", "function_call"])


def test_litellm_as_mini_swe_agent_calls_it_and_default_agent_on_a_sandbox(gateway_for):
    """mini-swe-agent's ``LitellmModel`` (litellm's OpenAI provider) and its ``DefaultAgent``, unmodified, with an
    agentenv sandbox (``AgentenvEnvironment``): the scripted engine runs two bash commands and submits."""
    os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.config import get_config_from_spec
    from minisweagent.models.litellm_model import LitellmModel

    from agentenv.harness.minisweagent import AgentenvEnvironment

    def bash_task(text: str, turn: int) -> str:
        if "42" in text.split("## Return of")[-1] and "## Return of" in text:
            return "Done." + scripted.tool_call("bash", {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; cat a"})
        return "THOUGHT: write it." + scripted.tool_call("bash", {"command": "echo 42 > a && cat a"})

    gw = gateway_for(bash_task)
    s = gw.gateway.open()
    model = LitellmModel(model_name="openai/k3-mini", cost_tracking="ignore_errors",
                         model_kwargs={"api_base": gw.openai_url(s), "api_key": s.key})
    env = AgentenvEnvironment(cwd="/tmp")
    try:
        agent = DefaultAgent(model, env, **(get_config_from_spec("default")["agent"] | {"step_limit": 5}))
        result = agent.run("Write 42 to a file named a.")
    finally:
        env.cleanup()
    assert result["exit_status"] == "Submitted" and result["submission"].strip() == "42", result
    summary = export.session_summary(s)
    assert summary["calls"] == 2 and summary["branches"] == 1 and summary["merge_rate"] == 1.0, summary


@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("stream", [False, True])
def test_the_openai_agents_sdk_runs_its_tool_loop_through_the_gateway(gw, api, stream):
    """The OpenAI Agents SDK, unmodified: an ``Agent`` with a function tool, run by its ``Runner`` (streamed and
    not) on either of its OpenAI models, against the gateway; the session is one merged branch."""
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)    # no trace export to OpenAI's servers
    looked: list[str] = []

    @function_tool
    def lookup(key: str) -> str:
        """Look a key up."""
        looked.append(key)
        return f"{key} = 42"

    s = gw.gateway.open()
    client = openai.AsyncOpenAI(base_url=gw.openai_url(s), api_key=s.key, max_retries=0)
    model = OpenAIChatCompletionsModel("gpt-4o", client) if api == "chat" else OpenAIResponsesModel("gpt-4o", client)
    agent = Agent(name="looker", instructions="Answer with the tool.", tools=[lookup], model=model)

    async def run() -> str:
        if not stream:
            return str((await Runner.run(agent, "a?")).final_output)
        streamed = Runner.run_streamed(agent, "a?")
        async for _ in streamed.stream_events():
            pass
        return str(streamed.final_output)

    assert asyncio.run(run()) == FINAL and looked == ["a"]
    one_merged_branch(s)
