"""The Trainer in one process on a tiny K3: SFT learns, micro-batching does not change a step, mini-batches and the KL
reference work, routing replay uses the recorded experts (and the router still learns), weights load into the policy
runner, and checkpoint / resume continues exactly."""

import random
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from mlx_lm.utils import load_model

from policy.hf_format import read_checkpoint
from policy.model import K3Model
from policy.runner import Runner
from trainer import checkpoint as ckpt
from trainer.algorithm.batch import Batch, Sample, rl_batch
from trainer.algorithm.losses import LossConfig
from trainer.sft import DataCursor, run_sft, sft_samples
from trainer.train import TrainConfig, Trainer

sys.path.insert(0, str(Path(__file__).parent))
from trainer_helpers import make_traj, tiny_cfg  # noqa: E402


def _trajs(seed=0, groups=3, size=4, routing=None):
    rng = random.Random(seed)
    return [make_traj(rng, f"g{g}", i, float(rng.random() < 0.5), gen=rng.randint(2, 6), routing=routing)
            for g in range(groups) for i in range(size)]


def _state_diff(a, b):
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def test_sft_learns_the_demonstrations():
    samples = sft_samples(_trajs(1, groups=2, size=2))
    with Trainer(tiny_cfg(), TrainConfig(lr=3e-3)) as t:
        losses = [t.step(Batch(samples, "sft"))["nll"] for _ in range(15)]
    assert losses[-1] < losses[0] - 0.5
    assert t.step_count == 15


def test_the_same_seed_trains_the_same_weights_with_deterministic_kernels():
    """Two threads add the backward of indexing in any order unless torch's deterministic kernels are on."""
    samples = sft_samples(_trajs(1, groups=2, size=2))
    states, threads = [], torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for _ in range(2):
            with Trainer(tiny_cfg(), TrainConfig(lr=3e-3)) as t:
                assert torch.are_deterministic_algorithms_enabled()
                for _ in range(3):
                    t.step(Batch(samples, "sft"))
                states.append(t.state_dict())
    finally:
        torch.set_num_threads(threads)
    assert _state_diff(*states) == 0.0


def test_micro_batch_budget_does_not_change_the_step():
    batch = rl_batch(_trajs(2))
    states, metrics = [], []
    for budget in (16, 48, 10_000):
        with Trainer(tiny_cfg(), TrainConfig(lr=1e-2, micro_batch_tokens=budget, dtype="float64")) as t:
            metrics.append([t.step(batch) for _ in range(2)])
            states.append(t.state_dict())
    for s, m in zip(states[1:], metrics[1:], strict=True):
        assert _state_diff(states[0], s) < 1e-10
        assert m[-1]["loss"] == pytest.approx(metrics[0][-1]["loss"], abs=1e-12)
        assert m[-1]["grad_norm"] == pytest.approx(metrics[0][-1]["grad_norm"], rel=1e-9)


def test_mini_batches_and_the_kl_reference():
    batch = rl_batch(_trajs(3))
    cfg = TrainConfig(lr=2e-2, mini_batches=3, loss=LossConfig(kl_coef=0.05, eps_low=0.01, eps_high=0.01))
    with Trainer(tiny_cfg(), cfg) as t:
        first = t.step(batch)
        second = t.step(batch)
    # the first mini-batch sees ratio 1 and KL 0; later ones see the updates before them (ratios move, clipping)
    assert first["kl"] > 0 and first["ratio"] != pytest.approx(1.0, abs=1e-6)
    assert second["clip_frac"] > 0 and second["kl"] > first["kl"]


def test_routing_replay_hook_uses_the_given_experts_and_trains_the_router():
    torch.manual_seed(0)
    model = K3Model(tiny_cfg())
    ids = torch.randint(0, 64, (2, 5))
    model(ids)
    own = model.last_routing(2, 5)
    forced = torch.randint(0, 8, own.shape)
    forced = torch.stack([torch.randperm(8)[:2] for _ in range(own[..., 0].numel())]).view(own.shape)
    forced[0, 0] = -1                                     # no record for this position: the router chooses
    for i, m in enumerate(model.moe_layers()):
        m.replay = forced[:, :, i].reshape(-1, 2)
    logits, _ = model(ids)
    got = model.last_routing(2, 5)
    assert torch.equal(got[0, 1:], forced[0, 1:]) and torch.equal(got[1], forced[1])
    assert torch.equal(got[0, 0], own[0, 0])
    logits.sum().backward()
    router = model.moe_layers()[0].router.weight
    assert router.grad is not None and router.grad[forced[:, :, 0].flatten()].abs().sum() > 0
    for m in model.moe_layers():
        m.replay = None
    with pytest.raises(ValueError, match="replayed routing"):
        model.moe_layers()[0].replay = torch.zeros(3, 2, dtype=torch.long)
        model(ids)


def test_routing_replay_in_the_trainer():
    samples = rl_batch(_trajs(4)).samples
    with Trainer(tiny_cfg(), TrainConfig()) as plain:
        own = plain.score(samples)
    # record the trainer's own routing as if the server had: replaying it changes nothing
    recorded = []
    for s, sc in zip(samples, own, strict=True):
        assert sc.routing is not None
        recorded.append(Sample(s.token_ids, s.loss_mask, s.logprobs, s.advantage, sc.routing.tolist()))
    with Trainer(tiny_cfg(), TrainConfig(routing_replay=True)) as replay:
        same = replay.score(recorded)
        for a, b in zip(own, same, strict=True):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6)
        # other recorded experts: the training forward routes every position (prompt and tool output too) as recorded
        rng = random.Random(0)
        forced = [Sample(s.token_ids, s.loss_mask, s.logprobs, s.advantage,
                         [[rng.sample(range(8), 2) for _ in range(3)] for _ in range(len(s) - 1)]) for s in samples]
        out = replay.score(forced)
        for s, sc in zip(forced, out, strict=True):
            assert sc.routing is not None
            assert sc.routing.tolist() == s.routing
        assert any(abs(a - b) > 1e-4 for x, y in zip(own, out, strict=True) for a, b in zip(x.logprobs, y.logprobs,
                                                                                          strict=True))
        m = replay.step(Batch(forced))
        assert m["loss_tokens"] > 0 and m["routing_replay/coverage"] == 1.0
        assert m["routing_replay/coverage_loss"] == 1.0


def test_saved_weights_load_into_the_policy_runner(tmp_path):
    cfg = tiny_cfg()
    with Trainer(cfg, TrainConfig(lr=1e-2)) as t:
        t.step(rl_batch(_trajs(5)))
        path = t.save_weights(tmp_path / "w" / "step")
        assert [p.name for p in path.parent.iterdir()] == ["step"]   # no temporary left behind
        runner = Runner(cfg, None, weights=str(path))
        ids = torch.randint(0, 64, (1, 9))
        with torch.no_grad():
            a = runner.model(ids)[0]
            b = t.model.eval()(ids)[0]
        assert torch.allclose(a, b, atol=1e-6)
        assert _state_diff(read_checkpoint(path).state, t.state_dict()) == 0
        reference, _ = load_model(path)   # what a push holds is a checkpoint mlx-lm's kimi_k3 loads and agrees with
        with torch.no_grad():
            theirs = torch.from_numpy(np.array(reference(mx.array(ids.numpy()))))
        assert (theirs - b).abs().max().item() < 1e-3
    # the same seed starts from the policy server's initial weights
    with Trainer(cfg, TrainConfig(seed=3)) as t:
        assert _state_diff(t.state_dict(), Runner(cfg, None, seed=3).model.state_dict()) == 0


def test_checkpoint_and_resume_continue_exactly(tmp_path):
    batches = [rl_batch(_trajs(10 + i)) for i in range(4)]
    cfg = TrainConfig(lr=1e-2, loss=LossConfig(kl_coef=0.01))
    with Trainer(tiny_cfg(), cfg) as t:
        for i in range(2):
            t.step(batches[i])
        t.checkpoint(tmp_path, data_state={"next": 2})
        for i in range(2, 4):
            t.step(batches[i])
        t.checkpoint(tmp_path, data_state={"next": 4}, keep=1)   # keep 1: step 2's folder goes
        expected = t.state_dict()
    assert [p.name for p in ckpt.complete(tmp_path)] == ["step-00000004"]
    (tmp_path / ".tmp-step-00000005-1").mkdir()                   # what a crash mid-write leaves
    with Trainer(tiny_cfg(), cfg) as t:
        t.step(batches[0])
        t.checkpoint(tmp_path, data_state={"next": 1}, keep=0)
    assert not (tmp_path / ".tmp-step-00000005-1").exists()
    assert (tmp_path / "latest").read_text() == "step-00000004"  # step 1 < step 4: still the newest

    with Trainer(tiny_cfg(), cfg) as t:
        meta = t.resume(tmp_path)
        assert meta is not None and meta["step"] == 4 and meta["data"] == {"next": 4} and t.step_count == 4
        assert _state_diff(t.state_dict(), expected) == 0
    # resuming mid-run and stepping lands where the uninterrupted run did
    with Trainer(tiny_cfg(), cfg) as t:
        for i in range(3):
            t.step(batches[i])
        t.checkpoint(tmp_path / "b", data_state={"next": 3})
        t.step(batches[3])
        straight = t.state_dict()
    with Trainer(tiny_cfg(), cfg) as t:
        assert t.resume(tmp_path / "b")["data"] == {"next": 3}   # type: ignore[index]
        t.step(batches[3])
        assert _state_diff(t.state_dict(), straight) < 1e-7
    with Trainer(tiny_cfg(), cfg) as t:
        assert t.resume(tmp_path / "none") is None
    with Trainer(tiny_cfg(hidden_size=48), cfg) as t, pytest.raises(ValueError, match="model configuration"):
        t.resume(tmp_path)


def test_data_cursor_crosses_epochs_and_restores():
    c = DataCursor(5, seed=1)
    first = c.take(3) + c.take(3) + c.take(4)
    assert sorted(first[:5]) == list(range(5)) and sorted(first[5:]) == list(range(5))
    d = DataCursor(5, seed=1)
    d.take(3)
    e = DataCursor(5, seed=1)
    e.load(d.state())
    assert e.take(7) == first[3:10]
    with pytest.raises(ValueError):
        DataCursor(6).load(d.state())


def test_run_sft_writes_metrics_plots_and_checkpoints(tmp_path):
    samples = sft_samples(_trajs(6))
    with Trainer(tiny_cfg(), TrainConfig(lr=1e-3)) as t:
        rows = run_sft(t, samples, steps=3, batch_size=4, out=tmp_path, progress=False, plot_every=3)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["data/index"] for r in rows] == [0, 4, 8]
    assert (tmp_path / "metrics.png").stat().st_size > 1000
    assert ckpt.read_meta(ckpt.latest(tmp_path / "checkpoints"))["data"]["index"] == 0   # type: ignore[arg-type]
    with Trainer(tiny_cfg(), TrainConfig(lr=1e-3)) as t:   # a second call resumes and has nothing left to do
        assert run_sft(t, samples, steps=3, batch_size=4, out=tmp_path, progress=False) == []
        rows = run_sft(t, samples, steps=4, batch_size=4, out=tmp_path, progress=False)
    assert [r["step"] for r in rows] == [4] and rows[0]["data/index"] == 0 and rows[0]["data/epoch"] == 1


def test_grad_norm_is_reported_before_clipping_and_the_update_is_clipped():
    batch = rl_batch(_trajs(7))
    with Trainer(tiny_cfg(), TrainConfig(lr=1e-3, grad_clip=1e-3, dtype="float64")) as t:
        m = t.step(batch)
        clipped = torch.sqrt(sum(p.grad.pow(2).sum() for p in t.model.parameters() if p.grad is not None))
    assert m["grad_norm"] > 1e-3 and clipped.item() == pytest.approx(1e-3, rel=1e-3)
    with Trainer(tiny_cfg(), TrainConfig(lr=1e-3, grad_clip=0.0, dtype="float64")) as t:
        raw = t.step(batch)["grad_norm"]
        full = torch.sqrt(sum(p.grad.pow(2).sum() for p in t.model.parameters() if p.grad is not None))
    assert raw == pytest.approx(m["grad_norm"], rel=1e-9) and full.item() == pytest.approx(raw, rel=1e-9)


def test_a_non_finite_gradient_norm_skips_the_update_and_says_so(monkeypatch):
    """min(1, grad_clip / nan) is 1: without the check, one bad batch writes NaN weights (and the loop pushes them)."""
    import trainer.distributed.rank as rank_mod

    batch = rl_batch(_trajs(4))
    with Trainer(tiny_cfg(), TrainConfig(lr=1e-2)) as t:
        before = {k: v.clone() for k, v in t.state_dict().items()}
        monkeypatch.setattr(rank_mod, "grad_norm", lambda model, layout: torch.tensor(float("nan")))
        m = t.step(batch)
        after = {k: v.clone() for k, v in t.state_dict().items()}
        assert m["skipped_updates"] == 1.0
        assert all(torch.isfinite(v).all() for v in after.values())
        assert _state_diff(before, after) == 0.0
        monkeypatch.undo()
        m = t.step(batch)
        assert m["skipped_updates"] == 0.0 and _state_diff(before, t.state_dict()) > 0.0
