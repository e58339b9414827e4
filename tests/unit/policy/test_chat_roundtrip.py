"""Property tests of K3's chat format (policy/chat.py): render -> parse -> render is byte-identical, lenient
forms parse like their canonical form, malformed text never raises, and K3's reference tool parser (mlx-lm's
``tool_parsers/kimi_k3.py``) reads what we render while we read what it reads."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.tool_parsers import kimi_k3 as mlx_kimi_k3

from policy.chat import (
    CHAT_TOKENS,
    IM_END,
    IM_MIDDLE,
    ROLE_TOKEN,
    TOOL_CALL_TOKENS,
    parse_assistant,
    render_assistant_body,
    render_chat,
    tool_spec,
)
from policy.tool_calls import ARG_END, CALL_END, JSON_BEGIN, JSON_END, OPEN, SECTION_BEGIN, SECTION_END, SEP

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


def _attr(v: str) -> str:
    return v.replace("&", "&amp;").replace('"', "&quot;")


_TYPES = {str: "string", bool: "boolean", int: "number", float: "number", list: "array", dict: "object"}


@st.composite
def lenient(draw: st.DrawFn) -> tuple[str, str]:
    """(lenient text, its canonical form) for an assistant turn with at least one tool call."""
    msg = draw(assistant_messages())
    calls = msg.get("tool_calls") or draw(tool_calls(min_calls=1))
    msg["tool_calls"] = calls
    ws = st.text(alphabet=" \t\n\r", max_size=3)
    section = [SECTION_BEGIN]
    for i, c in enumerate(calls):
        name = c["function"]["name"]
        index = c["id"].rsplit(":", 1)[1]
        head = f'call tool="{name}"'
        if index != str(i) or draw(st.booleans()):  # the position is the default index
            head = f'call index="{index}" tool="{name}"' if draw(st.booleans()) else f'{head} index="{index}"'
        section += [draw(ws), OPEN, head, draw(ws), SEP]
        values = json.loads(c["function"]["arguments"])
        if draw(st.booleans()):   # typed arguments, one block each: the arguments become json.dumps of them
            c["function"]["arguments"] = json.dumps(values, ensure_ascii=False)
            for k, v in values.items():
                kind = "null" if v is None else _TYPES[type(v)]
                typed = f' type="{kind}"' if kind != "string" or draw(st.booleans()) else ""
                section += [draw(ws), OPEN, f'argument key="{_attr(k)}"{typed}', SEP,
                            v if kind == "string" else json.dumps(v), ARG_END]
        else:
            opener = JSON_BEGIN if draw(st.booleans()) else f"{OPEN}json{SEP}"
            section += [draw(ws), opener, draw(ws), c["function"]["arguments"], draw(ws), JSON_END]
        section += [draw(ws), CALL_END]
    if draw(st.booleans()):
        section += [draw(ws), SECTION_END]
    section.append(draw(ws))
    canonical = render_assistant_body(msg)
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


def _first_args(t: str, new: str) -> str:
    """``t`` with the arguments of its first call replaced by ``new`` (``{}`` in it stands for the old ones)."""
    i = t.index(JSON_BEGIN) + len(JSON_BEGIN)
    j = t.index(JSON_END, i)
    return t[:i] + new.replace("{}", t[i:j]) + t[j:]


_breakers = st.sampled_from([
    lambda t: t + "x",                                              # text after the section
    lambda t: t + SECTION_END,                                      # a second section end
    lambda t: t.replace(CALL_END, "", 1),                           # a call without its end
    lambda t: t.replace(JSON_END, "", 1),                           # arguments without their end
    lambda t: t.replace(JSON_BEGIN, "", 1),                         # arguments without their block
    lambda t: t.replace(CALL_END, CALL_END + "x", 1),               # text between calls
    lambda t: _first_args(t, "[{}]"),                               # arguments that are not an object
    lambda t: _first_args(t, "42"),
    lambda t: _first_args(t, "{}}"),                                # or not JSON
    lambda t: _first_args(t, ""),
    lambda t: t.replace(' index="', ' index="x', 1),                # an index that is not a number
    lambda t: t.replace(' index="', ' colour="red" index="', 1),    # an unknown attribute
    lambda t: t.replace(' index="', ' tool="again" index="', 1),    # an attribute twice
    lambda t: t.replace('call tool="', 'call name="', 1),           # no tool name
    lambda t: t.replace('call tool="', 'call tool="a b', 1),        # a tool name that cannot be one
    lambda t: t.replace(SECTION_BEGIN, CALL_END + SECTION_BEGIN, 1),  # a section token in the content
    lambda t: t.replace(SECTION_BEGIN, f"{OPEN}tool{SEP}", 1),      # a section that is not one
    lambda t: t[: t.index(SECTION_BEGIN) + len(SECTION_BEGIN)],     # an empty section
    lambda t: t[: t.index(SECTION_BEGIN) + len(SECTION_BEGIN)] + SECTION_END,
    lambda t: t.replace(JSON_BEGIN, f'{OPEN}json type="array"{SEP}', 1),  # arguments of another type
])


@SETTINGS
@given(assistant_messages(), tool_calls(min_calls=1), _breakers)
def test_malformed_text_never_raises_and_is_kept_as_content(msg, calls, breaker):
    msg["tool_calls"] = calls
    text = breaker(render_assistant_body(msg))
    got = parse_assistant(text)
    assert got.malformed and got.tool_calls == [] and got.content == text and got.reasoning_content is None


_soup = st.lists(st.one_of(st.sampled_from(CHAT_TOKENS + ("tools", "call", ' tool="f"', ' index="0"', "json", "argument",
                                                         ' key="k"', ' type="number"', "1", "{}", '{"a": [1]}', "[]",
                                                         " ")),
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


def _as_reference(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])} for c in calls]


@SETTINGS
@given(assistant_messages(), tool_calls(min_calls=1))
def test_the_reference_parser_reads_what_we_render(msg, calls):
    msg["tool_calls"] = calls
    assert mlx_kimi_k3.parse_tool_call(render_assistant_body(msg)) == _as_reference(calls)


@SETTINGS
@given(lenient())
def test_we_read_what_the_reference_parser_reads(pair):
    variant, _ = pair   # K3's other spellings: typed arguments, attributes in any order, blanks between blocks
    ours = parse_assistant(variant)
    assert not ours.malformed
    assert _as_reference(ours.tool_calls) == mlx_kimi_k3.parse_tool_call(variant)
