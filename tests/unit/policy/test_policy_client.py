"""policy.client: retries only where a request cannot have run twice (or is idempotent), typed errors, the
concurrency limit, answers of other servers (vLLM's token-id strings), and token-in/token-out against our
server in-process (a multi-turn episode reuses the server's prefix state)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import pytest

from policy.chat import IM_END, IM_MIDDLE, IM_USER, Control
from policy.client import (
    PolicyBadRequest,
    PolicyClient,
    PolicyProtocolError,
    PolicyServerError,
    PolicyTimeout,
    PolicyUnreachable,
    SyncPolicyClient,
)

MODELS = {"object": "list", "data": [{"id": "m", "object": "model"}]}

MORE = [Control(IM_END), Control(IM_USER), "user", Control(IM_MIDDLE), "more"]   # the next user turn


def _answer(n: int = 1) -> dict:
    return {"choices": [{"index": i, "text": "ab", "token_ids": [5, 6], "finish_reason": "length",
                         "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-0.5, -1.5]}} for i in range(n)],
            "prompt_token_ids": [1, 2, 3], "weight_version": 4,
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 2}}}


def _client(handler, **kw) -> PolicyClient:
    kw = {"backoff": 0.001, "model": "m", **kw}
    return PolicyClient("http://policy.test/v1", "tok", transport=httpx.MockTransport(handler), **kw)


def run(coro):
    return asyncio.run(coro)


def test_complete_sends_token_ids_and_reads_the_answer():
    seen: list[dict] = []

    def handler(req: httpx.Request) -> httpx.Response:
        assert req.headers["authorization"] == "Bearer tok" and req.url.path == "/v1/completions"
        seen.append(json.loads(req.content))
        return httpx.Response(200, json=_answer(2))

    async def go():
        async with _client(handler) as c:
            return await c.complete([1, 2, 3], max_tokens=2, temperature=0.7, n=2, stop_token_ids=[9], seed=1,
                                    return_routed_experts=True)

    out = run(go())
    body = seen[0]
    assert body["prompt"] == [1, 2, 3] and body["n"] == 2 and body["stop_token_ids"] == [9]
    assert body["return_token_ids"] is True and body["logprobs"] == 1 and body["return_routed_experts"] is True
    assert [s.token_ids for s in out.samples] == [[5, 6], [5, 6]] and out.samples[0].logprobs == [-0.5, -1.5]
    assert out.weight_version == 4 and out.cached_tokens == 2 and out.prompt_ids == [1, 2, 3]
    assert out.samples[0].finish_reason == "length"


def test_vllm_token_id_strings_and_missing_ids():
    def handler(req: httpx.Request) -> httpx.Response:
        body = json.loads(req.content)
        if body["prompt"] == [1]:   # vLLM with return_tokens_as_token_ids
            return httpx.Response(200, json={"choices": [{"index": 0, "text": "x", "finish_reason": "stop", "logprobs": {
                "tokens": ["token_id:7", "token_id:8"], "token_logprobs": [-1.0, -2.0]}}]})
        return httpx.Response(200, json={"choices": [{"index": 0, "text": "x", "finish_reason": "stop"}]})

    async def go():
        async with _client(handler) as c:
            a = await c.complete([1], max_tokens=2)
            with pytest.raises(PolicyProtocolError, match="token ids"):
                await c.complete([2], max_tokens=2)
            return a

    a = run(go())
    assert a.samples[0].token_ids == [7, 8] and a.weight_version is None and a.prompt_ids == [1]


def test_connect_failures_and_overload_are_retried_but_a_sent_generation_is_not():
    calls = {"n": 0}

    def flaky(req: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        if calls["n"] == 1:
            raise httpx.ConnectError("refused")
        if calls["n"] == 2:
            return httpx.Response(503, json={"error": {"message": "busy"}}, headers={"retry-after": "0"})
        return httpx.Response(200, json=_answer())

    async def go(handler, **kw):
        async with _client(handler, **kw) as c:
            return await c.complete([1, 2, 3], max_tokens=2), c.retries

    out, retries = run(go(flaky))
    assert out.samples[0].token_ids == [5, 6] and retries == 2 and calls["n"] == 3

    def read_timeout(req: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        raise httpx.ReadTimeout("slow")

    calls["n"] = 0
    with pytest.raises(PolicyTimeout):
        run(go(read_timeout))
    assert calls["n"] == 1                              # the server may be generating it: not sent twice

    def broken(req: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        raise httpx.RemoteProtocolError("server disconnected")

    calls["n"] = 0
    with pytest.raises(PolicyUnreachable):
        run(go(broken))
    assert calls["n"] == 1

    def down(req: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        raise httpx.ConnectError("refused")

    calls["n"] = 0
    with pytest.raises(PolicyUnreachable, match="cannot connect"):
        run(go(down, max_retries=2))
    assert calls["n"] == 3                              # bounded: 1 + 2 retries


def test_idempotent_calls_are_retried_after_a_timeout_and_errors_are_typed():
    calls = {"n": 0}

    def handler(req: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        if req.url.path == "/v1/models":
            if calls["n"] == 1:
                raise httpx.ReadTimeout("slow")
            return httpx.Response(200, json=MODELS)
        body = json.loads(req.content)
        if body["max_tokens"] == 0:
            return httpx.Response(400, json={"error": {"message": "max_tokens must be at least 1", "code": 400}})
        return httpx.Response(500, text="boom")

    async def go():
        async with _client(handler, model=None) as c:
            assert await c.model_name() == "m"
            with pytest.raises(PolicyBadRequest) as bad:
                await c.complete([1], max_tokens=0)
            assert bad.value.status == 400 and bad.value.reason == "max_tokens must be at least 1"
            n = calls["n"]
            with pytest.raises(PolicyServerError) as err:
                await c.complete([1], max_tokens=2)
            assert err.value.status == 500 and calls["n"] == n + 1     # a 5xx of a generation: not retried

    run(go())


def test_the_concurrency_limit_bounds_requests_in_flight():
    state = {"now": 0, "most": 0}

    async def handler(req: httpx.Request) -> httpx.Response:
        state["now"] += 1
        state["most"] = max(state["most"], state["now"])
        await asyncio.sleep(0.01)
        state["now"] -= 1
        return httpx.Response(200, json=_answer())

    async def go():
        async with _client(handler, max_concurrency=3) as c:
            await asyncio.gather(*(c.complete([1, 2, 3], max_tokens=2) for _ in range(12)))

    run(go())
    assert state["most"] == 3


def test_sync_wrapper_and_no_torch_import():
    with SyncPolicyClient("http://policy.test", model="m",
                          transport=httpx.MockTransport(lambda r: httpx.Response(200, json=_answer()))) as c:
        assert c.complete([1, 2, 3], max_tokens=2).samples[0].token_ids == [5, 6]
    code = "import sys, policy.client; assert 'torch' not in sys.modules and 'tokenizers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_token_in_token_out_against_our_server(tok, server_app):
    """A multi-turn episode through the client: each turn sends the ids, appends the answer verbatim; the
    server reuses its state (cached_tokens) and answers exactly what a server without reuse answers."""
    app, plain_app = server_app

    async def episode(a) -> list:
        async with PolicyClient("http://policy.test", "t", transport=httpx.ASGITransport(app=a)) as c:
            prompt = tok.encode_chat([{"role": "user", "content": "list the files"}])
            turns = []
            for _ in range(3):
                out = await c.complete(prompt, max_tokens=8, temperature=0, return_routed_experts=True)
                turns.append(out)
                prompt = prompt + out.samples[0].token_ids + tok.encode_pieces(MORE)
            group = await c.complete(prompt, max_tokens=4, temperature=1.0, n=3, seed=11)
            return turns + [group]

    async def both():
        return await episode(app), await episode(plain_app)

    with_reuse, without = run(both())
    for a, b in zip(with_reuse, without, strict=True):
        assert [s.token_ids for s in a.samples] == [s.token_ids for s in b.samples]
        assert a.weight_version == 0 and a.prompt_ids == b.prompt_ids
    assert [t.cached_tokens for t in with_reuse[1:3]] == [len(t.prompt_ids) + len(t.samples[0].token_ids) - 1
                                                          for t in with_reuse[:2]]
    assert all(t.cached_tokens == 0 for t in without)
    first = with_reuse[0]
    assert len(first.samples[0].routed_experts) == len(first.samples[0].token_ids)
    assert len(first.prompt_routed_experts) == len(first.prompt_ids) - 1
    assert len({tuple(s.token_ids) for s in with_reuse[3].samples}) > 1
