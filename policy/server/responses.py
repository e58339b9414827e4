"""The answers of the completion routes, whole or as stream chunks (each answer is a ``StreamFormat``).

Fields beyond OpenAI's: ``token_ids`` of each choice, ``prompt_token_ids``, the ``weight_version`` that
generated the tokens, ``abort_reason``, and for chat ``malformed_tool_calls`` (from ``parse_assistant``).
``usage.prompt_tokens_details.cached_tokens``: prompt tokens whose state came from the prefix cache.

Asked for in the request:

- ``prompt_logprobs`` (vLLM's layout): one item per prompt token, ``None`` for the first, else
  ``{"<token id>": {"logprob", "rank", "decoded_token"}, ...}`` holding the prompt token and the k most likely
  alternatives; top-level, and in every choice of a text completion (as vLLM puts it);
- ``return_routed_experts``: each choice's ``routed_experts`` is a list ``[token][moe_layer][k]`` of global
  expert ids, one item per generated token: the experts that every MoE layer (the layers after
  ``first_k_dense_replace``, in order) chose at the position that produced that token (the last prompt token for
  the first one, then the previous generated token). ``prompt_routed_experts`` (top-level, same layout) covers
  prompt positions 0 .. len(prompt) - 2, reused prefix positions included (a routed request starts only from a
  prefix state kept with its routing, see ``policy.engine``). Together they give the routing of every position a trainer scores, so it can
  replay the serving-time routing. Streamed chunks carry the slice for their tokens.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from policy.chat import THINK_BEGIN, THINK_END, AssistantMessage, parse_assistant
from policy.engine import Sequence
from policy.server.schemas import ChatRequest, CompletionRequest
from policy.server.streaming import Generation
from policy.tokenizer import K3Tokenizer
from policy.tool_calls import SECTION_BEGIN


@dataclass
class Formatter:
    """What every answer of one server needs: its tokenizer and the model name it serves."""

    tokenizer: K3Tokenizer
    model_name: str

    def head(self, kind: str, weight_version: int) -> dict[str, Any]:
        return {"id": f"{kind}-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": self.model_name,
                "weight_version": weight_version}

    def prompt_logprobs(self, gen: Generation) -> list[dict[str, Any] | None] | None:
        s = gen.seqs[0]
        if s.prompt_logprobs is None:
            return None
        out: list[dict[str, Any] | None] = [None]
        for tok, (lp, rank, alts) in zip(gen.prompt_ids[1:], s.prompt_logprobs, strict=True):
            item = {str(t): {"logprob": v, "rank": i + 1, "decoded_token": self.tokenizer.decode([t])}
                    for i, (t, v) in enumerate(alts)}
            item[str(tok)] = {"logprob": lp, "rank": rank, "decoded_token": self.tokenizer.decode([tok])}
            out.append(item)
        return out

    def extras(self, gen: Generation) -> dict[str, Any]:
        """The request-level fields asked for: ``prompt_logprobs`` and ``prompt_routed_experts``."""
        out: dict[str, Any] = {}
        if gen.seqs[0].params.prompt_logprobs is not None:
            out["prompt_logprobs"] = self.prompt_logprobs(gen)
        if gen.seqs[0].params.return_routed_experts:
            out["prompt_routed_experts"] = gen.seqs[0].prompt_routed_experts
        return out

    def logprob_items(self, s: Sequence, start: int = 0, end: int | None = None) -> list[dict[str, Any]]:
        items = []
        for t, lp in zip(s.output_ids[start:end], s.logprobs[start:end], strict=True):
            text = self.tokenizer.decode([t])
            items.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []})
        return items


def usage(gen: Generation) -> dict[str, Any]:
    c = sum(len(s.output_ids) for s in gen.seqs)
    return {"prompt_tokens": len(gen.prompt_ids), "completion_tokens": c, "total_tokens": len(gen.prompt_ids) + c,
            "prompt_tokens_details": {"cached_tokens": gen.seqs[0].cached_tokens}}


def routed(s: Sequence, start: int = 0, end: int | None = None) -> dict[str, Any]:
    """``routed_experts`` of output tokens ``start:end`` when the request asked for them."""
    return {"routed_experts": s.routed_experts[start:end]} if s.params.return_routed_experts else {}


def streamable(text: str) -> str:
    """The part of generated text that is surely plain content: no open reasoning, nothing from a tool-call section."""
    body = text.split(SECTION_BEGIN, 1)[0]
    if body.startswith(THINK_BEGIN) or THINK_BEGIN.startswith(body):
        if THINK_END not in body:
            return ""
        body = body.split(THINK_END, 1)[1]
    return body


@dataclass
class ChatAnswer:
    """``chat.completion`` (``body``) or its ``chat.completion.chunk`` stream. The generation continues the
    prompt after ``forced`` (the start of a forced tool call), so it is parsed with ``forced`` in front."""

    fmt: Formatter
    req: ChatRequest
    gen: Generation
    forced: str
    weight_version: int
    head: dict[str, Any] = field(init=False)
    _parsed: dict[int, AssistantMessage] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.head = self.fmt.head("chatcmpl", self.weight_version)

    def message(self, s: Sequence) -> AssistantMessage:
        """The parsed answer of a finished sequence."""
        if s.seq_id not in self._parsed:
            self._parsed[s.seq_id] = parse_assistant(self.forced + s.text)
        return self._parsed[s.seq_id]

    def choice(self, s: Sequence, i: int) -> dict[str, Any]:
        msg = self.message(s)
        finish = "tool_calls" if msg.tool_calls and s.finish_reason == "stop" else s.finish_reason
        return {"index": i, "message": msg.to_openai(), "finish_reason": finish, "token_ids": s.output_ids,
                "logprobs": {"content": self.fmt.logprob_items(s)} if self.req.logprobs else None,
                "malformed_tool_calls": msg.malformed, "abort_reason": s.abort_reason, **routed(s)}

    def body(self) -> dict[str, Any]:
        seqs = self.gen.seqs
        return {**self.head, "object": "chat.completion", "weight_version": seqs[0].weight_version,
                "choices": [self.choice(s, i) for i, s in enumerate(seqs)], "prompt_token_ids": self.gen.prompt_ids,
                **self.fmt.extras(self.gen), "usage": usage(self.gen)}

    # --- StreamFormat: the first chunk of each choice carries the prompt's token ids; content streams while
    # it is surely content; reasoning and tool calls come whole in the last chunk of their choice
    def opening(self, index: int) -> list[dict[str, Any]]:
        return [{**self.head, "object": "chat.completion.chunk", "prompt_token_ids": self.gen.prompt_ids,
                 "choices": [{"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]

    def shown(self, seq: Sequence, final: bool) -> str:
        if final:
            return self.message(seq).content
        return "" if self.forced else streamable(seq.text)

    def chunk(self, seq: Sequence, index: int, start: int, end: int, text: str | None,
              finish: str | None) -> dict[str, Any]:
        delta: dict[str, Any] = {} if text is None else {"content": text}
        out: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": None,
                               "token_ids": seq.output_ids[start:end], **routed(seq, start, end)}
        if finish is not None:
            final = self.choice(seq, index)
            if final["message"].get("reasoning_content") is not None:
                delta["reasoning_content"] = final["message"]["reasoning_content"]
            if "tool_calls" in final["message"]:
                delta["tool_calls"] = [{**c, "index": j} for j, c in enumerate(final["message"]["tool_calls"])]
            out.update(finish_reason=final["finish_reason"], malformed_tool_calls=final["malformed_tool_calls"],
                       abort_reason=seq.abort_reason)
        if self.req.logprobs:
            out["logprobs"] = {"content": self.fmt.logprob_items(seq, start, end)}
        first = self.fmt.extras(self.gen) if start == 0 else {}  # known once the prompt is prefilled
        return {**self.head, "object": "chat.completion.chunk", "weight_version": seq.weight_version, **first,
                "choices": [out]}

    def closing(self) -> list[dict[str, Any]]:
        if not (self.req.stream_options or {}).get("include_usage"):
            return []
        return [{**self.head, "object": "chat.completion.chunk", "choices": [], "usage": usage(self.gen)}]


@dataclass
class CompletionAnswer:
    """``text_completion`` (``body``) or its stream; the first chunk of each choice carries the prompt's ids."""

    fmt: Formatter
    req: CompletionRequest
    gen: Generation
    weight_version: int
    head: dict[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        self.head = {**self.fmt.head("cmpl", self.weight_version), "object": "text_completion"}

    def logprobs(self, s: Sequence, start: int = 0, end: int | None = None) -> dict[str, Any] | None:
        if not self.req.logprobs:
            return None
        items = self.fmt.logprob_items(s, start, end)
        return {"tokens": [x["token"] for x in items], "token_logprobs": [x["logprob"] for x in items],
                "top_logprobs": None, "text_offset": []}

    def body(self) -> dict[str, Any]:
        seqs = self.gen.seqs
        extras = self.fmt.extras(self.gen)
        per_choice = {"prompt_logprobs": extras["prompt_logprobs"]} if "prompt_logprobs" in extras else {}
        return {**self.head, "weight_version": seqs[0].weight_version, "prompt_token_ids": self.gen.prompt_ids,
                **extras,
                "choices": [{"index": i, "text": s.text, "finish_reason": s.finish_reason, "token_ids": s.output_ids,
                             "logprobs": self.logprobs(s), "abort_reason": s.abort_reason, **per_choice, **routed(s)}
                            for i, s in enumerate(seqs)],
                "usage": usage(self.gen)}

    # --- StreamFormat
    def opening(self, index: int) -> list[dict[str, Any]]:
        return []

    def shown(self, seq: Sequence, final: bool) -> str:
        return seq.text

    def chunk(self, seq: Sequence, index: int, start: int, end: int, text: str | None,
              finish: str | None) -> dict[str, Any]:
        first = {"prompt_token_ids": self.gen.prompt_ids, **self.fmt.extras(self.gen)} if start == 0 else {}
        return {**self.head, **first, "choices": [{
            "index": index, "text": text or "", "finish_reason": finish, "token_ids": seq.output_ids[start:end],
            "logprobs": self.logprobs(seq, start, end), **routed(seq, start, end)}]}

    def closing(self) -> list[dict[str, Any]]:
        return []
