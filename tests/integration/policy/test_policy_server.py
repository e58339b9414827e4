"""The policy server for real (EP=2 over gloo, on a free loopback port) driven by the official openai client."""

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from policy.chat import IM_END, IM_MIDDLE, IM_USER, Control
from policy.client import PolicyClient
from policy.config import k3_mini
from policy.engines import reload_weights, smoke_check
from policy.model import K3Model
from policy.runner import save_weights
from policy.tokenizer import load_tokenizer

from ..server_fixtures import k3_mini_server

pytestmark = pytest.mark.integration
TOKEN = "test-token-123"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def spec():
    # 320: room after verify's tool-declaring prompt (~240 tokens) for the random model's forced call
    with k3_mini_server(TOKEN, ep=2, max_model_len=320) as spec:
        yield spec


@pytest.fixture()
def client(spec):
    return openai.OpenAI(base_url=spec.base_url + "/v1", api_key=TOKEN, max_retries=0)


def _checkpoint(path, seed: int) -> str:
    tok = load_tokenizer()
    torch.manual_seed(seed)
    save_weights(K3Model(k3_mini(vocab_size=tok.vocab_size)), str(path))
    return str(path)


def test_models_and_chat_with_tools(client):
    assert [m.id for m in client.models.list().data] == ["k3-mini"]
    r = client.chat.completions.create(
        model="k3-mini", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=8, temperature=0,
        logprobs=True)
    choice = r.choices[0].model_dump()
    extra = r.model_dump()
    assert len(choice["token_ids"]) == len(choice["logprobs"]["content"]) == r.usage.completion_tokens > 0
    assert extra["prompt_token_ids"] and extra["weight_version"] == 0
    tok = load_tokenizer()
    assert tok.decode(extra["prompt_token_ids"]).endswith(
        '<|open|>call tool="get_weather" index="0"<|sep|><|open|>json type="object"<|sep|>')
    # an untrained model writes arbitrary arguments: either valid tool calls or content flagged as malformed
    assert choice["malformed_tool_calls"] or choice["message"]["tool_calls"]
    req = client.chat.completions.create(model="k3-mini", messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                         tool_choice="required", max_tokens=4)
    assert tok.decode(req.model_extra["prompt_token_ids"]).endswith('<|open|>tools<|sep|><|open|>call tool="')


def test_streaming_gives_the_same_tokens_as_non_streaming(client):
    kw = dict(model="k3-mini", messages=[{"role": "user", "content": "hello"}], max_tokens=10, temperature=0.8, seed=5)
    full = client.chat.completions.create(**kw)
    ids, content, finish = [], "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            ids += (c.model_extra or {}).get("token_ids", [])
            content += c.delta.content or ""
            finish = c.finish_reason or finish
    assert ids == full.choices[0].model_extra["token_ids"]
    assert content == (full.choices[0].message.content or "") and finish == full.choices[0].finish_reason


def test_completions_accept_token_ids(client):
    tok = load_tokenizer()
    prompt = tok.encode_text("def main():")
    r = client.completions.create(model="k3-mini", prompt=prompt, max_tokens=5, temperature=0, logprobs=1)
    extra = r.model_dump()
    assert extra["prompt_token_ids"] == prompt
    assert len(extra["choices"][0]["token_ids"]) == len(r.choices[0].logprobs.token_logprobs) == 5
    # the EP=2 server decodes exactly what one plain process does with the same (seed 0) weights
    torch.manual_seed(0)
    model = K3Model(k3_mini(vocab_size=tok.vocab_size)).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(5):
            ids.append(int(model(torch.tensor([ids]))[0][0, -1].argmax()))
    assert ids[len(prompt):] == extra["choices"][0]["token_ids"]
    r2 = client.completions.create(model="k3-mini", prompt="def main():", max_tokens=5, temperature=0, n=2)
    assert [c.model_extra["token_ids"] for c in r2.choices] == [extra["choices"][0]["token_ids"]] * 2
    chunks = list(client.completions.create(model="k3-mini", prompt=prompt, max_tokens=5, temperature=0, stream=True))
    assert chunks[0].model_extra["prompt_token_ids"] == prompt
    assert sum((c.choices[0].model_extra["token_ids"] for c in chunks), []) == extra["choices"][0]["token_ids"]
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def _plain_greedy(ids: list[int], steps: int) -> tuple[list[int], list[list[list[int]]]]:
    """Greedy tokens of one plain process with the server's (seed 0) weights, and the experts of each position."""
    torch.manual_seed(0)
    model = K3Model(k3_mini(vocab_size=load_tokenizer().vocab_size)).eval()
    ids = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids]))[0][0, -1].argmax()))
        model(torch.tensor([ids[:-1]]))
    return ids, model.last_routing(1, len(ids) - 1)[0].tolist()


def test_ep2_reuses_prefix_state_forks_samples_and_returns_routing(spec):
    """Multi-turn on the EP=2 server: the second turn starts from the state the first left (on whichever rank
    holds it), decodes exactly what one plain process does, and reports the routing a plain forward has."""
    tok = load_tokenizer()

    async def go():
        async with PolicyClient(spec.base_url, TOKEN) as c:
            before = await c.metrics()
            p1 = tok.encode_chat([{"role": "user", "content": "run ls"}])
            t1 = await c.complete(p1, max_tokens=6, temperature=0, return_routed_experts=True)
            p2 = p1 + t1.samples[0].token_ids + tok.encode_pieces([Control(IM_END), Control(IM_USER), "user",
                                                                    Control(IM_MIDDLE), "again"])
            t2 = await c.complete(p2, max_tokens=6, temperature=0, return_routed_experts=True)
            group = await c.complete(p2 + [5], max_tokens=4, temperature=1.0, n=4, seed=3)
            return before, t1, t2, group, await c.metrics()

    before, t1, t2, group, after = asyncio.run(go())
    assert t2.cached_tokens == len(t1.prompt_ids) + len(t1.samples[0].token_ids) - 1 > 0
    full, routing = _plain_greedy(t2.prompt_ids, 6)
    assert t2.samples[0].token_ids == full[len(t2.prompt_ids):]
    P = len(t2.prompt_ids)
    assert t2.samples[0].routed_experts == routing[P - 1:]
    assert t2.prompt_routed_experts == routing[:P - 1]     # reused positions too: kept with the prefix state
    assert group.cached_tokens == P            # extends the state kept after the second prompt's prefill
    assert len({tuple(s.token_ids) for s in group.samples}) > 1
    computed = after["prefill_tokens"] - before["prefill_tokens"]
    saved = after["prefill_tokens_saved"] - before["prefill_tokens_saved"]
    assert computed + saved == len(t1.prompt_ids) + len(t2.prompt_ids) + 4 * len(group.prompt_ids)
    assert saved >= t2.cached_tokens + P + 3 * len(group.prompt_ids)      # the n=4 request prefilled one token
    assert after["prefix_cache"]["entries"] > 0


def test_verify_passes_against_the_ep2_server(spec):
    pytest.importorskip("llguidance")
    verify = [sys.executable, "-m", "policy.cli", "verify", spec.base_url]   # the token from the environment
    r = subprocess.run([*verify, "--json"], capture_output=True, text=True, timeout=240,
                       env={**os.environ, "AGENTENV_POLICY_TOKEN": TOKEN})
    report = json.loads(r.stdout)
    assert r.returncode == 0 and report["ok"], r.stdout + r.stderr
    assert {c["status"] for c in report["checks"]} == {"PASS"}
    bad = subprocess.run(verify, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "AGENTENV_POLICY_TOKEN": "wrong"})
    assert bad.returncode == 1 and "models" in bad.stdout and "FAIL" in bad.stdout


def test_concurrent_requests_are_batched(client, spec):
    def one(i: int) -> int:
        r = client.completions.create(model="k3-mini", prompt=f"request {i}", max_tokens=24, temperature=0)
        return len(r.choices[0].model_extra["token_ids"])

    with ThreadPoolExecutor(6) as pool:
        assert list(pool.map(one, range(6))) == [24] * 6
    m = httpx.get(spec.base_url + "/metrics").json()
    assert m["max_batch_seen"] >= 2 and m["ep_size"] == 2
    load = m["tokens_per_expert_total"]
    assert len(load) == 7 and len(load[0]) == 64 and sum(map(sum, load)) > 0


def test_update_weights_bumps_the_version(client, spec, tmp_path):
    before = httpx.get(spec.base_url + "/health").json()["weight_version"]
    result: dict = {}

    def long_request() -> None:  # in flight during the update: finishes on the old weights (drain)
        r = client.completions.create(model="k3-mini", prompt="x", max_tokens=120, temperature=0)
        result.update(r.model_dump())

    t = threading.Thread(target=long_request)
    t.start()
    for _ in range(2000):  # wait until the request is running, so the update must drain it
        if httpx.get(spec.base_url + "/metrics").json()["running"] >= 1:
            break
        time.sleep(0.005)
    else:
        raise AssertionError("the long request never showed as running")
    r = httpx.post(spec.base_url + "/update_weights", json={"path": _checkpoint(tmp_path / "w", 7)},
                   headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120)
    t.join(60)
    assert r.status_code == 200 and r.json()["weight_version"] == before + 1
    # it ran on the old weights to its end (its length, or the end-of-turn token an untrained model may pick)
    assert result["weight_version"] == before and result["choices"][0]["finish_reason"] in ("length", "stop")
    after = client.completions.create(model="k3-mini", prompt="x", max_tokens=3)
    assert after.model_extra["weight_version"] == before + 1


def test_bad_input_is_a_4xx_and_the_server_keeps_serving(client, spec):
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=msgs)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="k3-mini", messages=msgs, max_tokens=-1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="k3-mini", prompt=list(range(20, 420)), max_tokens=4)  # > 320 context
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="k3-mini", messages=msgs, tools=[{"type": "function", "function": {}}])
    bad = httpx.post(spec.base_url + "/v1/chat/completions", content=b"{not json",
                     headers={"Authorization": f"Bearer {TOKEN}", "content-type": "application/json"})
    assert 400 <= bad.status_code < 500 and "error" in bad.json()
    missing = httpx.post(spec.base_url + "/update_weights", json={"path": "/nonexistent.safetensors"},
                         headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    assert missing.status_code == 400 and "could not load" in json.dumps(missing.json())
    ok = client.chat.completions.create(model="k3-mini", messages=msgs, max_tokens=2)
    assert ok.choices[0].finish_reason == "length"


def test_auth_is_required_except_health_and_metrics(spec):
    assert httpx.get(spec.base_url + "/v1/models").status_code == 401
    assert httpx.get(spec.base_url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.post(spec.base_url + "/update_weights", json={"path": "x"}).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=spec.base_url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(spec.base_url + "/health").status_code == 200
    assert httpx.get(spec.base_url + "/metrics").status_code == 200


def test_engine_client_code_runs_against_our_server(spec, tmp_path):
    out = smoke_check(spec.base_url, TOKEN, "k3-mini")
    assert out["models"] == ["k3-mini"] and out["finish_reason"] in ("length", "stop")
    v = httpx.get(spec.base_url + "/health").json()["weight_version"]
    assert reload_weights(spec, _checkpoint(tmp_path / "w2", 8), version=8) == v + 1   # ours counts its loads
