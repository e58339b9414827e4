"""The server's fields beyond OpenAI's, on a real engine in-process: vLLM's ``prompt_logprobs`` layout,
``stop_token_ids``, ``/tokenize`` and ``/detokenize``, routed experts (whole and streamed), cached prompt tokens."""

from __future__ import annotations

import json

from policy.chat import render_chat

AUTH = {"Authorization": "Bearer t"}


def test_prompt_logprobs_follow_vllms_layout(post, client, tok):
    prompt = tok.encode_text("pytest collected 3 items")
    r = post("/v1/completions", {"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2, "n": 2})
    items = r["prompt_logprobs"]
    assert r["choices"][0]["prompt_logprobs"] == r["choices"][1]["prompt_logprobs"] == items
    assert items[0] is None and len(items) == len(prompt)
    for t, item in zip(prompt[1:], items[1:], strict=True):
        assert str(t) in item and 2 <= len(item) <= 3
        assert {"logprob", "rank", "decoded_token"} <= set(item[str(t)]) and item[str(t)]["decoded_token"] == tok.decode([t])
        best = min(item.values(), key=lambda v: v["rank"])
        assert best["rank"] == 1 and all(v["logprob"] <= best["logprob"] + 1e-6 for v in item.values())
    one = post("/v1/completions", {"prompt": prompt[:1], "max_tokens": 1, "prompt_logprobs": 0})
    assert one["prompt_logprobs"] == [None]
    chat = post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                                  "prompt_logprobs": 0})
    assert len(chat["prompt_logprobs"]) == len(chat["prompt_token_ids"])
    assert all(len(x) == 1 for x in chat["prompt_logprobs"][1:])
    bad = client.post("/v1/completions", headers=AUTH, json={"model": "k3-mini", "prompt": prompt, "prompt_logprobs": 50})
    assert bad.status_code == 400 and "prompt_logprobs" in bad.json()["error"]["message"]


def test_stop_token_ids_and_cached_tokens(post, tok):
    prompt = tok.encode_text("ls -la /testbed && cat setup.py")
    first = post("/v1/completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0})
    ids = first["choices"][0]["token_ids"]
    stop = post("/v1/completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                             "stop_token_ids": [ids[2]]})
    assert stop["choices"][0]["finish_reason"] == "stop" and stop["choices"][0]["token_ids"] == ids[:ids.index(ids[2]) + 1]
    assert stop["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt)    # the same prompt again: forked


def test_tokenize_and_detokenize_match_the_chat_route(post, client, tok):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    chat = post("/v1/chat/completions", {"messages": msgs, "tools": tools, "max_tokens": 1})
    t = post("/tokenize", {"messages": msgs, "tools": tools})
    assert t["tokens"] == chat["prompt_token_ids"] == tok.encode_chat(msgs, tools)
    assert t["count"] == len(t["tokens"]) and t["max_model_len"] == 512
    assert post("/tokenize", {"prompt": "hello"})["tokens"] == tok.encode_text("hello")
    assert post("/detokenize", {"tokens": t["tokens"]})["prompt"] == render_chat(msgs, tools)
    for path, body, code in [("/tokenize", {"model": "k3-mini"}, 400), ("/tokenize", {"model": "x", "prompt": "a"}, 404),
                             ("/detokenize", {"model": "k3-mini", "tokens": [-1]}, 400)]:
        r = client.post(path, headers=AUTH, json=body)
        assert r.status_code == code and r.json()["error"]["message"]
    assert client.post("/tokenize", json={"prompt": "a"}).status_code == 401


def test_routed_experts_stream_in_slices(post, client, tok):
    body = {"model": "k3-mini", "prompt": tok.encode_text("git diff --stat"), "max_tokens": 5, "temperature": 0,
            "return_routed_experts": True, "prompt_logprobs": 0}
    whole = post("/v1/completions", body)
    choice = whole["choices"][0]
    assert len(choice["routed_experts"]) == len(choice["token_ids"]) == 5
    assert all(len(layer) == 4 for tok_ in choice["routed_experts"] for layer in tok_)
    assert len(choice["routed_experts"][0]) == 7                     # k3-mini's 7 MoE layers
    assert len(whole["prompt_routed_experts"]) == len(body["prompt"]) - 1
    with client.stream("POST", "/v1/completions", headers=AUTH, json={**body, "stream": True}) as r:
        events = [json.loads(x.removeprefix("data: ")) for x in r.iter_lines() if x and x != "data: [DONE]"]
    assert sum((e["choices"][0]["routed_experts"] for e in events), []) == choice["routed_experts"]
    assert events[0]["prompt_logprobs"] == whole["prompt_logprobs"]
    assert events[0]["prompt_routed_experts"] == whole["prompt_routed_experts"]
    plain = post("/v1/completions", {"prompt": body["prompt"], "max_tokens": 2})
    assert "routed_experts" not in plain["choices"][0] and "prompt_routed_experts" not in plain
