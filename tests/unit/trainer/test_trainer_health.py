"""The RL health figures and the router's balancing bias on a tiny K3: the step reports ratio / TIS extremes,
advantage statistics, all-equal groups, response length, malformed-call rate and skipped updates with sane values,
they reach rl_health.png; the aux-loss-free bias moves toward balance, only when asked, and goes with the weights
(the pushed safetensors the policy runner loads, and checkpoints)."""

import random
import statistics
import sys
from pathlib import Path

import pytest
import torch

from policy.hf_format import read_checkpoint
from policy.runner import Runner
from trainer.algorithm.advantages import AdvantageConfig
from trainer.algorithm.balance import update_router_bias
from trainer.algorithm.batch import Batch, rl_batch
from trainer.algorithm.health import merge, plot_health
from trainer.train import TrainConfig, Trainer

sys.path.insert(0, str(Path(__file__).parent))
from trainer_helpers import make_traj, tiny_cfg  # noqa: E402

BIAS = "e_score_correction_bias"


def _trajs(seed=0, groups=3, size=4):
    rng = random.Random(seed)
    out = [make_traj(rng, f"g{g}", i, float(rng.random() < 0.5), gen=rng.randint(2, 6)) for g in range(groups)
           for i in range(size)]
    for i in range(size):                         # one all-equal group: no signal
        out.append(make_traj(rng, "same", i, 1.0))
    out[0].turns[0].malformed = True              # 1 malformed turn of all the turns
    return out


def test_the_batch_reports_advantages_all_equal_groups_and_malformed_calls():
    trajs = _trajs()
    batch = rl_batch(trajs)
    st = batch.stats
    adv = [s.advantage for s in batch.samples]
    assert st["advantage/min"] == min(adv) < 0 < max(adv) == st["advantage/max"]
    assert st["advantage/mean"] == pytest.approx(sum(adv) / len(adv))
    assert st["advantage/std"] == pytest.approx(statistics.pstdev(adv)) and st["advantage/std"] > 0
    assert st["groups_all_equal"] >= 1.0 and st["groups_dropped"] == 0.0
    turns = sum(len(t.turns) for t in trajs)
    assert st["malformed_rate"] == pytest.approx(1 / turns)
    assert st["response_length"] == pytest.approx(sum(t.generated_tokens for t in trajs) / len(trajs))
    dropped = rl_batch(trajs, AdvantageConfig(drop_all_equal=True))
    assert dropped.stats["groups_dropped"] == dropped.stats["groups_all_equal"] >= 1.0


def test_step_metrics_carry_ratio_and_tis_extremes_and_reach_the_health_plot(tmp_path):
    batch = rl_batch(_trajs(1))
    with Trainer(tiny_cfg(), TrainConfig(lr=1e-2, mini_batches=2)) as t:
        rows = [{"step": i, **t.step(batch)} for i in range(2)]
    m = rows[-1]
    assert 0 < m["ratio_min"] <= m["ratio"] <= m["ratio_max"]
    assert m["ratio_min"] < 1.0 < m["ratio_max"]          # the second mini-batch moved away from its old log-probs
    assert 0 < m["tis_weight_min"] <= m["tis_weight"] <= m["tis_weight_max"] <= 2.0   # capped at tis_cap
    assert m["skipped_updates"] == 0.0 and "routing_replay/coverage" not in m    # replay off: nothing to report
    assert m["router/load_imbalance"] >= 1.0
    for k in ("advantage/mean", "advantage/std", "groups_all_equal", "malformed_rate", "response_length"):
        assert k in m
    out = plot_health(rows, tmp_path / "rl_health.png")
    assert out is not None and out.stat().st_size > 1000


def test_merge_reduces_extremes_by_min_and_max():
    acc = merge({}, {"ratio_min": 0.9, "ratio_max": 1.1, "tokens": 3.0})
    merge(acc, {"ratio_min": 0.5, "ratio_max": 1.05, "tokens": 2.0})
    assert acc == {"ratio_min": 0.5, "ratio_max": 1.1, "tokens": 5.0}


def test_the_bias_update_moves_each_expert_toward_the_mean_load():
    from policy.model import K3Model

    torch.manual_seed(0)
    model = K3Model(tiny_cfg())
    moes = model.moe_layers()
    load = torch.zeros(len(moes), 8, dtype=torch.long)
    load[:, 0] = 30                          # expert 0 overloaded, expert 7 idle, the rest at the mean
    load[:, 1:7] = 5
    load[:, 7] = 0
    mean = float(load[0].double().mean())
    assert 5 < mean < 30 and load[0, 1] < mean
    m = update_router_bias(model, load, 0.01)
    bias = moes[0].router.e_score_correction_bias
    assert bias[0].item() == pytest.approx(-0.01) and bias[7].item() == pytest.approx(0.01)
    assert bias[1].item() == pytest.approx(0.01)                # below the mean: more attractive
    assert m["router/load_imbalance"] == pytest.approx(30 / mean)
    before = bias.clone()
    update_router_bias(model, load, 0.0)                        # rate 0: the bias stays
    assert torch.equal(before, bias)


def test_training_steps_balance_the_load_and_the_bias_goes_with_the_weights(tmp_path):
    """lr 0, so only the bias changes: repeated steps on one batch bring the routing's max / mean load down."""
    cfg = tiny_cfg()
    batch = rl_batch(_trajs(2))
    with Trainer(cfg, TrainConfig(lr=0.0, router_bias_rate=0.01)) as t:
        first = t.step(batch)["router/load_imbalance"]
        for _ in range(11):
            last = t.step(batch)["router/load_imbalance"]
        state = t.state_dict()
        biases = {k: v for k, v in state.items() if k.endswith(BIAS)}
        assert biases and any(v.abs().sum() > 0 for v in biases.values())
        assert first > 1.2 and last < first - 0.1        # measured: 1.35 -> about 1.1
        path = t.save_weights(tmp_path / "w")      # what WeightSync pushes to the policy server
        t.checkpoint(tmp_path / "ck")
    pushed = read_checkpoint(path).state
    assert all(torch.equal(pushed[k], v) for k, v in biases.items())
    runner = Runner(cfg, None, weights=str(path))
    served = runner.model.state_dict()
    assert all(torch.equal(served[k], v) for k, v in biases.items())
    with Trainer(cfg, TrainConfig(lr=0.0, router_bias_rate=0.01)) as again:
        assert all(v.abs().sum() == 0 for k, v in again.state_dict().items() if k.endswith(BIAS))
        again.resume(tmp_path / "ck")
        resumed = again.state_dict()
    assert all(torch.equal(resumed[k], v) for k, v in biases.items())


def test_without_a_rate_the_bias_never_moves():
    with Trainer(tiny_cfg(), TrainConfig(lr=1e-2)) as t:
        t.step(Batch(rl_batch(_trajs(3)).samples))
        assert all(v.abs().sum() == 0 for k, v in t.state_dict().items() if k.endswith(BIAS))
