"""Kimi K3's chat and tool-call format: the one implementation that the policy server and the envs share.

Standard library only, so ``from policy import chat`` is cheap (``policy/__init__.py`` loads the model lazily).

It renders OpenAI-style messages and tool declarations in K3's template (``render_chat``), parses generated
assistant text back into content, ``<think>`` reasoning and OpenAI-style ``tool_calls`` (``parse_assistant``),
and declares tools (``tool_spec``, ``validate_tools``).

Text is text (issue 40): the template renders to *pieces* (``chat_pieces``), each a ``Control`` token the template
itself inserts or a ``str`` of text: message content, tool output, names, call ids, arguments, tool declarations.
``ChatEncoder`` turns pieces into token ids over any tokenizer, and its ``encode_text`` is the one encoder of text:
a control-token string inside text (a sandbox that prints ``<|im_end|><|im_system|>system<|im_middle|>...``) is
tokenised as the characters it is, so only the template puts control ids into a prompt or a trajectory, and
``decode(encode_text(s)) == s``. ``messages_of`` splits decoded pieces back into messages at control tokens only.
``render_chat`` is the same pieces joined, for people and for text comparisons; never tokenise it.

An assistant turn is ``[<think>REASONING</think>]CONTENT[SECTION]``, where SECTION is K3's tool-call section
(``policy.tool_calls``, which says what is read leniently and what is malformed). Reasoning stays in ``<think>``
tokens and the roles in Kimi's ``<|im_*|>`` tokens: the rest of K3's chat template is not public.
A malformed message comes back as ``AssistantMessage(content=text, tool_calls=[], malformed=True)``; parsing never
raises.

Canonical text round-trips byte for byte: ``render_assistant_body(parse_assistant(t).to_openai()) == t`` for
every ``t`` that the renderer produced; lenient text parses to the same message as its canonical form.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from policy.pieces import Control, Piece, text_of
from policy.tool_calls import (
    OPEN,
    SECTION_BEGIN,
    TOOL_CALL_TOKENS,
    TOOL_NAME,
    block,
    call_index,
    call_opening,
    canonical_id,
    parse_section,
    tool_call_pieces,
)

# Kimi's chat control tokens (each one token in the tokenizer, see policy/tokenizer.py); the tool-call section's
# are policy.tool_calls'
THINK_BEGIN, THINK_END = "<think>", "</think>"
IM_SYSTEM, IM_USER, IM_ASSISTANT = "<|im_system|>", "<|im_user|>", "<|im_assistant|>"
IM_MIDDLE, IM_END = "<|im_middle|>", "<|im_end|>"
ROLE_TOKEN = {"system": IM_SYSTEM, "user": IM_USER, "assistant": IM_ASSISTANT, "tool": IM_SYSTEM}
CHAT_TOKENS = (IM_SYSTEM, IM_USER, IM_ASSISTANT, IM_MIDDLE, IM_END, *TOOL_CALL_TOKENS, THINK_BEGIN, THINK_END)
# What a generation continues after (the end of ``render_chat(..., add_generation_prompt=True)``).
GENERATION_PROMPT = IM_ASSISTANT + "assistant" + IM_MIDDLE


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


GENERATION_PIECES: tuple[Piece, ...] = (Control(IM_ASSISTANT), "assistant", Control(IM_MIDDLE))


def tool_choice_pieces(tools: list[dict[str, Any]], choice: Any) -> tuple[list[dict[str, Any]], list[Piece]]:
    """OpenAI's ``tool_choice`` for validated ``tools``: the tools to declare, and the pieces that force it
    (appended to the prompt after the generation prompt; the answer is parsed with their text in front). ``none``
    declares no tools; ``required`` opens a tool call and lets the model pick the function; a named function opens
    a call of it. Raises ValueError when ``tool_choice`` is malformed or names an undeclared function."""
    if choice == "none":
        return [], []
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if name not in {t["function"]["name"] for t in tools}:
            raise ValueError(f"tool_choice names a function that is not in tools: {name!r}")
        return tools, [*block("tools"), *call_opening(str(name), 0)]
    if choice == "required":  # the model must open a tool call; it picks the function
        if not tools:
            raise ValueError("tool_choice 'required' needs tools")
        return tools, [*block("tools"), Control(OPEN), 'call tool="']
    if choice not in (None, "auto"):
        raise ValueError("tool_choice must be 'none', 'auto', 'required' or a named function")
    return tools, []


def render_tool_calls(tool_calls: list[dict[str, Any]]) -> str:
    """``tool_call_pieces`` as text."""
    return text_of(tool_call_pieces(tool_calls))


def assistant_pieces(msg: dict[str, Any]) -> list[Piece]:
    """An assistant turn after ``<|im_middle|>`` and before ``<|im_end|>``: reasoning, content, tool calls."""
    out: list[Piece] = []
    if msg.get("reasoning_content") is not None:
        out += [Control(THINK_BEGIN), msg["reasoning_content"], Control(THINK_END)]
    out.append(_text(msg.get("content")))
    if msg.get("tool_calls"):
        out += tool_call_pieces(msg["tool_calls"])
    return out


def render_assistant_body(msg: dict[str, Any]) -> str:
    """``assistant_pieces`` as text."""
    return text_of(assistant_pieces(msg))


def generated_pieces(text: str) -> list[Piece]:
    """An assistant turn's text as a model would generate it (what a scripted policy answers): parsed, its
    reasoning and tool-call structure as control tokens, the rest text; malformed text is text as a whole."""
    msg = parse_assistant(text)
    return [text] if msg.malformed else assistant_pieces(msg.to_openai())


def chat_pieces(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                add_generation_prompt: bool = True) -> list[Piece]:
    """A conversation in K3's format, ending with the assistant header when generating."""
    out: list[Piece] = []
    ids: dict[str, str] = {}   # a call's id as given -> the canonical id its tool result names
    if tools:
        out += [Control(IM_SYSTEM), "tool_declare", Control(IM_MIDDLE),
                json.dumps(tools, ensure_ascii=False, separators=(",", ":")), Control(IM_END)]
    for m in messages:
        role = m.get("role")
        if role not in ROLE_TOKEN:
            raise ValueError(f"unknown message role {role!r}")
        out += [Control(ROLE_TOKEN[role]), str(m.get("name") or role), Control(IM_MIDDLE)]
        if role == "tool":
            call_id = str(m.get("tool_call_id") or "")
            out.append(f"## Return of {ids.get(call_id, call_id)}\n" + _text(m.get("content")))
        elif role == "assistant":
            for i, call in enumerate(m.get("tool_calls") or []):
                if call.get("id"):
                    ids[str(call["id"])] = canonical_id(call["function"]["name"], call_index(call, i))
            out += assistant_pieces(m)
        else:
            out.append(_text(m.get("content")))
        out.append(Control(IM_END))
    if add_generation_prompt:
        out += GENERATION_PIECES
    return out


def render_chat(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                add_generation_prompt: bool = True) -> str:
    """``chat_pieces`` as text (for people and comparisons; ``ChatEncoder.encode_chat`` makes the token ids)."""
    return text_of(chat_pieces(messages, tools, add_generation_prompt))


def messages_of(pieces: Iterable[Piece]) -> list[tuple[str, str]]:
    """(name, body) of each message in decoded pieces (``tool_declare`` included), split at control tokens only: a
    control string inside a message's text stays in its body. A body's own control tokens (an assistant turn's
    tool calls) are spelled out; a message cut off at the end has the body it has."""
    found: list[tuple[list[str], list[str]]] = []
    part: list[str] | None = None   # where text goes: the open message's name or body, or nowhere
    for p in pieces:
        if isinstance(p, Control) and p.token in (IM_SYSTEM, IM_USER, IM_ASSISTANT):
            found.append(([], []))
            part = found[-1][0]
        elif isinstance(p, Control) and p.token == IM_MIDDLE and found and part is found[-1][0]:
            part = found[-1][1]
        elif isinstance(p, Control) and p.token == IM_END:
            part = None
        elif part is not None:
            part.append(p.token if isinstance(p, Control) else p)
    return [("".join(name), "".join(body)) for name, body in found]


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
    calls = None if any(t in content for t in TOOL_CALL_TOKENS) else parse_section(section)
    if not calls:
        return AssistantMessage(text, None, [], malformed=True)
    return AssistantMessage(content, reasoning, calls)


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


# --- token ids ------------------------------------------------------------------------------------------------


class HFTokenizer(Protocol):
    """What ``ChatEncoder.wrap`` reads of a Hugging Face ``transformers`` tokenizer (verl's, a vLLM model's)."""

    added_tokens_decoder: Mapping[int, Any]

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class ChatEncoder:
    """Token ids for K3's chat format over a tokenizer, where text is text.

    ``raw_encode`` is the tokenizer's own encode, which makes a control id of any control-token string it meets;
    ``encode_text`` calls it only on pieces of the text cut right after the first character of every control string
    in it, so that no piece holds a whole one (a split control string is ordinary characters: ``<|im_end|>`` in a
    tool output reaches the model as ``<`` and ``|im_end|>``). ``controls`` maps every control string of the
    tokenizer (its special tokens) to its id; ``Control`` pieces are the only way one gets into the ids.
    """

    def __init__(self, raw_encode: Callable[[str], Sequence[int]], raw_decode: Callable[[list[int]], str],
                 controls: Mapping[str, int]) -> None:
        self._raw_encode, self._raw_decode = raw_encode, raw_decode
        self.controls = dict(controls)
        self._names = {i: t for t, i in self.controls.items()}
        longest_first = sorted(self.controls, key=len, reverse=True)
        self._starts = re.compile("(?=" + "|".join(map(re.escape, longest_first)) + ")") if longest_first else None
        self.eos_id = self.token_id(IM_END)

    @classmethod
    def wrap(cls, tokenizer: ChatEncoder | HFTokenizer) -> ChatEncoder:
        """``tokenizer`` itself when it is a ChatEncoder (k3-mini's ``K3Tokenizer``), else a Hugging Face one's."""
        if isinstance(tokenizer, ChatEncoder):
            return tokenizer
        hf = tokenizer
        controls = {str(t.content): i for i, t in hf.added_tokens_decoder.items() if t.special}
        return cls(lambda text: hf.encode(text, add_special_tokens=False),
                   lambda ids: hf.decode(ids, skip_special_tokens=False), controls)

    def token_id(self, token: str) -> int:
        """The id of the control token ``token`` (KeyError if the tokenizer has none)."""
        return self.controls[token]

    def encode_text(self, text: str) -> list[int]:
        """The ids of ``text``, all of it text: tool output, message content, file contents, a text prompt, anything
        the template did not write itself. No control id comes out; ``decode`` gives ``text`` back."""
        cuts = sorted({m.start() + 1 for m in self._starts.finditer(text)}) if self._starts else []
        ids = [i for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True) if a < b
               for i in self._raw_encode(text[a:b])]
        if any(i in self._names for i in ids):   # a tokenizer that makes control tokens from other text
            raise ValueError("this tokenizer turns ordinary text into a control token (a normaliser that rewrites "
                             "characters?); ChatEncoder needs one that matches its special tokens verbatim")
        return ids

    def encode_pieces(self, pieces: Iterable[Piece]) -> list[int]:
        """Rendered pieces as ids: a ``Control`` as its id, text through ``encode_text``."""
        if isinstance(pieces, str):
            raise TypeError("encode_pieces takes a list of pieces; give text to encode_text")
        out: list[int] = []
        for p in pieces:
            out += [self.token_id(p.token)] if isinstance(p, Control) else self.encode_text(p)
        return out

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True) -> list[int]:
        """``chat_pieces`` as ids: what a prompt of these messages is (the policy server's chat route, the loop)."""
        return self.encode_pieces(chat_pieces(messages, tools, add_generation_prompt))

    def encode_assistant(self, text: str) -> list[int]:
        """``generated_pieces`` as ids: a scripted policy's answer, tokenised as if a model had generated it."""
        return self.encode_pieces(generated_pieces(text))

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``, control tokens spelled out."""
        return self._raw_decode(list(ids))

    def decode_pieces(self, ids: Sequence[int]) -> list[Piece]:
        """``ids`` as pieces: each control id a ``Control``, each run of other ids its text (for ``messages_of``)."""
        out: list[Piece] = []
        run: list[int] = []
        for i in [*ids, None]:
            if i is None or i in self._names:
                if run:
                    out.append(self._raw_decode(run))
                    run = []
                if i is not None:
                    out.append(Control(self._names[i]))
            else:
                run.append(i)
        return out
