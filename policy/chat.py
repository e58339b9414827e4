"""Kimi K3's chat and tool-call format: the one implementation that the policy server and the envs share.

Standard library only, so ``from policy import chat`` is cheap (``policy/__init__.py`` loads the model lazily).

It renders OpenAI-style messages and tool declarations in K3's template (``render_chat``), parses generated
assistant text back into content, ``<think>`` reasoning and OpenAI-style ``tool_calls`` (``parse_assistant``),
and declares tools (``tool_spec``, ``validate_tools``).

An assistant turn is ``[<think>REASONING</think>]CONTENT[SECTION]``, where the canonical tool-call SECTION is
what ``render_tool_calls`` emits (shown on several lines; it has no line breaks)::

    <|tool_calls_section_begin|>
    <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{"json": "object"}<|tool_call_end|>
    ... one such call per tool call ...
    <|tool_calls_section_end|>

Lenient input (the only policy; the server and the envs both follow it through ``parse_assistant``):

* accepted, and normalised to the canonical id ``functions.NAME:IDX``:
    - a call id without the ``functions.`` prefix (``NAME:IDX``); one leading ``functions.`` is always read
      as the prefix, so a tool whose own name starts with ``functions.`` needs the canonical id;
    - a call id without ``:IDX`` (the index is then the call's position in the message, from 0);
    - whitespace around the call id and around the arguments (arguments are kept stripped);
    - a missing ``<|tool_calls_section_end|>`` at the very end of the text (generation stopped there).
* anything else makes the whole message malformed: arguments that are not a JSON *object* (invalid JSON,
  a JSON list or number), text after the section, a call without ``<|tool_call_argument_begin|>`` or
  without ``<|tool_call_end|>``, an empty section, a call id that is not ``[functions.]NAME[:IDX]`` with
  NAME of ``[A-Za-z0-9_.-]``, tool-call tokens out of order or in the content. A malformed message comes
  back as ``AssistantMessage(content=text, tool_calls=[], malformed=True)``; parsing never raises.
  Tool-call tokens inside a JSON string of the arguments are data (only ``<|tool_call_end|>`` ends them).

Canonical text round-trips byte for byte: ``render_assistant_body(parse_assistant(t).to_openai()) == t`` for
every ``t`` that the renderer produced; lenient text parses to the same message as its canonical form.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

# K3's control tokens (each one token in the tokenizer, see policy/tokenizer.py)
SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARG_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
THINK_BEGIN, THINK_END = "<think>", "</think>"
IM_SYSTEM, IM_USER, IM_ASSISTANT = "<|im_system|>", "<|im_user|>", "<|im_assistant|>"
IM_MIDDLE, IM_END = "<|im_middle|>", "<|im_end|>"
ROLE_TOKEN = {"system": IM_SYSTEM, "user": IM_USER, "assistant": IM_ASSISTANT, "tool": IM_SYSTEM}
TOOL_CALL_TOKENS = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARG_BEGIN, CALL_END)
CHAT_TOKENS = (IM_SYSTEM, IM_USER, IM_ASSISTANT, IM_MIDDLE, IM_END, *TOOL_CALL_TOKENS, THINK_BEGIN, THINK_END)
# What a generation continues after (the end of ``render_chat(..., add_generation_prompt=True)``).
GENERATION_PROMPT = IM_ASSISTANT + "assistant" + IM_MIDDLE
FUNCTION_PREFIX = "functions."
TOOL_NAME = re.compile(r"[A-Za-z0-9_\-.]{1,64}")  # what a declared tool's name may be

_CALL = re.compile(re.escape(CALL_BEGIN) + r"(.*?)" + re.escape(ARG_BEGIN) + r"(.*?)" + re.escape(CALL_END),
                   re.DOTALL)
_CALL_ID = re.compile(r"(?:functions\.)?([A-Za-z0-9_\-.]+)(?::(\d+))?")


@dataclass
class AssistantMessage:
    """A parsed assistant turn; ``malformed`` marks tool-call text that could not be parsed.

    ``tool_calls`` are OpenAI-style ``{"id": "functions.NAME:IDX", "type": "function", "function":
    {"name": NAME, "arguments": "<JSON object text>"}}``; the arguments always parse to a JSON object.
    """

    content: str = ""
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    malformed: bool = False

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI chat ``message`` (content is None when there are tool calls and no text)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content or (None if self.tool_calls else "")}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        if self.reasoning_content is not None:
            msg["reasoning_content"] = self.reasoning_content
        return msg


def tool_spec(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    """An OpenAI-style function declaration taking a JSON object with ``properties`` (no others allowed)."""
    if not TOOL_NAME.fullmatch(name):
        raise ValueError(f"a tool name must be 1-64 characters of [A-Za-z0-9_.-], got {name!r}")
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required, "additionalProperties": False}}}


def validate_tools(tools: Any) -> list[dict[str, Any]]:
    """Check OpenAI-style tool declarations; raises ValueError with a reason when malformed."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ValueError("tools must be a list")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        if not isinstance(fn.get("name"), str) or not TOOL_NAME.fullmatch(fn["name"]):
            raise ValueError(f"tools[{i}].function.name must be 1-64 characters of [A-Za-z0-9_.-]")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
    return tools


def render_tool_calls(tool_calls: list[dict[str, Any]]) -> str:
    """The tool-call section for OpenAI-style ``tool_calls``.

    A call's id is written as given (K3's template does the same), ``functions.NAME:IDX`` when it has none;
    arguments given as a dict are written as JSON.
    """
    parts = [SECTION_BEGIN]
    for i, call in enumerate(tool_calls):
        fn = call["function"]
        call_id = call.get("id") or f"{FUNCTION_PREFIX}{fn['name']}:{i}"
        args = fn.get("arguments", "{}")
        parts += [CALL_BEGIN, call_id, ARG_BEGIN, args if isinstance(args, str) else json.dumps(args), CALL_END]
    return "".join(parts + [SECTION_END])


def render_assistant_body(msg: dict[str, Any]) -> str:
    """The text of an assistant turn after ``<|im_middle|>`` and before ``<|im_end|>``."""
    out = ""
    if msg.get("reasoning_content") is not None:
        out += THINK_BEGIN + msg["reasoning_content"] + THINK_END
    out += _text(msg.get("content"))
    if msg.get("tool_calls"):
        out += render_tool_calls(msg["tool_calls"])
    return out


def render_chat(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                add_generation_prompt: bool = True) -> str:
    """Render a conversation in K3's format, ending with the assistant header when generating."""
    out = ""
    if tools:
        out += IM_SYSTEM + "tool_declare" + IM_MIDDLE + json.dumps(tools, ensure_ascii=False, separators=(",", ":")) + IM_END
    for m in messages:
        role = m.get("role")
        if role not in ROLE_TOKEN:
            raise ValueError(f"unknown message role {role!r}")
        if role == "tool":
            body = f"## Return of {m.get('tool_call_id', '')}\n" + _text(m.get("content"))
        elif role == "assistant":
            body = render_assistant_body(m)
        else:
            body = _text(m.get("content"))
        out += ROLE_TOKEN[role] + str(m.get("name") or role) + IM_MIDDLE + body + IM_END
    if add_generation_prompt:
        out += GENERATION_PROMPT
    return out


def parse_assistant(text: str) -> AssistantMessage:
    """Split generated assistant text into reasoning, content and tool calls (lenient input as the module
    docstring says); never raises."""
    reasoning = None
    body = text
    if body.startswith(THINK_BEGIN) and THINK_END in body:
        reasoning, body = body[len(THINK_BEGIN):].split(THINK_END, 1)
    if not any(t in body for t in TOOL_CALL_TOKENS):
        return AssistantMessage(body, reasoning)
    content, _, section = body.partition(SECTION_BEGIN)
    calls = None if any(t in content for t in TOOL_CALL_TOKENS) else _parse_section(section)
    if not calls:
        return AssistantMessage(text, None, [], malformed=True)
    return AssistantMessage(content, reasoning, calls)


def _parse_section(section: str) -> list[dict[str, Any]] | None:
    """The calls of a tool-call section (the text after ``<|tool_calls_section_begin|>``), None if malformed."""
    inner = section.removesuffix(SECTION_END)  # a missing section end at the very end is accepted
    calls: list[dict[str, Any]] = []
    pos = 0
    while pos < len(inner):
        m = _CALL.match(inner, pos)
        if m is None:
            return None
        call = _call(m.group(1), m.group(2), len(calls))
        if call is None:
            return None
        calls.append(call)
        pos = m.end()
    return calls


def _call(raw_id: str, raw_args: str, position: int) -> dict[str, Any] | None:
    """One OpenAI-style tool call with its canonical id, or None when the id or the arguments are malformed."""
    ident = _CALL_ID.fullmatch(raw_id.strip())
    if ident is None:
        return None
    name, index = ident.group(1), ident.group(2)
    args = raw_args.strip()
    try:
        if not isinstance(json.loads(args), dict):
            return None
    except (ValueError, RecursionError):
        return None
    call_id = f"{FUNCTION_PREFIX}{name}:{position if index is None else index}"
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)
