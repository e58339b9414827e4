"""Expert + data parallelism: a training run over two gloo processes (EP=2, and pure DP=2) equals the one-process
run, in float64 to 1e-9: losses, grad norms, the updated (full, gathered) weights, scoring, checkpoint and resume."""

import sys
from pathlib import Path

import pytest

from policy.hf_format import read_checkpoint
from trainer.train import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from trainer_helpers import ep_batches, ep_config, tiny_cfg  # noqa: E402

CFG = ep_config()


def _batches():
    return ep_batches(3, 3)


def _run(world, ep, tmp):
    batches = _batches()
    with Trainer(tiny_cfg(), CFG, world=world, ep_size=ep) as t:
        metrics = [t.step(b) for b in batches]
        t.checkpoint(tmp, data_state={"next": 2})
        metrics.append(t.step(batches[0]))
        weights = t.save_weights(tmp / "w")
        state = t.state_dict()
        assert _diff(read_checkpoint(weights).state, state) == 0     # the full model, expert shards gathered
        scored = t.score(batches[1].samples)
    with Trainer(tiny_cfg(), CFG, world=world, ep_size=ep) as t:
        assert t.resume(tmp)["data"] == {"next": 2}   # type: ignore[index]
        t.step(batches[0])
        resumed = t.state_dict()
    return metrics, state, resumed, scored


def _diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _run(1, 1, tmp_path_factory.mktemp("ep1"))


@pytest.mark.parametrize("ep", [2, 1], ids=["ep2", "dp2"])
def test_two_ranks_equal_one(single, ep, tmp_path):
    metrics, state, resumed, scored = _run(2, ep, tmp_path)
    ref_metrics, ref_state, _, ref_scored = single
    for m, r in zip(metrics, ref_metrics, strict=True):
        for k in ("loss", "grad_norm", "pg_loss", "kl", "entropy", "clip_frac", "tis_weight", "loss_tokens"):
            assert m[k] == pytest.approx(r[k], rel=1e-9, abs=1e-12), k
    assert _diff(state, ref_state) < 1e-9
    assert _diff(resumed, state) < 1e-12          # resume under EP lands exactly where the run went
    assert state.keys() == ref_state.keys() and all(state[k].shape == ref_state[k].shape for k in state)
    for a, b in zip(scored, ref_scored, strict=True):    # scoring splits over the ranks and comes back in order
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-9)
        assert a.routing is not None and b.routing is not None and a.routing.equal(b.routing)
