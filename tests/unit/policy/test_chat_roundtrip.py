"""Property tests of K3's chat format (policy/chat.py): render -> parse -> render is byte-identical, lenient
forms parse like their canonical form, and malformed text never raises."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policy.chat import (
    ARG_BEGIN,
    CALL_BEGIN,
    CALL_END,
    CHAT_TOKENS,
    IM_END,
    IM_MIDDLE,
    ROLE_TOKEN,
    SECTION_BEGIN,
    SECTION_END,
    TOOL_CALL_TOKENS,
    parse_assistant,
    render_assistant_body,
    render_chat,
    tool_spec,
)

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# text that contains no control token, but may contain pieces of one ("<|", "think>", ...)
_pieces = st.sampled_from(["<", "|", ">", "<|", "|>", "think", "functions.", ":", "{", "}", "\n", " ", "\t"])
text = st.lists(st.one_of(st.text(max_size=8), _pieces), max_size=6).map("".join).filter(
    lambda s: not any(t in s for t in CHAT_TOKENS))
names = st.one_of(st.from_regex(r"[A-Za-z0-9_.\-]{1,64}", fullmatch=True),
                  st.from_regex(r"functions\.[A-Za-z0-9_.\-]{1,54}", fullmatch=True))
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3), max_leaves=8)
json_objects = st.dictionaries(text, json_values, max_size=4)


@st.composite
def arguments(draw: st.DrawFn) -> str:
    """JSON-object text as a model or a client may write it (no surrounding whitespace)."""
    obj = draw(json_objects)
    indent = draw(st.sampled_from([None, None, 2]))
    return json.dumps(obj, ensure_ascii=draw(st.booleans()), indent=indent)


@st.composite
def tool_calls(draw: st.DrawFn, min_calls: int = 0, max_calls: int = 3) -> list[dict[str, Any]]:
    calls = []
    for i in range(draw(st.integers(min_calls, max_calls))):
        name = draw(names)
        index = draw(st.one_of(st.just(i), st.integers(0, 99)))
        calls.append({"id": f"functions.{name}:{index}", "type": "function",
                      "function": {"name": name, "arguments": draw(arguments())}})
    return calls


@st.composite
def assistant_messages(draw: st.DrawFn) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": draw(text)}
    if draw(st.booleans()):
        msg["reasoning_content"] = draw(text)
    calls = draw(tool_calls())
    if calls:
        msg["tool_calls"] = calls
    return msg


@st.composite
def conversations(draw: st.DrawFn) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(text)})
    for _ in range(draw(st.integers(1, 4))):
        msgs.append({"role": "user", "content": draw(text)})
        reply = draw(assistant_messages())
        msgs.append(reply)
        msgs += [{"role": "tool", "tool_call_id": c["id"], "content": draw(text)} for c in reply.get("tool_calls", [])]
    return msgs


tools = st.lists(st.builds(lambda n, d: tool_spec(n, d, {"x": {"type": "string"}}, ["x"]), names, text), max_size=3)


def _split(rendered: str) -> list[tuple[str, str]]:
    """(role token + name, body) of each message of a rendered conversation."""
    assert rendered.endswith(IM_END)
    out = []
    for part in rendered[: -len(IM_END)].split(IM_END):
        head, middle, body = part.partition(IM_MIDDLE)
        assert middle and head.startswith(tuple(ROLE_TOKEN.values()))
        out.append((head, body))
    return out


@SETTINGS
@given(conversations(), tools)
def test_render_parse_render_is_byte_identical(msgs, decls):
    rendered = render_chat(msgs, decls, add_generation_prompt=False)
    parts = _split(rendered)
    offset = 1 if decls else 0
    assert len(parts) == len(msgs) + offset
    reparsed = []
    for m, (head, body) in zip(msgs, parts[offset:], strict=True):
        if m["role"] != "assistant":
            reparsed.append(m)
            continue
        assert head == "<|im_assistant|>assistant"
        parsed = parse_assistant(body)
        assert not parsed.malformed
        assert parsed.content == m["content"] and parsed.reasoning_content == m.get("reasoning_content")
        assert parsed.tool_calls == m.get("tool_calls", [])
        assert render_assistant_body(parsed.to_openai()) == body
        reparsed.append(parsed.to_openai())
    assert render_chat(reparsed, decls, add_generation_prompt=False) == rendered


@st.composite
def lenient(draw: st.DrawFn) -> tuple[str, str]:
    """(lenient text, its canonical form) for an assistant turn with at least one tool call."""
    msg = draw(assistant_messages())
    calls = msg.get("tool_calls") or draw(tool_calls(min_calls=1))
    msg["tool_calls"] = calls
    canonical = render_assistant_body(msg)
    ws = st.text(alphabet=" \t\n\r", max_size=3)
    section = [SECTION_BEGIN]
    for i, c in enumerate(calls):
        name = c["function"]["name"]
        call_id = c["id"]
        if call_id.endswith(f":{i}") and draw(st.booleans()):  # the position is the default index
            call_id = call_id.removesuffix(f":{i}")
        if not name.startswith("functions.") and draw(st.booleans()):  # else the prefix is needed
            call_id = call_id.removeprefix("functions.")
        section += [CALL_BEGIN, draw(ws), call_id, draw(ws), ARG_BEGIN, draw(ws), c["function"]["arguments"],
                    draw(ws), CALL_END]
    if draw(st.booleans()):
        section.append(SECTION_END)
    prefix = canonical[: canonical.index(SECTION_BEGIN)]
    return prefix + "".join(section), canonical


@SETTINGS
@given(lenient())
def test_lenient_forms_parse_like_the_canonical_form(pair):
    variant, canonical = pair
    got, want = parse_assistant(variant), parse_assistant(canonical)
    assert not got.malformed and not want.malformed
    assert got == want
    assert render_assistant_body(got.to_openai()) == canonical


def _swap(t: str, a: str, b: str) -> str:
    """``t`` with its first ``a`` and the first ``b`` after it swapped."""
    i = t.index(a)
    j = t.index(b, i)
    return t[:i] + b + t[i + len(a):j] + a + t[j + len(b):]


def _first_args(t: str, new: str) -> str:
    """``t`` with the arguments of its first call replaced by ``new`` (``{}`` in it stands for the old ones)."""
    i = t.index(ARG_BEGIN) + len(ARG_BEGIN)
    j = t.index(CALL_END, i)
    return t[:i] + new.replace("{}", t[i:j]) + t[j:]


_breakers = st.sampled_from([
    lambda t: t + "x",                                              # text after the section
    lambda t: t + SECTION_END,                                      # a second section end
    lambda t: t.replace(ARG_BEGIN, "", 1),                          # a call without its argument token
    lambda t: t.replace(CALL_END, "", 1),                           # a call without its end
    lambda t: t.replace(CALL_BEGIN, "", 1),                         # arguments without a call
    lambda t: _first_args(t, "[{}]"),                               # arguments that are not an object
    lambda t: _first_args(t, "42"),
    lambda t: _first_args(t, "{}}"),                                # or not JSON
    lambda t: _first_args(t, ""),
    lambda t: t.replace(CALL_BEGIN, CALL_BEGIN + "functions.a b:0" + ARG_BEGIN + "{}" + CALL_END + CALL_BEGIN, 1),
    lambda t: _swap(t, CALL_BEGIN, ARG_BEGIN),                     # tokens out of order
    lambda t: _swap(t, ARG_BEGIN, CALL_END),
    lambda t: t.replace(SECTION_BEGIN, CALL_END + SECTION_BEGIN, 1),  # a token in the content
    lambda t: t[: t.index(SECTION_BEGIN) + len(SECTION_BEGIN)],     # an empty section
    lambda t: t[: t.index(SECTION_BEGIN) + len(SECTION_BEGIN)] + SECTION_END,
])


@SETTINGS
@given(assistant_messages(), tool_calls(min_calls=1), _breakers)
def test_malformed_text_never_raises_and_is_kept_as_content(msg, calls, breaker):
    msg["tool_calls"] = calls
    text = breaker(render_assistant_body(msg))
    got = parse_assistant(text)
    assert got.malformed and got.tool_calls == [] and got.content == text and got.reasoning_content is None


_soup = st.lists(st.one_of(st.sampled_from(CHAT_TOKENS + ("functions.f:0", "f", "{}", '{"a": [1]}', "[]", " ")),
                           st.text(max_size=4)), max_size=14).map("".join)


@SETTINGS
@given(_soup)
def test_any_text_parses_without_raising_and_normalising_is_idempotent(t):
    got = parse_assistant(t)
    if got.malformed:
        assert got.tool_calls == [] and got.content == t and got.reasoning_content is None
        return
    again = render_assistant_body(got.to_openai())
    assert parse_assistant(again) == got
    assert render_assistant_body(parse_assistant(again).to_openai()) == again
    if not any(tok in t for tok in TOOL_CALL_TOKENS):
        assert again == t  # text without a tool call is never rewritten
