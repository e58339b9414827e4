"""The engine behind the gateway: token ids in, token ids out, streamed.

Every call goes to the endpoint's ``/v1/completions`` with a token-id prompt, streamed, asking for each token's id
and logprob (ours; vLLM's ``return_token_ids``; SGLang's ``output_ids``): the gateway never lets the engine render
or parse, so what it records is what the engine sampled. ``extra`` goes into every body as it is: the neutral
``top_k`` / ``min_p`` a vLLM or SGLang endpoint needs so that logprobs come from the distribution sampled.

A weight push does not fail a call. Refusals before running (connection refused, 429, 503) are sent again with a
backoff until the call's deadline; a generation the engine ends with ``finish_reason == "abort"`` (a push in
``abort`` mode) continues from the prompt and the ids generated so far on the new weights, so a harness that has
been streamed a partial answer sees it continue, and the call records every version that generated a part.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from policy.client import PolicyError, PolicyProtocolError, PolicyTimeout, PolicyUnreachable, error_reason


@dataclass(frozen=True)
class Sampling:
    """The run's sampling settings, imposed on every call (a harness's own are recorded, never used)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 1024
    extra: dict[str, Any] = field(default_factory=dict)

    def recorded(self, max_tokens: int, seed: int | None) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "max_tokens": max_tokens, "seed": seed,
                **self.extra}


@dataclass(frozen=True)
class Piece:
    """Ids the engine sampled since the last piece, their logprobs, and its finish reason on the last piece."""

    ids: list[int]
    logprobs: list[float]
    weight_version: int | None
    finish: str | None = None


class Upstream:
    """One engine endpoint (``base_url`` with or without ``/v1``; ``token`` its bearer token)."""

    def __init__(self, base_url: str, token: str | None = None, model: str | None = None, *,
                 connect_timeout: float = 10.0, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.model = model
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=headers, transport=transport,
                                       timeout=httpx.Timeout(None, connect=connect_timeout),
                                       limits=httpx.Limits(max_connections=512, max_keepalive_connections=512))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def model_name(self) -> str:
        if self.model is None:
            r = await self._http.get("/v1/models", timeout=30)
            if r.status_code != 200:
                raise PolicyError(f"/v1/models: {r.status_code} {error_reason(r)}", r.status_code)
            listed = r.json().get("data") or []
            if not listed:
                raise PolicyProtocolError("the engine lists no models")
            self.model = str(listed[0]["id"])
        return self.model

    async def generate(self, prompt_ids: list[int], sampling: Sampling, max_tokens: int, stop_ids: list[int],
                       seed: int | None, deadline: float, response_format: dict[str, Any] | None = None
                       ) -> AsyncIterator[Piece]:
        """The pieces of one generation, continued across aborts (see the module docstring); raises PolicyError
        (``PolicyTimeout`` once ``deadline``, a ``time.monotonic()``, has passed)."""
        done: list[int] = []
        while True:
            body = {"model": await self.model_name(), "prompt": prompt_ids + done, "max_tokens": max_tokens - len(done),
                    "temperature": sampling.temperature, "top_p": sampling.top_p, "logprobs": 1, "stream": True,
                    "return_token_ids": True, "stop_token_ids": stop_ids, **sampling.extra}
            if seed is not None:
                body["seed"] = seed + len(done)
            if response_format is not None:   # structured output: the engine's grammar holds the sampled ids
                body["response_format"] = response_format
            finish = None
            async for piece in self._stream(body, deadline):
                done += piece.ids
                if piece.finish == "abort":
                    if piece.ids:
                        yield Piece(piece.ids, piece.logprobs, piece.weight_version)
                    finish = "abort"
                    break
                yield piece
                finish = piece.finish
            if finish != "abort" or len(done) >= max_tokens:
                if finish == "abort":
                    yield Piece([], [], None, "length")
                return

    async def _stream(self, body: dict[str, Any], deadline: float) -> AsyncIterator[Piece]:
        delay = 0.2
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PolicyTimeout("the engine gave no answer within the call's deadline")
            try:
                async with self._http.stream("POST", "/v1/completions", json=body,
                                             timeout=httpx.Timeout(left, connect=min(left, 10.0))) as r:
                    if r.status_code in (429, 503):   # refused before running (a weight push, a full queue)
                        await r.aread()
                    elif r.status_code != 200:
                        await r.aread()
                        raise PolicyError(f"/v1/completions: {r.status_code} {error_reason(r)}", r.status_code)
                    else:
                        async for piece in _pieces(r):
                            yield piece
                        return
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout):
                pass                                  # never sent: the engine is restarting or pushing weights
            except httpx.TimeoutException as e:
                raise PolicyTimeout(f"the engine stopped answering ({type(e).__name__})") from e
            except httpx.TransportError as e:
                raise PolicyUnreachable(f"the connection to the engine broke ({type(e).__name__}: {e})") from e
            await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 5.0)


async def _pieces(r: httpx.Response) -> AsyncIterator[Piece]:
    version: int | None = None
    async for line in r.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            chunk = json.loads(data)
            version = chunk.get("weight_version", version)
            choice = chunk["choices"][0]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise PolicyProtocolError(f"the engine sent a chunk that is not a completion chunk: {data[:200]}") from e
        ids = choice.get("token_ids") or choice.get("output_ids") or []
        lp = (choice.get("logprobs") or {}).get("token_logprobs") or []
        if len(lp) != len(ids):
            raise PolicyProtocolError("the engine sent no logprob per token id (is it an OpenAI-compatible "
                                      "engine that returns token ids: ours, vLLM with return_token_ids, SGLang?)")
        yield Piece([int(i) for i in ids], [float(x) for x in lp], version, choice.get("finish_reason"))
    raise PolicyProtocolError("the engine's stream ended without [DONE]")
