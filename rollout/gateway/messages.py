"""The gateway's neutral types: one request and one answer, whichever API the harness spoke.

Every API adapter (``openai_chat``, ``responses``, ``anthropic``) reads its request into a ``Call``: the history as
K3-ready OpenAI-chat messages (``system`` / ``user`` / ``assistant`` with ``tool_calls`` and ``reasoning_content`` /
``tool``), the tool declarations, ``tool_choice``, ``response_format`` and what the harness asked for (model, max
tokens, stream). The turn (``turns``) answers with ``Delta``s while generating and one ``Answer`` at the end, which
each adapter writes in its own API's terms.

An answer is read by the model's own parser (``policy.chat.parse_assistant``) after its reasoning is split off:
``read_answer``. A malformed tool call is not dropped: the answer's content is the whole text after the reasoning,
``tool_calls`` is empty and ``malformed`` is set (each API returns it as text, flagged).

Comparing a harness's history with what the gateway answered (``same_turn``) looks at what the model said: the text,
each call's name and arguments as JSON values (a harness that re-serialises ``{"a": 1}`` as ``{"a":1}`` has not
changed the call) and, depending on the session's thinking policy, the reasoning. Call ids are not compared: they
are the harness's handles (an adapter maps them back to the ids the model generated, see ``Session.ids``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from policy import chat

Message = dict[str, Any]            # an OpenAI-chat message, K3-ready (see the module docstring)
Finish = Literal["stop", "tool_calls", "length", "budget"]


class BadCall(ValueError):
    """A request the gateway cannot serve as asked: the adapter answers 400 in its API's error format."""


@dataclass
class Call:
    """One request of a harness, in neutral form."""

    messages: list[Message]
    tools: list[dict[str, Any]] = field(default_factory=list)
    forced: list[chat.Piece] = field(default_factory=list)   # ``tool_choice``: the start of a forced call
    response_format: dict[str, Any] | None = None
    model: str = ""
    max_tokens: int | None = None
    stream: bool = False


@dataclass(frozen=True)
class Delta:
    """Text shown while generating: ``kind`` says whether it is reasoning or the answer's text."""

    kind: Literal["reasoning", "text"]
    text: str


@dataclass
class Answer:
    """The end of one turn: the parsed assistant message, why it stopped, and the token counts."""

    content: str
    reasoning: str | None
    tool_calls: list[dict[str, Any]]
    malformed: bool
    finish: Finish
    prompt_tokens: int
    completion_tokens: int
    node: int = -1                  # its call on the session's tape (-1: a budget's final message, never generated)

    def message(self) -> Message:
        """The OpenAI-chat assistant message (K3's call ids)."""
        msg: Message = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        if self.reasoning is not None:
            msg["reasoning_content"] = self.reasoning
        return msg


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, the rest) of generated text: reasoning is what a leading ``<think>…</think>`` holds."""
    if text.startswith(chat.THINK_BEGIN) and chat.THINK_END in text:
        reasoning, rest = text[len(chat.THINK_BEGIN):].split(chat.THINK_END, 1)
        return reasoning, rest
    return None, text


def read_answer(text: str, finish: str, prompt_tokens: int, completion_tokens: int) -> Answer:
    """The answer of generated ``text`` (its final end-of-turn token left out); ``finish`` is the engine's reason."""
    reasoning, body = split_reasoning(text)
    said = chat.parse_assistant(body)
    calls = [] if said.malformed else said.tool_calls
    content = body if said.malformed else said.content
    why: Finish = "length" if finish == "length" else "tool_calls" if calls else "stop"
    return Answer(content, reasoning, calls, said.malformed, why, prompt_tokens, completion_tokens)


def function_tools(tools: Any, convert: Callable[[dict[str, Any]], dict[str, Any] | None], refused: str
                   ) -> list[dict[str, Any]]:
    """An API's tool declarations as OpenAI function tools: ``convert`` makes a function of one, or None for a kind
    the gateway refuses (``refused`` says which it takes)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise BadCall("tools must be a list")
    out = []
    for t in tools:
        fn = convert(t) if isinstance(t, dict) else None
        if fn is None:
            raise BadCall(refused)
        out.append({"type": "function", "function": fn})
    return out


def text_of(content: Any) -> str:
    """A content field as text: a string, None, or a list of text parts (any API's ``text`` blocks)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if not isinstance(part, dict):
                raise BadCall("a content part must be an object")
            kind = part.get("type", "text")
            if kind in ("text", "input_text", "output_text"):
                out.append(str(part.get("text", "")))
            else:
                raise BadCall(f"content parts of type {kind!r} are not supported by this policy (text only)")
        return "".join(out)
    raise BadCall("content must be a string or a list of parts")


def _arguments(call: dict[str, Any]) -> Any:
    args = (call.get("function") or {}).get("arguments", "{}")
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args


def said(msg: Message, *, with_reasoning: bool) -> tuple[Any, ...]:
    """What a canonical assistant message (``canonical``) says, for comparison (see the module docstring)."""
    calls = tuple((c["name"], c["arguments"]) for c in msg.get("tool_calls") or [])
    return msg.get("content", ""), calls, msg.get("reasoning_content") if with_reasoning else None


def canonical(messages: list[Message]) -> list[Message]:
    """Messages as the template reads them, for comparing two histories: content as text, nothing else."""
    out: list[Message] = []
    for m in messages:
        c: Message = {"role": m["role"], "content": text_of(m.get("content"))}
        for key in ("name", "tool_call_id", "reasoning_content"):
            if m.get(key) is not None:
                c[key] = m[key]
        if m.get("tool_calls"):
            c["tool_calls"] = [{"id": t.get("id"), "name": t.get("function", {}).get("name"),
                                "arguments": json.dumps(_arguments(t), sort_keys=True)} for t in m["tool_calls"]]
        out.append(c)
    return out
