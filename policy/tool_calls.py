"""K3's tool-call section, in the XTML form that K3's own parsers read (mlx-lm's ``tool_parsers/kimi_k3.py``; vLLM's ``kimi_k3`` parser).
``<|open|>``, ``<|sep|>`` and ``<|close|>`` are control tokens, the tag names and attributes between them text.
The canonical section that ``tool_call_pieces`` writes (shown on several lines; it has no line breaks)::

    <|open|>tools<|sep|>
    <|open|>call tool="NAME" index="IDX"<|sep|><|open|>json type="object"<|sep|>{"json": "object"}<|close|>json<|sep|><|close|>call<|sep|>
    ... one such call per tool call ...
    <|close|>tools<|sep|>

A call's OpenAI id is ``functions.NAME:IDX``: K3's format carries a name and an index, not an id, so the template
writes the index of a canonical id (the call's position for any other id) and a tool result names the canonical
id of the call it answers.

Lenient input (the only policy; the server and the envs both follow it through ``parse_assistant``):

* accepted:
    - arguments as typed ``<|open|>argument key="K" type="T"<|sep|>VALUE<|close|>argument<|sep|>`` blocks (a
      ``string`` value is raw text, any other type JSON), instead of the one JSON block; they become the JSON
      object's text (``json.dumps``);
    - a call without ``index`` (the index is then the call's position in the message, from 0), and a call with no
      arguments (``{}``);
    - whitespace between the section's blocks, and around the JSON arguments (which are kept stripped);
    - a missing ``<|close|>tools<|sep|>`` at the very end of the text (generation stopped there).
* anything else makes the whole message malformed: JSON arguments that are not a JSON *object* (invalid JSON,
  a list or a number), a typed value that does not parse as its type, a repeated key, an unknown attribute, text
  after the section or between its blocks, a call not closed by ``<|close|>call<|sep|>``, an empty section, a tool
  name not of ``[A-Za-z0-9_.-]``, an index that is not a number, section tokens in the content.
  Section tokens inside the JSON arguments are data (only ``<|close|>json<|sep|>`` ends them; in a typed
  argument, ``<|close|>argument<|sep|>``).

Standard library only, as ``policy.chat`` (which renders and parses whole turns with it) and the envs read it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from policy.pieces import Control, Piece

# K3's control tokens (each one token in the tokenizer, see policy/tokenizer.py)
OPEN, SEP, CLOSE = "<|open|>", "<|sep|>", "<|close|>"      # XTML: <|open|>TAG ATTRS<|sep|> ... <|close|>TAG<|sep|>
TOOL_CALL_TOKENS = (OPEN, SEP, CLOSE)
# The section's fixed strings, as text (control tokens spelled out)
SECTION_BEGIN, SECTION_END = f"{OPEN}tools{SEP}", f"{CLOSE}tools{SEP}"
JSON_BEGIN, JSON_END = f'{OPEN}json type="object"{SEP}', f"{CLOSE}json{SEP}"
CALL_END, ARG_END = f"{CLOSE}call{SEP}", f"{CLOSE}argument{SEP}"
FUNCTION_PREFIX = "functions."
TOOL_NAME = re.compile(r"[A-Za-z0-9_\-.]{1,64}")  # what a declared tool's name may be

_CANONICAL_ID = re.compile(r"functions\.([A-Za-z0-9_\-.]+):(\d+)")
_ATTR = re.compile(r'\s+(\w+)="([^"]*)"')


def _block(tag: str) -> re.Pattern[str]:
    """``<|open|>TAG ATTRS<|sep|>`` at a position, with optional whitespace before it; group 1: the attributes."""
    return re.compile(r"\s*" + re.escape(OPEN) + tag + r'((?:\s+\w+="[^"]*")*)\s*' + re.escape(SEP))


_CALL_OPEN, _JSON_OPEN, _ARG_OPEN = _block("call"), _block("json"), _block("argument")
_CALL_CLOSE = re.compile(r"\s*" + re.escape(CALL_END))


def call_index(call: dict[str, Any], position: int) -> int:
    """The index K3's template writes for an OpenAI-style call: that of a canonical id ``functions.NAME:IDX`` of
    the call's own function, else the call's position in its message."""
    m = _CANONICAL_ID.fullmatch(str(call.get("id") or ""))
    return int(m.group(2)) if m and m.group(1) == call["function"]["name"] else position


def canonical_id(name: str, index: int) -> str:
    """A call's OpenAI id, ``functions.NAME:IDX``."""
    return f"{FUNCTION_PREFIX}{name}:{index}"


def _attr(value: object) -> str:
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def call_head(name: str, index: int | None) -> str:
    """The text between ``<|open|>`` and ``<|sep|>`` that opens a call: ``call tool="NAME" index="IDX"``."""
    return f'call tool="{_attr(name)}"' + ("" if index is None else f' index="{index}"')


def block(tag: str) -> list[Piece]:
    """``<|open|>TAG<|sep|>``, a block's opening, as pieces (``tag`` with its attributes)."""
    return [Control(OPEN), tag, Control(SEP)]


def end(tag: str) -> list[Piece]:
    """``<|close|>TAG<|sep|>``, a block's end, as pieces."""
    return [Control(CLOSE), tag, Control(SEP)]


def call_opening(name: str, index: int) -> list[Piece]:
    """A call of ``name`` opened up to its JSON arguments: the pieces a named ``tool_choice`` forces too."""
    return [*block(call_head(name, index)), *block('json type="object"')]


def tool_call_pieces(tool_calls: list[dict[str, Any]]) -> list[Piece]:
    """The tool-call section for OpenAI-style ``tool_calls`` (index as ``call_index`` says); arguments given as a
    dict are written as JSON, a string as it is."""
    parts = block("tools")
    for i, call in enumerate(tool_calls):
        fn = call["function"]
        args = fn.get("arguments", "{}")
        parts += [*call_opening(fn["name"], call_index(call, i)), args if isinstance(args, str) else json.dumps(args),
                  *end("json"), *end("call")]
    return parts + end("tools")


def parse_section(section: str) -> list[dict[str, Any]] | None:
    """The calls of a tool-call section (the text after ``<|open|>tools<|sep|>``), None if malformed."""
    inner = section.rstrip()
    inner = inner.removesuffix(SECTION_END).rstrip()  # a missing section end at the very end is accepted
    calls: list[dict[str, Any]] = []
    pos = 0
    while pos < len(inner):
        head = _CALL_OPEN.match(inner, pos)
        attrs = _attrs(head.group(1), {"tool"}, {"index"}) if head else None
        if head is None or attrs is None:
            return None
        parsed = _arguments(inner, head.end())
        if parsed is None:
            return None
        args, pos = parsed
        name = attrs["tool"]
        index = attrs.get("index", str(len(calls)))
        if not TOOL_NAME.fullmatch(name) or not (index.isascii() and index.isdigit()):
            return None
        calls.append({"id": canonical_id(name, int(index)), "type": "function",
                      "function": {"name": name, "arguments": args}})
    return calls or None


def _attrs(text: str, required: set[str], optional: set[str]) -> dict[str, str] | None:
    """An XTML block's attributes (``&quot;`` and ``&amp;`` unescaped); None when one is missing, unknown or twice."""
    found = [(k, v.replace("&quot;", '"').replace("&amp;", "&")) for k, v in _ATTR.findall(text)]
    attrs = dict(found)
    if len(attrs) < len(found) or not required <= attrs.keys() <= required | optional:
        return None
    return attrs


def _arguments(inner: str, pos: int) -> tuple[str, int] | None:
    """A call's arguments from ``pos`` to its ``<|close|>call<|sep|>``: the JSON object's text and the position after
    the call, or None when malformed."""
    block = _JSON_OPEN.match(inner, pos)
    if block is not None:
        end = inner.find(JSON_END, block.end())
        if end < 0 or _attrs(block.group(1), set(), {"type"}) not in ({}, {"type": "object"}):
            return None
        args = inner[block.end():end].strip()
        try:
            if not isinstance(json.loads(args), dict):
                return None
        except (ValueError, RecursionError):
            return None
        close = _CALL_CLOSE.match(inner, end + len(JSON_END))
        return (args, close.end()) if close else None
    values: dict[str, Any] = {}
    while (close := _CALL_CLOSE.match(inner, pos)) is None:
        arg = _ARG_OPEN.match(inner, pos)
        attrs = _attrs(arg.group(1), {"key"}, {"type"}) if arg else None
        end = inner.find(ARG_END, arg.end()) if arg else -1
        if arg is None or attrs is None or end < 0 or attrs["key"] in values:
            return None
        raw = inner[arg.end():end]
        if attrs.get("type", "string") == "string":
            values[attrs["key"]] = raw
        else:
            try:
                values[attrs["key"]] = json.loads(raw)
            except (ValueError, RecursionError):
                return None
        pos = end + len(ARG_END)
    return json.dumps(values, ensure_ascii=False), close.end()
