"""Generations on the engine seen from asyncio, and the one server-sent-events generator that both chat and
text completions stream with (the response formats in ``responses`` say what each chunk holds)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from policy.engine import Engine, SamplingParams, Sequence

# (sequence, how many output tokens it had, finish reason or None): sent by the engine thread after each token
Update = tuple[Sequence, int, str | None]


@dataclass
class Generation:
    """The sequences generated for one request (one per choice) and the queue their updates arrive on."""

    prompt_ids: list[int]
    seqs: list[Sequence]
    updates: asyncio.Queue[Update]

    async def wait(self) -> None:
        """Until every sequence has finished."""
        pending = {s.seq_id for s in self.seqs}
        while pending:
            s, _, finish = await self.updates.get()
            if finish is not None:
                pending.discard(s.seq_id)


def generate(engine: Engine, prompt_ids: list[int], params: list[SamplingParams],
             finished: Callable[[Sequence], None] | None = None) -> Generation:
    """Submit one sequence per ``params`` (from the event loop); raises ValueError when the engine refuses.
    ``finished(seq)`` runs on the engine's thread when a sequence finishes, before its last update is queued."""
    loop, updates = asyncio.get_running_loop(), asyncio.Queue[Update]()

    def listener(s: Sequence) -> None:  # runs on the engine thread
        if finished is not None and s.finish_reason is not None:
            finished(s)
        loop.call_soon_threadsafe(updates.put_nowait, (s, len(s.output_ids), s.finish_reason))

    return Generation(prompt_ids, [engine.submit(prompt_ids, p, listener) for p in params], updates)


class StreamFormat(Protocol):
    """How one kind of completion is streamed: the chunks, and which text the client may see so far."""

    def opening(self, index: int) -> list[dict[str, Any]]:
        """Chunks sent for choice ``index`` before any token."""
        ...

    def shown(self, seq: Sequence, final: bool) -> str:
        """The text of ``seq`` the client may see by now (``final``: the sequence has finished)."""
        ...

    def chunk(self, seq: Sequence, index: int, start: int, end: int, text: str | None,
              finish: str | None) -> dict[str, Any]:
        """The chunk for output tokens ``start:end`` of choice ``index``; ``text`` is the newly shown text,
        None while it is held back (what was shown is no longer a prefix of what may be shown)."""
        ...

    def closing(self) -> list[dict[str, Any]]:
        """Chunks sent after every choice has finished."""
        ...


async def stream(gen: Generation, fmt: StreamFormat) -> AsyncIterator[str]:
    """Server-sent events for ``gen``: a chunk per engine update of each choice, then ``data: [DONE]``."""
    index = {s.seq_id: i for i, s in enumerate(gen.seqs)}
    sent_tokens = dict.fromkeys(index, 0)
    sent_text = dict.fromkeys(index, "")
    for i in index.values():
        for chunk in fmt.opening(i):
            yield sse(chunk)
    pending = set(index)
    while pending:
        s, n, finish = await gen.updates.get()
        if finish is not None:
            pending.discard(s.seq_id)
        shown, text = fmt.shown(s, finish is not None), None
        if shown.startswith(sent_text[s.seq_id]):
            text, sent_text[s.seq_id] = shown[len(sent_text[s.seq_id]):], shown
        yield sse(fmt.chunk(s, index[s.seq_id], sent_tokens[s.seq_id], n, text, finish))
        sent_tokens[s.seq_id] = n
    for chunk in fmt.closing():
        yield sse(chunk)
    yield "data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"
