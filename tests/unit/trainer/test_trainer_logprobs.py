"""The trainer scores tokens as the server sampled them: for a random-weight k3-mini, the trainer's per-token
log-probs of generated sequences equal the serving engine's (incremental decoding, batched) to 1e-4, at temperature
1, 0.7 and greedy, before and after a training step and a weight sync; the engine's recorded routing is what the
training forward routes (exactly, with routing replay)."""

import pytest
import torch

from policy.config import k3_mini
from policy.engine import Engine, SamplingParams
from policy.tokenizer import load_tokenizer
from trainer.algorithm.batch import Batch, Sample
from trainer.algorithm.losses import LossConfig
from trainer.distributed.sync import WeightSync
from trainer.train import TrainConfig, Trainer


@pytest.fixture(scope="module")
def setup():
    tok = load_tokenizer()
    cfg = k3_mini(vocab_size=tok.vocab_size, eos_token_id=tok.eos_id)
    engine = Engine(cfg, tok, seed=0, max_context=512)
    trainer = Trainer(cfg, TrainConfig(seed=0, lr=1e-3))
    yield tok, engine, trainer
    trainer.close()
    engine.close()


def _generate(engine, tok, temperature, seed=1):
    prompts = [tok.encode_text("the agent reads the task and"), tok.encode_text("run the tests, then submit")]
    seqs = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=temperature, seed=seed,
                                                   return_routed_experts=True))
    return [Sample(s.prompt_ids + s.output_ids, [0] * len(s.prompt_ids) + [1] * len(s.output_ids),
                   [0.0] * len(s.prompt_ids) + s.logprobs, routing=[*(s.prompt_routed_experts or []), *s.routed_experts],
                   weight_version=s.weight_version) for s in seqs]


def _max_diff(samples, scored):
    return max(abs(a - b) for s, sc in zip(samples, scored, strict=True)
               for a, b, m in zip(sc.logprobs, s.logprobs, s.loss_mask, strict=True) if m)


def _route_mismatch(samples, scored):
    diff = total = 0
    for s, sc in zip(samples, scored, strict=True):
        got = sc.routing.sort(-1).values                     # every fed position: prompt and generated
        rec = torch.tensor(s.routing).sort(-1).values
        diff += int((got != rec).any(-1).sum())
        total += got.shape[0] * got.shape[1]
    return diff / total


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_trainer_logprobs_equal_the_servers(setup, temperature):
    tok, engine, trainer = setup
    samples = _generate(engine, tok, temperature)
    scored = trainer.score(samples, temperature=temperature)
    assert _max_diff(samples, scored) < 1e-4
    assert _route_mismatch(samples, scored) <= 0.05


def test_after_a_step_and_a_sync_the_server_serves_the_trained_weights(setup, tmp_path):
    tok, engine, trainer = setup
    samples = _generate(engine, tok, 1.0, seed=2)
    for i, s in enumerate(samples):
        s.advantage = 1.0 if i == 0 else -1.0
    before = trainer.score(samples)
    m = trainer.step(Batch(samples))
    assert m["tis_weight"] == pytest.approx(1.0, abs=1e-3) and m["rollout_kl"] < 1e-6   # on-policy: no mismatch
    sync = WeightSync([engine], str(tmp_path))
    result = sync.push(trainer)
    assert result.version == engine.weight_version >= 1 and result.step == trainer.step_count
    assert result.write_s > 0 and result.total_s >= result.write_s
    fresh = _generate(engine, tok, 1.0, seed=3)
    assert all(s.weight_version == result.version for s in fresh)           # what the next trajectories record
    after = trainer.score(fresh)
    assert _max_diff(fresh, after) < 1e-4
    assert _max_diff(samples, before) < 1e-4 and _max_diff(samples, trainer.score(samples)) > 1e-4


def test_routing_replay_reproduces_the_servers_routing(setup):
    tok, engine, _ = setup
    samples = _generate(engine, tok, 1.0, seed=4)
    with Trainer(engine.cfg, TrainConfig(seed=0, routing_replay=True, loss=LossConfig(temperature=1.0))) as t:
        t.model.load_state_dict(engine.group.runner.model.state_dict())
        scored = t.score(samples)
    assert _route_mismatch(samples, scored) == 0.0
    assert _max_diff(samples, scored) < 1e-4
