"""The trainer's ranks as Ray actors in a placement group over the two simulated Ray nodes: EP=2 x DP=2 (four gloo
ranks joining at rank 0's node address) trains, in float64, to the same losses, grad norms and weights as one rank."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import ray

from trainer.batch import rl_batch
from trainer.losses import LossConfig
from trainer.train import TrainConfig, Trainer

sys.path.insert(0, str(Path(__file__).parents[2] / "unit" / "trainer"))
from trainer_helpers import make_traj, tiny_cfg  # noqa: E402

pytestmark = pytest.mark.integration
CFG = TrainConfig(lr=1e-3, micro_batch_tokens=40, dtype="float64", mini_batches=2, routing_replay=True,
                  loss=LossConfig(kl_coef=0.1, tis_cap=2.0))


def _batches():
    rng = random.Random(0)
    return [rl_batch([make_traj(rng, f"g{b}-{g}", i, float(rng.random() < 0.5), gen=rng.randint(2, 7),
                                turns=rng.randint(1, 3), routing=(3, 2)) for g in range(4) for i in range(3)])
            for b in range(2)]


def _train(**kw):
    with Trainer(tiny_cfg(), CFG, **kw) as t:
        nodes = list(t.ray_ranks.nodes) if t.ray_ranks is not None else []
        metrics = [t.step(b) for b in _batches()]
        return metrics, t.state_dict(), nodes


def test_ep2_dp2_ranks_on_two_ray_nodes_equal_one_rank(ray_cluster):
    ref_metrics, ref_state, _ = _train(world=1)
    metrics, state, nodes = _train(world=4, ep_size=2, ranks="ray")
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(nodes) == 3 and set(nodes) == alive  # the three actor ranks span both nodes (SPREAD)
    for m, r in zip(metrics, ref_metrics, strict=True):
        for k in ("loss", "grad_norm", "pg_loss", "kl", "entropy", "loss_tokens"):
            assert m[k] == pytest.approx(r[k], rel=1e-9, abs=1e-12), k
    assert state.keys() == ref_state.keys()
    assert max((state[k] - ref_state[k]).abs().max().item() for k in state) < 1e-9
    assert ray.util.placement_group_table() == {} or all(
        p["state"] == "REMOVED" for p in ray.util.placement_group_table().values())

