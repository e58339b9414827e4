"""The trainer's ranks as Ray actors over two Ray nodes (``Trainer(placement="ray")``): EP=2 x DP=2 on four ranks,
three of them actors spread over the nodes, gives the one-process run's losses, grad norms and weights (float64)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from trainer.train import Trainer, TrainerError

sys.path.insert(0, str(Path(__file__).parents[2] / "unit" / "trainer"))
from trainer_helpers import ep_batches, ep_config, tiny_cfg  # noqa: E402

pytestmark = pytest.mark.integration
CFG = ep_config()


def _batches():
    return ep_batches(4, 2)


def _run(world: int, ep: int, placement: str):
    with Trainer(tiny_cfg(), CFG, world=world, ep_size=ep, placement=placement) as t:
        nodes = t.ray_ranks.nodes if t.ray_ranks is not None else []
        metrics = [t.step(b) for b in _batches()]
        return metrics, t.state_dict(), nodes


def test_ep2_dp2_over_two_ray_nodes_equals_one_process(ray_cluster):
    import ray

    metrics, state, nodes = _run(4, 2, "ray")
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU")}
    assert len(nodes) == 3 and set(nodes) == alive  # the actors span both nodes
    ref_metrics, ref_state, _ = _run(1, 1, "local")
    for m, r in zip(metrics, ref_metrics, strict=True):
        for k in ("loss", "grad_norm", "pg_loss", "kl", "loss_tokens"):
            assert m[k] == pytest.approx(r[k], rel=1e-9, abs=1e-12), k
    assert state.keys() == ref_state.keys()
    assert max((state[k] - ref_state[k]).abs().max().item() for k in state) < 1e-9
    assert not ray.util.placement_group_table() or all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())


def test_ray_placement_without_ray_is_a_clear_error(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(TrainerError, match="ray.init"):
        Trainer(tiny_cfg(), CFG, world=2, ep_size=1, placement="ray")
    with pytest.raises(ValueError, match="placement"):
        Trainer(tiny_cfg(), CFG, world=2, ep_size=1, placement="slurm")
