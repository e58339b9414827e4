"""K3's chat format: render OpenAI-style messages (and tool declarations) into K3's template, and parse
generated assistant text back into content, ``<think>`` reasoning and OpenAI-style ``tool_calls``.

Rendering a parsed message reproduces the generated text byte for byte; malformed tool-call text is kept
as plain content with ``malformed=True`` and never raises.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARG_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
THINK_BEGIN, THINK_END = "<think>", "</think>"
IM_END, IM_MIDDLE = "<|im_end|>", "<|im_middle|>"
ROLE_TOKEN = {"system": "<|im_system|>", "user": "<|im_user|>", "assistant": "<|im_assistant|>", "tool": "<|im_system|>"}
_CALL = re.compile(re.escape(CALL_BEGIN) + r"(functions\.([A-Za-z0-9_\-.]+):(\d+))" + re.escape(ARG_BEGIN)
                   + r"(.*?)" + re.escape(CALL_END), re.DOTALL)


@dataclass
class AssistantMessage:
    """A parsed assistant turn; ``malformed`` marks tool-call text that could not be parsed."""

    content: str = ""
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    malformed: bool = False

    def to_openai(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": self.content or (None if self.tool_calls else "")}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        if self.reasoning_content is not None:
            msg["reasoning_content"] = self.reasoning_content
        return msg


def render_tool_calls(tool_calls: list[dict[str, Any]]) -> str:
    """The tool-call section for OpenAI-style ``tool_calls`` (ids are ``functions.NAME:IDX``)."""
    parts = [SECTION_BEGIN]
    for i, call in enumerate(tool_calls):
        fn = call["function"]
        call_id = call.get("id") or f"functions.{fn['name']}:{i}"
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


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


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
        if not isinstance(fn.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_\-.]{1,64}", fn["name"]):
            raise ValueError(f"tools[{i}].function.name must be 1-64 characters of [A-Za-z0-9_.-]")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
    return tools


def render_chat(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                add_generation_prompt: bool = True) -> str:
    """Render a conversation in K3's format, ending with the assistant header when generating."""
    out = ""
    if tools:
        out += "<|im_system|>tool_declare" + IM_MIDDLE + json.dumps(tools, ensure_ascii=False, separators=(",", ":")) + IM_END
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
        out += ROLE_TOKEN["assistant"] + "assistant" + IM_MIDDLE
    return out


def parse_assistant(text: str) -> AssistantMessage:
    """Split generated assistant text into reasoning, content and tool calls; never raises."""
    reasoning = None
    body = text
    if body.startswith(THINK_BEGIN) and THINK_END in body:
        reasoning, body = body[len(THINK_BEGIN):].split(THINK_END, 1)
    if SECTION_BEGIN not in body and not any(t in body for t in (SECTION_END, CALL_BEGIN, ARG_BEGIN, CALL_END)):
        return AssistantMessage(body, reasoning)
    content, _, section = body.partition(SECTION_BEGIN)
    calls, pos = [], 0
    inner = section[: -len(SECTION_END)] if section.endswith(SECTION_END) else None
    while inner is not None and pos < len(inner):
        m = _CALL.match(inner, pos)
        if m is None:
            break
        try:
            json.loads(m.group(4))
        except ValueError:
            break
        calls.append({"id": m.group(1), "type": "function", "function": {"name": m.group(2), "arguments": m.group(4)}})
        pos = m.end()
    if inner is None or pos != len(inner) or not calls or any(t in content for t in (SECTION_END, CALL_BEGIN, CALL_END)):
        return AssistantMessage(text, None, [], malformed=True)
    return AssistantMessage(content, reasoning, calls)
