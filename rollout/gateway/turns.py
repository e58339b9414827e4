"""The gateway's one turn, whichever API asked: plan the prompt, generate, record, answer.

``Gateway.turn`` yields ``Delta``s while the engine generates and the ``Answer`` last; the answer is yielded only
after the call is on the tape, so an API's final event always follows the record. What it does, in order:

1. A retry never resamples: a request whose body hash matches a call in flight waits for it (coalescing); one that
   matches a done call gets that call's answer again. One that says it is a retry (the SDKs'
   ``x-stainless-retry-count``) and matches nothing retries a call that never got an answer: it is sampled, and
   counted (``Session.lost_retries``).
2. A spent budget gets the final message (``Session.spent``), and the session says which budget ended it.
3. During a weight push (``Gateway.hold``) the call waits; it does not fail.
4. The tape plans the prompt (verbatim ids plus the new tail, or a labelled new branch), the engine generates with
   the run's sampling, and the call's ids, logprobs, versions, settings and template hash are recorded.

What is shown while generating: reasoning inside a leading ``<think>``, then the text up to a tool-call section;
text that may still turn out to start a control string is held back. Tool calls come whole with the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from policy import chat
from policy.chat import ChatEncoder
from policy.client import PolicyError
from policy.tool_calls import SECTION_BEGIN
from rollout.gateway.messages import Answer, Call, Delta, Finish, read_answer
from rollout.gateway.sessions import Session, SessionConfig, Sessions
from rollout.gateway.tape import Node, Tape, template_hash
from rollout.gateway.upstream import Upstream

BUDGET_TEXT = "[agentenv] This episode's {what} budget is spent; no more model calls will be answered. Stop here."
_HELD = (SECTION_BEGIN, chat.THINK_END)


class Gateway:
    """Sessions over one engine (``upstream``), with its tokenizer (the one the engine uses)."""

    def __init__(self, upstream: Upstream, tokenizer: ChatEncoder) -> None:
        self.upstream, self.tokenizer = upstream, tokenizer
        self.template = template_hash(tokenizer)
        self.sessions = Sessions()
        self._open = asyncio.Event()
        self._open.set()

    def open(self, config: SessionConfig | None = None, labels: dict[str, str] | None = None) -> Session:
        config = config or SessionConfig()
        return self.sessions.add(config, Tape(self.tokenizer, config.thinking), labels)

    def close(self, session: Session) -> Session:
        """Forget the session (its capability stops working); it is returned for export."""
        return self.sessions.pop(session.id)

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        """New calls wait while this is held (a weight push); calls already generating go on."""
        self.hold_calls()
        try:
            yield
        finally:
            self.release_calls()

    def hold_calls(self) -> None:
        self._open.clear()

    def release_calls(self) -> None:
        self._open.set()

    @property
    def holding(self) -> bool:
        return not self._open.is_set()

    async def turn(self, session: Session, call: Call, body_hash: str, retry: bool = False
                   ) -> AsyncIterator[Delta | Answer]:
        """The deltas and the answer of one call (see the module docstring); raises PolicyError when the engine
        fails (the call stays on the tape as failed, the session counts it)."""
        waiting = session.inflight.get(body_hash)
        if waiting is not None:
            session.retries += 1
            for item in replay(await asyncio.shield(waiting)):
                yield item
            return
        node = session.tape.answered(body_hash)
        if node is not None:
            session.retries += 1
            for item in replay(_answer_of(node)):
                yield item
            return
        spent = session.spent()
        if spent is not None:
            session.stopped = session.stopped or spent
            for item in replay(_budget_answer(spent)):
                yield item
            return
        if retry:   # a retry of a call that never got an answer (lost or failed): nothing to replay, sample it
            session.lost_retries += 1
        future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        session.inflight[body_hash] = future
        try:
            async for item in self._generate(session, call, body_hash):
                if isinstance(item, Answer):
                    future.set_result(item)
                yield item
        finally:
            session.inflight.pop(body_hash, None)
            if not future.done():
                future.set_exception(PolicyError("the call it repeats failed"))
                future.exception()   # retrieved: a failure with no one waiting is not an unhandled error

    async def _generate(self, session: Session, call: Call, body_hash: str) -> AsyncIterator[Delta | Answer]:
        cfg = session.config
        deadline = time.monotonic() + cfg.call_timeout
        await asyncio.wait_for(self._open.wait(), timeout=cfg.call_timeout)
        tape = session.tape
        plan = tape.plan(call.messages, call.tools)
        left = cfg.budget.tokens - session.generated
        max_tokens = max(1, min(cfg.sampling.max_tokens, left, call.max_tokens or cfg.sampling.max_tokens))
        seed = None
        node = tape.open(plan, call.messages, call.tools, self.tokenizer.encode_pieces(call.forced), body_hash,
                         cfg.sampling.recorded(max_tokens, seed), self.template)
        t0, shown, finish = time.perf_counter(), Shown(), ""
        eos = self.tokenizer.eos_id
        try:
            async for piece in self.upstream.generate(node.prompt_ids, cfg.sampling, max_tokens, [eos], seed, deadline,
                                                     call.response_format):
                node.output_ids += piece.ids
                node.logprobs += piece.logprobs
                if piece.weight_version is not None and piece.weight_version not in node.weight_versions:
                    node.weight_versions.append(piece.weight_version)
                finish = piece.finish or finish
                for delta in shown.update(self._text(node), final=False):
                    yield delta
        except BaseException:
            tape.fail(node)
            session.errors += 1
            raise
        answer = read_answer(self._text(node), finish or "stop", len(node.prompt_ids), len(node.output_ids))
        answer.node = node.index
        node.weight_version = min(node.weight_versions) if node.weight_versions else None
        node.answer, node.malformed, node.seconds = answer.message(), answer.malformed, time.perf_counter() - t0
        node.finish = finish or "stop"            # the call is on the tape now: its final event may go
        for delta in shown.final(answer):
            yield delta
        yield answer

    def _text(self, node: Node) -> str:
        """The answer's text so far: the forced start of a tool call, then what was sampled (no end-of-turn)."""
        ids = node.output_ids[:-1] if node.output_ids and node.output_ids[-1] == self.tokenizer.eos_id else node.output_ids
        return self.tokenizer.decode(node.prompt_ids[len(node.prompt_ids) - node.forced:] + ids)


def _answer_of(node: Node) -> Answer:
    msg: dict[str, Any] = node.answer
    calls = list(msg.get("tool_calls") or [])
    finish: Finish = "length" if node.finish == "length" else "tool_calls" if calls else "stop"
    return Answer(str(msg.get("content") or ""), msg.get("reasoning_content"), calls, node.malformed, finish,
                  len(node.prompt_ids), len(node.output_ids), node.index)


def _budget_answer(what: str) -> Answer:
    names = {"turns": "call", "tokens": "token", "wall_s": "time"}
    return Answer(BUDGET_TEXT.format(what=names.get(what, what)), None, [], False, "budget", 0, 0)


def replay(answer: Answer) -> Iterator[Delta | Answer]:
    """A recorded answer as a stream: its reasoning, its text, then itself."""
    if answer.reasoning:
        yield Delta("reasoning", answer.reasoning)
    if answer.content:
        yield Delta("text", answer.content)
    yield answer


def _held(text: str) -> str:
    """``text`` without a trailing part that may be the start of a control string still being generated."""
    for n in range(min(len(text), max(map(len, _HELD)) - 1), 0, -1):
        if any(h.startswith(text[-n:]) for h in _HELD):
            return text[:-n]
    return text


class Shown:
    """What a stream has shown so far, and the deltas that extend it."""

    def __init__(self) -> None:
        self.reasoning, self.text = "", ""

    def _deltas(self, reasoning: str, text: str) -> Iterator[Delta]:
        if reasoning.startswith(self.reasoning) and len(reasoning) > len(self.reasoning):
            yield Delta("reasoning", reasoning[len(self.reasoning):])
            self.reasoning = reasoning
        if text.startswith(self.text) and len(text) > len(self.text):
            yield Delta("text", text[len(self.text):])
            self.text = text

    def update(self, generated: str, final: bool) -> Iterator[Delta]:
        reasoning, text = "", generated
        if chat.THINK_BEGIN.startswith(generated):
            return
        if generated.startswith(chat.THINK_BEGIN):
            inner = generated[len(chat.THINK_BEGIN):]
            if chat.THINK_END not in inner:
                yield from self._deltas(_held(inner), "")
                return
            reasoning, text = inner.split(chat.THINK_END, 1)
        yield from self._deltas(reasoning, _held(text.split(SECTION_BEGIN, 1)[0]))

    def final(self, answer: Answer) -> Iterator[Delta]:
        yield from self._deltas(answer.reasoning or "", answer.content)
