"""The envs and the policy read K3 tool-call text the same way.

For any assistant text, an env runs tool calls exactly when ``policy.chat.parse_assistant`` returns calls
and does not flag the text malformed — the same calls, in order, up to one that ends the episode — and
answers with an error observation (running nothing) exactly when it is malformed or has no calls. So a
completion that the policy server reports as ``malformed_tool_calls`` is never executed or scored.
(Plain JSON text, ``{"name": ..., "arguments": ...}``, is a separate action form for scripts, and is left out.)
"""

from __future__ import annotations

import json

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from envs.tool_env import ToolEnv
from policy.chat import THINK_BEGIN, THINK_END, parse_assistant
from policy.tool_calls import (
    ARG_END,
    CALL_END,
    CLOSE,
    JSON_BEGIN,
    JSON_END,
    OPEN,
    SECTION_BEGIN,
    SECTION_END,
    SEP,
)

from .fakes import FakeBackend

ENDING = "answer"  # ToolEnv's tool that ends the episode


def section(*calls: str, end: str = SECTION_END) -> str:
    return SECTION_BEGIN + "".join(calls) + end


def head(name: str, index: int | str | None = None) -> str:
    return OPEN + f'call tool="{name}"' + ("" if index is None else f' index="{index}"') + SEP


def call(name: str, args: str, index: int | str | None = 0) -> str:
    return head(name, index) + JSON_BEGIN + args + JSON_END + CALL_END


def typed(key: str, value: str, kind: str = "string") -> str:
    return OPEN + f'argument key="{key}" type="{kind}"' + SEP + value + ARG_END


CALC = '{"expression": "6 * 7"}'
CASES = [
    "Plain answer.",
    "<think>let me think</think>The answer is 4.",
    "<think></think>",
    "",
    "Calling." + section(call("calculator", CALC), call("python", '{"code": "print(1)"}', 1)),
    "<think>t</think>" + section(call("x.y-z", "{}", 7)),
    section(call("calculator", CALC), call("answer", '{"answer": "42"}', 1), call("calculator", CALC, 2)),
    # lenient: no index, blanks between blocks and around the arguments, typed arguments, no section end at the end
    section(call("calculator", CALC, None), call("answer", '{"answer": "42"}', None)),
    section("\n " + call("calculator", f"\n {CALC} \n", 3) + "\n"),
    section(head("calculator") + typed("expression", "6 * 7") + CALL_END),
    section(head("answer") + typed("answer", "42", "number") + CALL_END),
    section(call("calculator", CALC), end=""),
    # malformed
    section(call("f", "{bad json")),
    SECTION_BEGIN + head("f") + JSON_BEGIN + "{}",
    "text" + CALL_END,
    section(call("two words", "{}")),
    section(),
    section(call("calculator", "[1, 2]")),
    section(call("calculator", CALC)) + " trailing prose",
    section(call("calculator", CALC, "x")),
    section(head("answer") + typed("answer", "forty", "number") + CALL_END),
    "prose " + CALL_END + section(call("calculator", CALC)),
    SECTION_BEGIN + head("bash") + CALL_END + JSON_END + SECTION_END,
    section(call("calculator", CALC), end=SECTION_END + SECTION_END),
]


@pytest.fixture(scope="module")
def env():
    backend = FakeBackend()
    with ToolEnv(task="calc-001", api=backend) as e:
        yield e
    assert backend.sandboxes == {}


def plain_json(text: str) -> bool:
    return text.lstrip().startswith("{")


def check_agreement(env: ToolEnv, text: str) -> None:
    msg = parse_assistant(text)
    env.reset()
    obs, reward, terminated, _, info = env.step(text)
    if msg.malformed or not msg.tool_calls:
        assert info["calls"] == [] and info["error"] and obs.startswith("Error: "), (text, obs)
        assert ("malformed" in obs) == msg.malformed and reward == 0.0 and not terminated
        return
    ran = [(c["id"], c["name"]) for c in info["calls"]]
    parsed = [(c["id"], c["function"]["name"]) for c in msg.tool_calls]
    assert ran and ran == parsed[: len(ran)], (text, ran, parsed)
    # every call ran, or the calls stopped after one that ended the episode
    ended = ran[-1][1] == ENDING and not info["calls"][-1]["error"]
    assert terminated == ended and (len(ran) == len(parsed) or ended)
    for result, call in zip(env.toolbox.run(text).calls, msg.tool_calls, strict=False):
        if not result.error:
            assert result.arguments == json.loads(call["function"]["arguments"])


@pytest.mark.parametrize("text", CASES)
def test_the_env_runs_exactly_what_the_policy_parses(env, text):
    assert not plain_json(text)
    check_agreement(env, text)


PIECES = st.sampled_from([SECTION_BEGIN, SECTION_END, OPEN, SEP, CLOSE, "call", ' tool="calculator"',
                          ' tool="answer"', ' index="0"', "json", JSON_BEGIN, JSON_END, CALL_END, THINK_BEGIN,
                          THINK_END, "no_such_tool", " ", "\n", CALC, '{"answer": "42"}', '{"query": "port"}', "{}",
                          "[1]", "{bad", '"s"', "hello", "."])


@st.composite
def messages(draw: st.DrawFn) -> str:
    """Near-canonical assistant messages, sometimes with one piece dropped, doubled or swapped."""
    calls = draw(st.lists(st.tuples(st.sampled_from(["calculator", "answer", "search", "bad name", "x.y"]),
                                    st.sampled_from([None, 0, 1, "x", " "]),
                                    st.sampled_from([CALC, '{"answer": "42"}', "{}", " {} ", "[]", "{oops", "1"])),
                          max_size=3))
    parts = [draw(st.sampled_from(["", "Sure. ", f"{THINK_BEGIN}hm{THINK_END}"])), SECTION_BEGIN]
    for name, index, args in calls:
        parts += [head(name, index), JSON_BEGIN, args, JSON_END, CALL_END]
    parts.append(draw(st.sampled_from([SECTION_END, SECTION_END, "", SECTION_END + "x"])))
    if parts and draw(st.booleans()):
        i = draw(st.integers(0, len(parts) - 1))
        parts[i] = draw(st.sampled_from(["", parts[i] * 2, CALL_END, JSON_END]))
    return "".join(parts)


@settings(max_examples=300, deadline=None)
@given(text=st.one_of(messages(), st.lists(PIECES, max_size=12).map("".join), st.text(max_size=40)))
def test_generated_messages_agree(env, text):
    assume(not plain_json(text))
    check_agreement(env, text)
