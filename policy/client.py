"""An async client for any OpenAI-compatible policy endpoint (ours, vLLM, SGLang): token ids in, token ids out.

Standard library and httpx only (no torch), so rollout workers import it cheaply::

    async with PolicyClient("http://127.0.0.1:8000", token="...") as policy:
        c = await policy.complete(prompt_ids, max_tokens=256, temperature=1.0, n=4, stop_token_ids=[eos])
        for s in c.samples:          # s.token_ids, s.logprobs, s.finish_reason, s.routed_experts
            ...                       # c.weight_version, c.cached_tokens, c.prompt_ids

``complete`` sends the prompt as token ids (``prompt: [int, ...]``, which vLLM and SGLang accept too) and asks
for the output's token ids (``return_token_ids``, vLLM's name) and logprobs, so a multi-turn loop appends the
answer verbatim and never re-tokenises. ``chat`` is there for the occasional chat-route call (``verify``).

One ``httpx.AsyncClient`` pools connections; a semaphore bounds the requests in flight (``max_concurrency``);
every call has a timeout (``timeout``, per call too). Retries (``max_retries``, exponential backoff with
jitter, ``Retry-After`` honoured) happen only when the request cannot have run: the connection was never made,
or the server refused it with 429 / 503; or when the call is idempotent (listing models, tokenising, scoring).
A generation whose connection broke after it was sent is not sent again: ``PolicyTimeout`` or
``PolicyUnreachable`` reaches the caller, who decides.

Errors (all ``PolicyError``): ``PolicyUnreachable`` (no connection, or it broke), ``PolicyTimeout``,
``PolicyBadRequest`` (a 4xx, with ``status`` and the server's ``reason``), ``PolicyServerError`` (5xx, or
429/503 once the retries are spent), ``PolicyProtocolError`` (the answer lacks what was asked, e.g. token ids).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

__all__ = ["Completion", "PolicyBadRequest", "PolicyClient", "PolicyError", "PolicyProtocolError",
           "PolicyServerError", "PolicyTimeout", "PolicyUnreachable", "Sample", "SyncPolicyClient"]


class PolicyError(Exception):
    """Any failure talking to a policy endpoint; ``status`` is the HTTP status when there was an answer."""

    def __init__(self, message: str, status: int | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.status, self.reason = status, reason


class PolicyUnreachable(PolicyError):
    """No connection could be made, or it broke before the answer came."""


class PolicyTimeout(PolicyError):
    """The call took longer than its timeout."""


class PolicyBadRequest(PolicyError):
    """The server refused the request (4xx); ``reason`` is its message."""


class PolicyServerError(PolicyError):
    """The server failed (5xx), or stayed overloaded (429 / 503) through every retry."""


class PolicyProtocolError(PolicyError):
    """The answer is not what an OpenAI-compatible endpoint should send, or lacks what was asked for."""


@dataclass
class Sample:
    """One choice: its token ids, their logprobs, why it ended, and what else the server returned."""

    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str | None
    text: str = ""
    routed_experts: list[list[list[int]]] | None = None
    abort_reason: str | None = None
    message: dict[str, Any] | None = None   # chat: the parsed assistant message (content, tool_calls, ...)


@dataclass
class Completion:
    """A completion's choices and the request-level facts: the prompt's ids as the server saw them, the
    weight version that generated them (None when the server does not say), prompt tokens reused from its
    prefix cache, prompt logprobs (one per prompt token, None for the first) when asked for."""

    samples: list[Sample]
    prompt_ids: list[int] | None
    weight_version: int | None
    cached_tokens: int | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_routed_experts: list[Any] | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)


def error_reason(r: httpx.Response) -> str:
    """The server's error message (OpenAI's ``{"error": {"message": ...}}``, FastAPI's ``detail``, or text)."""
    try:
        body = r.json()
    except ValueError:
        return r.text[:500] or r.reason_phrase
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if body.get("message"):
            return str(body["message"])
        if body.get("detail"):
            return json.dumps(body["detail"]) if not isinstance(body["detail"], str) else body["detail"]
    return json.dumps(body)[:500]


def _token_ids(choice: dict[str, Any]) -> list[int] | None:
    """A choice's output token ids: ``token_ids`` (ours, vLLM's ``return_token_ids``), SGLang's
    ``output_ids``, or vLLM's ``return_tokens_as_token_ids`` logprob tokens (``"token_id:123"``)."""
    for key in ("token_ids", "output_ids"):
        if isinstance(choice.get(key), list):
            return [int(t) for t in choice[key]]
    lp = choice.get("logprobs") or {}
    tokens = lp.get("tokens") or [c.get("token") for c in lp.get("content") or []]
    if tokens and all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
        return [int(t.split(":", 1)[1]) for t in tokens]
    return None


def _logprobs(choice: dict[str, Any]) -> list[float] | None:
    lp = choice.get("logprobs")
    if not lp:
        return None
    if isinstance(lp.get("token_logprobs"), list):           # text completion
        return [float(x) for x in lp["token_logprobs"]]
    if isinstance(lp.get("content"), list):                  # chat
        return [float(c["logprob"]) for c in lp["content"]]
    return None


def prompt_logprobs_of(items: list[Any] | None, prompt_ids: Sequence[int]) -> list[float | None] | None:
    """The logprob of each prompt token from vLLM's ``prompt_logprobs`` layout (a dict per position keyed by
    token id; None for the first position)."""
    if items is None:
        return None
    out: list[float | None] = []
    for tok, item in zip(prompt_ids, items, strict=False):
        if not item:
            out.append(None)
            continue
        entry = item.get(str(tok), item.get(tok)) if isinstance(item, dict) else None
        out.append(None if entry is None else float(entry["logprob"] if isinstance(entry, dict) else entry))
    return out


class PolicyClient:
    """Async client of one OpenAI-compatible endpoint (see the module docstring)."""

    def __init__(self, base_url: str, token: str | None = None, model: str | None = None, *,
                 timeout: float = 600.0, connect_timeout: float = 10.0, max_retries: int = 3,
                 backoff: float = 0.5, max_backoff: float = 10.0, max_concurrency: int = 64,
                 transport: httpx.AsyncBaseTransport | None = None, headers: dict[str, str] | None = None) -> None:
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.model = model
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self.max_retries, self.backoff, self.max_backoff = max_retries, backoff, max_backoff
        self._sem = asyncio.Semaphore(max_concurrency)
        hdrs = {**(headers or {}), **({"Authorization": f"Bearer {token}"} if token else {})}
        limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=hdrs, transport=transport, limits=limits,
                                       timeout=httpx.Timeout(timeout, connect=connect_timeout))
        self.retries = 0  # how many times a request was sent again

    async def __aenter__(self) -> PolicyClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # ---- the transport: one request, its retries and its errors ---------------------------------------------
    async def request(self, method: str, path: str, body: dict[str, Any] | None = None, *, idempotent: bool = False,
                      timeout: float | None = None) -> dict[str, Any]:
        """Send one request and return its JSON body; retries as the module docstring says."""
        attempt = 0
        t = httpx.Timeout(timeout if timeout is not None else self.timeout, connect=self.connect_timeout)
        while True:
            retry_after: float | None = None
            try:
                async with self._sem:
                    r = await self._http.request(method, path, json=body, timeout=t)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as e:  # never sent
                err: PolicyError = PolicyUnreachable(f"{self.base_url}{path}: cannot connect ({type(e).__name__}: {e})")
                retry = True
            except httpx.TimeoutException as e:  # sent: the server may be running it
                err, retry = PolicyTimeout(f"{self.base_url}{path}: no answer within the timeout ({type(e).__name__})"), idempotent
            except httpx.TransportError as e:   # the connection broke after the request went out
                err = PolicyUnreachable(f"{self.base_url}{path}: connection lost ({type(e).__name__}: {e})")
                retry = idempotent
            else:
                if r.status_code < 400:
                    try:
                        data = r.json()
                    except ValueError as e:
                        raise PolicyProtocolError(f"{path}: the answer is not JSON", r.status_code) from e
                    if not isinstance(data, dict):
                        raise PolicyProtocolError(f"{path}: the answer is not a JSON object", r.status_code)
                    return data
                reason = error_reason(r)
                if r.status_code in (429, 503):  # refused before running: safe to send again
                    err, retry = PolicyServerError(f"{path}: {r.status_code} {reason}", r.status_code, reason), True
                    retry_after = _retry_after(r)
                elif r.status_code < 500:
                    raise PolicyBadRequest(f"{path}: {r.status_code} {reason}", r.status_code, reason)
                else:
                    err, retry = PolicyServerError(f"{path}: {r.status_code} {reason}", r.status_code, reason), idempotent
            if not retry or attempt >= self.max_retries:
                raise err
            delay = min(self.max_backoff, self.backoff * 2 ** attempt) * (0.5 + random.random() / 2)
            await asyncio.sleep(min(self.max_backoff, retry_after) if retry_after is not None else delay)
            attempt += 1
            self.retries += 1

    async def send_raw(self, method: str, path: str, content: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
        """One request with a raw body, no retries (``verify`` sends malformed JSON with it)."""
        try:
            async with self._sem:
                return await self._http.request(method, path, content=content, headers=headers)
        except httpx.TimeoutException as e:
            raise PolicyTimeout(f"{self.base_url}{path}: no answer within the timeout") from e
        except httpx.TransportError as e:
            raise PolicyUnreachable(f"{self.base_url}{path}: {type(e).__name__}: {e}") from e

    # ---- the API ------------------------------------------------------------------------------------------
    async def models(self) -> list[dict[str, Any]]:
        """``GET /v1/models``: the served models (id, and ``max_model_len`` where the server tells)."""
        data = await self.request("GET", "/v1/models", idempotent=True)
        return list(data.get("data") or [])

    async def model_name(self) -> str:
        """The model to ask for: the one given, else the first the server lists."""
        if self.model is None:
            listed = await self.models()
            if not listed:
                raise PolicyProtocolError("the server lists no models")
            self.model = str(listed[0]["id"])
        return self.model

    async def complete(self, prompt_ids: Sequence[int], *, max_tokens: int, temperature: float = 1.0,
                       top_p: float = 1.0, n: int = 1, stop_token_ids: Sequence[int] | None = None,
                       stop: Sequence[str] | None = None, seed: int | None = None, logprobs: bool = True,
                       prompt_logprobs: int | None = None, return_routed_experts: bool = False,
                       response_format: dict[str, Any] | None = None, timeout: float | None = None,
                       extra: dict[str, Any] | None = None) -> Completion:
        """``POST /v1/completions`` with a token-id prompt; every sample's token ids (and logprobs) come back.

        Not retried once sent (a generation is not idempotent); ``PolicyProtocolError`` when the server gave
        no token ids."""
        body: dict[str, Any] = {"model": await self.model_name(), "prompt": list(prompt_ids), "max_tokens": max_tokens,
                                "temperature": temperature, "top_p": top_p, "n": n, "return_token_ids": True}
        if logprobs:
            body["logprobs"] = 1
        if stop_token_ids:
            body["stop_token_ids"] = list(stop_token_ids)
        if stop:
            body["stop"] = list(stop)
        if seed is not None:
            body["seed"] = seed
        if prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs
        if return_routed_experts:
            body["return_routed_experts"] = True
        if response_format is not None:
            body["response_format"] = response_format
        data = await self.request("POST", "/v1/completions", {**body, **(extra or {})}, timeout=timeout)
        return self._completion(data, list(prompt_ids))

    async def chat(self, messages: list[dict[str, Any]], *, max_tokens: int, temperature: float = 1.0,
                   top_p: float = 1.0, n: int = 1, tools: list[dict[str, Any]] | None = None,
                   tool_choice: Any = None, response_format: dict[str, Any] | None = None,
                   seed: int | None = None, logprobs: bool = True, timeout: float | None = None,
                   extra: dict[str, Any] | None = None) -> Completion:
        """``POST /v1/chat/completions``; samples carry the parsed ``message`` and, when the server gives them,
        token ids; ``prompt_ids`` are the ids the server rendered the conversation to (when it says)."""
        body: dict[str, Any] = {"model": await self.model_name(), "messages": messages, "max_tokens": max_tokens,
                                "temperature": temperature, "top_p": top_p, "n": n, "logprobs": logprobs,
                                "return_token_ids": True}
        for key, value in (("tools", tools), ("tool_choice", tool_choice), ("response_format", response_format),
                           ("seed", seed)):
            if value is not None:
                body[key] = value
        data = await self.request("POST", "/v1/chat/completions", {**body, **(extra or {})}, timeout=timeout)
        return self._completion(data, None, chat=True)

    async def score(self, token_ids: Sequence[int], timeout: float | None = None) -> list[float | None]:
        """The logprob the model gives each of ``token_ids`` after the ones before it (None for the first), through
        vLLM's ``prompt_logprobs`` (one generated token, discarded). Idempotent: retried."""
        body = {"model": await self.model_name(), "prompt": list(token_ids), "max_tokens": 1, "temperature": 0,
                "prompt_logprobs": 0, "return_token_ids": True}
        data = await self.request("POST", "/v1/completions", body, idempotent=True, timeout=timeout)
        c = self._completion(data, list(token_ids))
        if c.prompt_logprobs is None:
            raise PolicyProtocolError("the server returned no prompt_logprobs")
        return c.prompt_logprobs

    async def tokenize(self, *, prompt: str | None = None, messages: list[dict[str, Any]] | None = None,
                       tools: list[dict[str, Any]] | None = None) -> list[int]:
        """vLLM's ``POST /tokenize`` (text, or chat messages through the server's template)."""
        body: dict[str, Any] = {"model": await self.model_name()}
        if prompt is not None:
            body["prompt"] = prompt
        if messages is not None:
            body.update(messages=messages, add_generation_prompt=True, **({"tools": tools} if tools else {}))
        data = await self.request("POST", "/tokenize", body, idempotent=True)
        if not isinstance(data.get("tokens"), list):
            raise PolicyProtocolError("/tokenize returned no tokens")
        return [int(t) for t in data["tokens"]]

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        data = await self.request("POST", "/detokenize", {"model": await self.model_name(), "tokens": list(token_ids)},
                                  idempotent=True)
        return str(data.get("prompt", ""))

    async def metrics(self) -> dict[str, Any]:
        """Our server's ``/metrics`` (engine counters, the prefix cache's among them)."""
        return await self.request("GET", "/metrics", idempotent=True)

    def _completion(self, data: dict[str, Any], sent_ids: list[int] | None, chat: bool = False) -> Completion:
        choices = data.get("choices")
        if not isinstance(choices, list) or not choices:
            raise PolicyProtocolError("the answer has no choices")
        samples = []
        for ch in sorted(choices, key=lambda c: c.get("index", 0)):
            ids = _token_ids(ch)
            if ids is None and not chat:
                raise PolicyProtocolError("the server returned no output token ids (it needs vLLM's "
                                          "return_token_ids or return_tokens_as_token_ids)")
            msg = ch.get("message") if chat else None
            text = (msg or {}).get("content") or "" if chat else str(ch.get("text") or "")
            samples.append(Sample(ids or [], _logprobs(ch), ch.get("finish_reason"), text, ch.get("routed_experts"),
                                  ch.get("abort_reason"), msg))
        prompt_ids = data.get("prompt_token_ids") or choices[0].get("prompt_token_ids")
        prompt_ids = [int(t) for t in prompt_ids] if isinstance(prompt_ids, list) else sent_ids
        usage = data.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        items = data.get("prompt_logprobs", choices[0].get("prompt_logprobs"))
        version = data.get("weight_version")
        return Completion(samples, prompt_ids, int(version) if isinstance(version, int) else None,
                          int(cached) if isinstance(cached, int) else None,
                          prompt_logprobs_of(items, prompt_ids or []), data.get("prompt_routed_experts"), usage, data)


def _retry_after(r: httpx.Response) -> float | None:
    try:
        return max(0.0, float(r.headers.get("retry-after", "")))
    except ValueError:
        return None


class SyncPolicyClient:
    """A blocking wrapper (its own event loop) for scripts and tests; the same methods, not coroutines."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self.client = PolicyClient(*args, **kwargs)

    def _run(self, coro: Any) -> Any:
        return self._loop.run_until_complete(coro)

    def complete(self, prompt_ids: Sequence[int], **kw: Any) -> Completion:
        return self._run(self.client.complete(prompt_ids, **kw))

    def chat(self, messages: list[dict[str, Any]], **kw: Any) -> Completion:
        return self._run(self.client.chat(messages, **kw))

    def models(self) -> list[dict[str, Any]]:
        return self._run(self.client.models())

    def score(self, token_ids: Sequence[int]) -> list[float | None]:
        return self._run(self.client.score(token_ids))

    def close(self) -> None:
        self._run(self.client.aclose())
        self._loop.close()

    def __enter__(self) -> SyncPolicyClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
