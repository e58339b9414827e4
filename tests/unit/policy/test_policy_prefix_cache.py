"""Prefix-state reuse in the engine (EP=1, in-process): the ledger's lookup and LRU, multi-turn episodes and
n-sample requests with and without reuse (same greedy tokens, same logprobs to tolerance, fewer prefill tokens),
prompt logprobs and the experts every position was routed to (reused prefixes included), checked against a plain
forward."""

import pytest
import torch

from policy.chat import IM_END, Control, chat_pieces
from policy.config import k3_mini
from policy.engine import Engine, SamplingParams
from policy.model import K3Model
from policy.prefix_cache import PrefixIndex, state_nbytes
from policy.runner import save_weights
from policy.tokenizer import load_tokenizer

# the end of an answer, a tool output and the next assistant header
OBS = [Control(IM_END), *chat_pieces([{"role": "tool", "tool_call_id": "functions.bash:0", "content": "3 passed"}])]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def engines(tok):
    cfg = k3_mini(vocab_size=tok.vocab_size, eos_token_id=tok.eos_id)
    reuse = Engine(cfg, tok, seed=0, max_context=1024)
    plain = Engine(cfg, tok, seed=0, max_context=1024, prefix_cache_bytes=0)
    yield reuse, plain
    reuse.close()
    plain.close()


def _episode(engine: Engine, tok, turns: int = 3, **kw) -> list:
    prompt = tok.encode_chat([{"role": "user", "content": "fix the failing test"}])
    out = []
    for _ in range(turns):
        s = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0, **kw))[0]
        out.append(s)
        prompt = prompt + s.output_ids + tok.encode_pieces(OBS)   # the answer verbatim, then the new observation
    return out


def test_index_finds_the_longest_prefix_and_evicts_least_recently_used():
    idx = PrefixIndex(max_bytes=300, max_entries=3)
    a = idx.add(0, [1, 2], 100, has_logits=True)
    b = idx.add(1, [1, 2, 3, 4], 100, has_logits=False)
    assert a and b and idx.add(0, [1, 2], 100, has_logits=True) is None    # kept already
    assert idx.lookup([1, 2, 3, 4, 5]) is b and idx.lookup([1, 2, 3]) is a
    assert idx.lookup([1, 2]) is a                 # an exact prompt needs the entry's last logits ...
    assert idx.lookup([1, 2, 3, 4]) is a           # ... which the end-of-sequence entry b does not have
    assert idx.lookup([9, 1, 2]) is None
    c = idx.add(0, [7], 100, has_logits=True)
    assert c and idx.evict() == []
    idx.lookup([1, 2, 3, 4, 5])                    # b is now the most recently used; a the least
    d = idx.add(0, [8], 100, has_logits=True)
    assert d and idx.evict(protect={a.id}) == [c.id] and idx.lookup([7, 1]) is None
    assert idx.evict() == [] and len(idx) == 3 and idx.nbytes == 300
    assert idx.add(0, [5] * 10, 301, has_logits=True) is None          # could never fit
    e = idx.add(0, [1, 2, 3, 4], 100, has_logits=True)                  # replaces b (now with logits)
    assert e and b.id in idx.evict()
    assert sorted(idx.clear()) == sorted([a.id, d.id, e.id]) and len(idx) == 0 and idx.nbytes == 0
    assert PrefixIndex(0).add(0, [1], 1, True) is None
    cfg = k3_mini()
    assert state_nbytes(cfg, 100) - state_nbytes(cfg, 0) == 2 * 100 * ((64 + 16) * 4 + 1)


def test_multi_turn_reuse_gives_the_same_tokens_and_logprobs_with_fewer_prefill_tokens(engines, tok):
    reuse, plain = engines
    before = dict(reuse.metrics())
    with_reuse, without = _episode(reuse, tok), _episode(plain, tok)
    for a, b in zip(with_reuse, without, strict=True):
        assert a.output_ids == b.output_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4
    assert [s.cached_tokens for s in without] == [0, 0, 0]
    # turn k+1 starts from the state at the end of turn k: prompt + answer, less its last (never fed) token
    for prev, s in zip(with_reuse, with_reuse[1:], strict=False):
        assert s.cached_tokens == len(prev.prompt_ids) + len(prev.output_ids) - 1
    m = reuse.metrics()
    saved = m["prefill_tokens_saved"] - before["prefill_tokens_saved"]
    computed = m["prefill_tokens"] - before["prefill_tokens"]
    assert saved == sum(s.cached_tokens for s in with_reuse) > 0
    assert computed + saved == sum(len(s.prompt_ids) for s in with_reuse)
    assert m["prefix_cache"]["entries"] > 0 and 0 < m["prefix_cache"]["bytes"] <= m["prefix_cache"]["max_bytes"]
    assert plain.metrics()["prefill_tokens_saved"] == 0


def test_n_samples_prefill_once_and_fork_the_state(engines, tok):
    reuse, plain = engines
    prompt = tok.encode_text("def add(a, b):\n    return a + b\n\n# tests for add")
    before = reuse.metrics()["prefill_tokens"]
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=i) for i in range(4)]
    seqs = [reuse.submit(prompt, p) for p in params]
    refs = [plain.submit(prompt, p) for p in params]
    for s in seqs + refs:
        s.done.wait(30)
    assert reuse.metrics()["prefill_tokens"] - before == len(prompt)          # one prefill for all four
    assert [s.cached_tokens for s in seqs] == [0] + [len(prompt)] * 3
    assert [s.output_ids for s in seqs] == [r.output_ids for r in refs]     # forks sample like fresh prefills
    assert len({tuple(s.output_ids) for s in seqs}) > 1
    again = reuse.generate([prompt], SamplingParams(max_tokens=6, temperature=1.0, seed=2))[0]  # a later request
    assert again.cached_tokens == len(prompt) and again.output_ids == seqs[2].output_ids


def test_prompt_logprobs_score_the_generated_tokens_again(engines, tok):
    reuse, _ = engines
    prompt = tok.encode_text("the agent runs the tests and reads the output")
    for temperature in (0.0, 1.0):
        gen = reuse.generate([prompt], SamplingParams(max_tokens=8, temperature=temperature, seed=3))[0]
        full = prompt + gen.output_ids
        scored = reuse.generate([full], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))[0]
        assert scored.cached_tokens == 0 and scored.prompt_logprobs is not None    # scored from scratch
        assert len(scored.prompt_logprobs) == len(full) - 1
        again = [lp for lp, _, _ in scored.prompt_logprobs[len(prompt) - 1:]]
        assert max(abs(a - b) for a, b in zip(gen.logprobs, again, strict=True)) < 1e-4
        for lp, rank, alts in scored.prompt_logprobs:
            assert len(alts) == 2 and alts[0][1] >= alts[1][1] and rank >= 1 and lp <= alts[0][1] + 1e-6
            assert (rank == 1) == (abs(lp - alts[0][1]) < 1e-6)


def test_routed_experts_are_those_of_a_plain_forward(engines, tok):
    reuse, _ = engines
    turns = _episode(reuse, tok, turns=3, return_routed_experts=True)
    torch.manual_seed(0)
    model = K3Model(reuse.cfg).eval()
    n_moe = len(model.moe_layers())
    for s in turns:
        P = len(s.prompt_ids)
        with torch.no_grad():
            model(torch.tensor([s.prompt_ids + s.output_ids[:-1]]))
        rows = model.last_routing(1, P + len(s.output_ids) - 1)[0]      # (positions, layers, k)
        assert len(s.routed_experts) == len(s.output_ids)
        assert torch.tensor(s.routed_experts).shape == (len(s.output_ids), n_moe, reuse.cfg.num_experts_per_token)
        assert s.routed_experts == rows[P - 1:].tolist()
        assert s.prompt_routed_experts is not None and len(s.prompt_routed_experts) == P - 1
        # every prompt position, the reused prefix's included (kept with its state), as a plain forward routes it
        assert s.prompt_routed_experts == rows[:P - 1].tolist()
    assert turns[1].cached_tokens > 0 and turns[2].cached_tokens > 0


def test_a_routed_request_never_starts_from_a_state_kept_without_routing(tok):
    """A state kept by a request that did not record routing cannot give a routed request its prefix's experts:
    the routed request prefills (and keeps its own entry, with routing, once it finishes)."""
    cfg = k3_mini(vocab_size=tok.vocab_size, eos_token_id=tok.eos_id)
    eng = Engine(cfg, tok, seed=0, max_context=1024)
    try:
        first = _episode(eng, tok, turns=1)[0]
        nxt = first.prompt_ids + first.output_ids + tok.encode_pieces(OBS)
        plain = eng.generate([nxt], SamplingParams(max_tokens=4, temperature=0))[0]
        assert plain.cached_tokens > 0                       # reuse works for a request without routing
        routed = eng.generate([nxt + plain.output_ids + tok.encode_pieces(OBS)],
                              SamplingParams(max_tokens=4, temperature=0, return_routed_experts=True))[0]
        assert routed.cached_tokens == 0
        assert routed.prompt_routed_experts is not None and None not in routed.prompt_routed_experts
        again = eng.generate([routed.prompt_ids + routed.output_ids + tok.encode_pieces(OBS)],
                             SamplingParams(max_tokens=4, temperature=0, return_routed_experts=True))[0]
        assert again.cached_tokens > 0 and again.prompt_routed_experts is not None
        assert None not in again.prompt_routed_experts
        assert again.prompt_routed_experts[:len(routed.prompt_routed_experts)] == routed.prompt_routed_experts
        assert not set(eng._routes) - set(eng.prefix._entries)   # routing kept only for live entries
    finally:
        eng.close()


def test_a_tiny_budget_evicts_and_a_weight_update_forgets(tok, tmp_path):
    cfg = k3_mini(vocab_size=tok.vocab_size, eos_token_id=tok.eos_id)
    eng = Engine(cfg, tok, seed=0, max_context=1024, prefix_cache_bytes=state_nbytes(cfg, 60), prefix_cache_entries=2)
    try:
        turns = _episode(eng, tok, turns=3)
        m = eng.metrics()["prefix_cache"]
        assert m["evictions"] > 0 and m["entries"] <= 2 and m["bytes"] <= m["max_bytes"]
        # the rank holds what the ledger says, but for the changes the next step's plan carries
        held, ledger = set(eng.group.runner.entries), set(eng.prefix._entries)
        assert held <= ledger | set(eng.prefix._dropped) and ledger <= held | {e for _, e in eng._to_keep}
        prompt = turns[-1].prompt_ids
        torch.manual_seed(5)
        path = str(tmp_path / "w")
        save_weights(K3Model(cfg), path)
        eng.update_weights(path)
        assert len(eng.prefix) == 0 and not eng.group.runner.entries
        after = eng.generate([prompt], SamplingParams(max_tokens=4, temperature=0))[0]
        assert after.cached_tokens == 0 and after.weight_version == 1
    finally:
        eng.close()
