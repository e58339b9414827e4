"""The generation engine (EP=1, in-process): sampling, stop handling, continuous batching, weight updates,
and the vLLM / SGLang command builders."""

import math
import time

import pytest
import torch
from safetensors.torch import save_file

from policy.config import k3_mini
from policy.engine import Engine, SamplingParams, sample
from policy.engines import EngineSpec, build_command
from policy.model import K3Model
from policy.runner import save_weights
from policy.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def engine():
    tok = load_tokenizer()
    cfg = k3_mini(vocab_size=tok.vocab_size, eos_token_id=tok.eos_id)
    eng = Engine(cfg, tok, ep_size=1, seed=0, max_context=512)
    yield eng
    eng.close()


def test_sample_greedy_top_p_and_seed():
    logits = torch.tensor([0.0, 3.0, 1.0, -2.0])
    gen = torch.Generator().manual_seed(0)
    tok, lp = sample(logits, SamplingParams(temperature=0), gen)
    assert tok == 1 and abs(lp - float(torch.log_softmax(logits, -1)[1])) < 1e-6
    # top_p small enough keeps only the most likely token
    assert {sample(logits, SamplingParams(top_p=0.5), gen)[0] for _ in range(20)} == {1}
    def draws(seed: int) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return [sample(logits, SamplingParams(temperature=2.0), g)[0] for _ in range(10)]

    assert draws(7) == draws(7) and len(set(draws(7))) > 1


def test_seeded_sampling_is_reproducible(engine):
    tok = engine.tokenizer
    p = SamplingParams(max_tokens=8, temperature=1.0, seed=123)
    a, b = engine.generate([tok.encode_text("hello"), tok.encode_text("hello")], p)
    assert a.output_ids == b.output_ids and len(a.output_ids) == 8
    assert all(lp <= 0 for lp in a.logprobs) and len(a.logprobs) == 8
    assert a.finish_reason == "length"


def test_joining_the_running_batch_does_not_change_greedy_outputs(engine):
    tok = engine.tokenizer
    greedy = SamplingParams(max_tokens=12, temperature=0)
    alone = engine.generate([tok.encode_text("the agent reads the task")], greedy)[0]
    first = engine.submit(tok.encode_text("the agent reads the task"), greedy)
    while len(first.output_ids) < 3 and not first.done.is_set():
        time.sleep(0.001)
    late = engine.submit(tok.encode_text("run the tests"), greedy)
    first.done.wait(30)
    late.done.wait(30)
    assert first.output_ids == alone.output_ids
    assert engine.metrics()["max_batch_seen"] >= 2


def test_stop_strings_truncate_text(engine):
    tok = engine.tokenizer
    base = engine.generate([tok.encode_text("def f")], SamplingParams(max_tokens=10, temperature=0))[0]
    stop = base.text[3:6]
    assert stop
    out = engine.generate([tok.encode_text("def f")], SamplingParams(max_tokens=10, temperature=0, stop=[stop]))[0]
    assert out.finish_reason == "stop" and stop not in out.text and base.text.startswith(out.text)


def test_bad_prompts_are_refused(engine):
    with pytest.raises(ValueError):
        engine.submit([], SamplingParams())
    with pytest.raises(ValueError):
        engine.submit([1] * 600, SamplingParams())
    with pytest.raises(ValueError):
        engine.submit([10 ** 9], SamplingParams())


def test_update_weights_bumps_version_and_changes_outputs(engine, tmp_path):
    tok = engine.tokenizer
    greedy = SamplingParams(max_tokens=6, temperature=0)
    before = engine.generate([tok.encode_text("hello")], greedy)[0]
    torch.manual_seed(99)
    path = str(tmp_path / "w")   # a Kimi checkpoint folder
    save_weights(K3Model(engine.cfg), path)
    v0 = engine.weight_version
    long = engine.submit(tok.encode_text("hello"), SamplingParams(max_tokens=400, temperature=0))
    while not long.output_ids:
        time.sleep(0.001)
    assert engine.update_weights(path, mode="abort") == v0 + 1
    long.done.wait(30)
    assert long.finish_reason == "abort" and long.abort_reason == "weights_updated" and long.weight_version == v0
    after = engine.generate([tok.encode_text("hello")], greedy)[0]
    assert after.weight_version == v0 + 1 and after.output_ids != before.output_ids
    with pytest.raises(FileNotFoundError):
        engine.update_weights(str(tmp_path / "missing.safetensors"))
    torch.manual_seed(1)
    save_weights(K3Model(k3_mini(vocab_size=engine.cfg.vocab_size + 1)), str(tmp_path / "other"))
    with pytest.raises(ValueError, match="different model"):
        engine.update_weights(str(tmp_path / "other"))
    other = K3Model(k3_mini(vocab_size=engine.cfg.vocab_size + 1)).state_dict()
    save_file(other, str(tmp_path / "other.safetensors"))   # the single file under our own names, as before
    with pytest.raises(ValueError, match="shapes"):
        engine.update_weights(str(tmp_path / "other.safetensors"))
    assert engine.weight_version == v0 + 1
    save_file(K3Model(engine.cfg).state_dict(), str(tmp_path / "old.safetensors"))
    assert engine.update_weights(str(tmp_path / "old.safetensors")) == v0 + 2   # old checkpoints still load
    assert engine.generate([tok.encode_text("hi")], greedy)[0].finish_reason == "length"  # still serving


def test_vllm_and_sglang_commands_enable_expert_parallelism():
    v, venv = build_command(EngineSpec("vllm", "/models/kimi-k3", tensor_parallel_size=1, data_parallel_size=16,
                                       api_key="s3cret"))
    assert v[:3] == ["vllm", "serve", "/models/kimi-k3"] and "--enable-expert-parallel" in v
    assert v[v.index("--data-parallel-size") + 1] == "16" and v[v.index("--tensor-parallel-size") + 1] == "1"
    assert v[v.index("--tool-call-parser") + 1] == "kimi_k3" and v[v.index("--reasoning-parser") + 1] == "kimi_k3"
    assert "s3cret" not in v and venv["VLLM_API_KEY"] == "s3cret"
    assert v[v.index("--host") + 1] == "127.0.0.1"
    s, _ = build_command(EngineSpec("sglang", "/models/kimi-k3", tensor_parallel_size=8, data_parallel_size=2))
    assert s[:3] == ["python", "-m", "sglang.launch_server"]
    assert s[s.index("--tp-size") + 1] == "16" and s[s.index("--ep-size") + 1] == "16"
    assert "--enable-dp-attention" in s and s[s.index("--tool-call-parser") + 1] == "kimi_k3"
    no_ep, _ = build_command(EngineSpec("vllm", "m", expert_parallel=False))
    assert "--enable-expert-parallel" not in no_ep
    with pytest.raises(ValueError):
        build_command(EngineSpec("tgi", "m"))


def test_top_p_reports_the_logprob_of_the_truncated_renormalised_distribution():
    """With top_p < 1 the token is drawn from the nucleus, renormalised: the logprob reported is log(p / mass of
    the nucleus) after temperature, not log p of the full distribution."""
    logits = torch.tensor([2.0, 1.5, 0.0, -1.0, -3.0])
    gen = torch.Generator().manual_seed(0)
    for temperature, top_p in ((1.0, 0.8), (0.7, 0.9), (1.3, 0.5)):
        probs = torch.softmax(logits / temperature, -1)
        srt, order = probs.sort(descending=True)
        keep = order[(srt.cumsum(0) - srt) < top_p]
        mass = float(probs[keep].sum())
        assert mass < 1.0
        seen = set()
        for _ in range(50):
            tok, lp = sample(logits, SamplingParams(temperature=temperature, top_p=top_p), gen)
            assert tok in keep.tolist()
            assert lp == pytest.approx(math.log(float(probs[tok]) / mass), abs=1e-5)
            seen.add(tok)
        assert len(seen) > 1          # more than the argmax was drawn: the renormalisation was checked on several
    # top_p = 1: the plain temperature-scaled log-prob, as before
    tok, lp = sample(logits, SamplingParams(temperature=0.7), gen)
    assert lp == pytest.approx(float(torch.log_softmax(logits / 0.7, -1)[tok]), abs=1e-6)
