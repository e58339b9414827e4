"""Expert parallelism: EP=1 and EP=2 (two gloo processes on 127.0.0.1) give the same logits, gradients,
training step and per-expert load; and decoding token by token under EP=2 equals a full forward at every step and
mlx-lm's kimi_k3 decoding the same weights."""

import json
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from policy.config import k3_mini
from policy.ep import EPGroup, init_ep, shard_state_dict
from policy.model import K3Model

WORLD, BATCH, SEQ = 2, 4, 12


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    ep = init_ep(rank, WORLD, port, backend="gloo")
    try:
        cfg = k3_mini(vocab_size=200)
        torch.manual_seed(0)
        ref = K3Model(cfg).double()
        ids = torch.randint(0, 200, (BATCH, SEQ))
        R = torch.randn(BATCH, SEQ, 200, dtype=torch.float64)
        full, _ = ref(ids)
        (full * R).sum().backward()
        ref_load = torch.cat([m.tokens_per_expert for m in ref.moe_layers()])

        model = K3Model(cfg, ep).double()
        model.load_state_dict(shard_state_dict(ref.state_dict(), ep))
        rows = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
        logits, _ = model(ids[rows])
        assert (logits - full[rows]).abs().max() < 1e-5
        (logits * R[rows]).sum().backward()

        # per-expert load: each rank reports its experts' token counts from all ranks
        load = torch.cat([m.tokens_per_expert for m in model.moe_layers()])
        gathered = [torch.zeros_like(load) for _ in range(WORLD)]
        dist.all_gather(gathered, load)
        per_layer = [torch.cat([g.view(len(model.moe_layers()), -1)[i] for g in gathered]) for i in range(len(model.moe_layers()))]
        assert torch.equal(torch.cat(per_layer), ref_load)

        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            assert p.grad is not None, name
            g = p.grad
            if ".experts." in name:   # each expert lives on one rank: its gradient is already complete
                r = ep.expert_range(cfg.num_experts)
                expected = ref_params[name].grad[r.start:r.stop]
            else:                     # replicated parameters: sum the data-parallel contributions
                dist.all_reduce(g)
                expected = ref_params[name].grad
            assert (g - expected).abs().max() < 1e-5, name

        # one SGD step through EP lands on the same weights as on one rank
        for opt_model in (model, ref):
            with torch.no_grad():
                for p in opt_model.parameters():
                    p -= 0.1 * p.grad
        after_ref, _ = ref(ids)
        after, _ = model(ids[rows])
        assert (after - after_ref[rows]).abs().max() < 1e-5
        assert (after - logits).abs().max() > 1e-6
    finally:
        dist.destroy_process_group()


def test_ep1_equals_ep2_logits_gradients_and_step():
    mp.spawn(_worker, args=(_free_port(),), nprocs=WORLD, join=True)


def decode(model: K3Model, ids: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Row 0 of ``ids``: the logits of a full forward, and of our decoding one token at a time (the model's caches)."""
    with torch.no_grad():
        full = model(ids)[0][0].numpy()
        cache, steps = None, []
        for t in range(ids.shape[1]):
            logits, cache = model(ids[:, t:t + 1], cache)
            steps.append(logits[0, 0].numpy())
    return full, np.stack(steps)


def _decode_worker(rank: int, port: int, cfg, state, ids, full, mlx_steps, out: str) -> None:
    """Rank ``rank`` decodes row ``rank`` one token at a time (its experts only; the other rank's through the
    all-to-all), and writes how far each step is from the full forward and from mlx-lm's decoding."""
    torch.set_num_threads(1)
    ep = init_ep(rank, WORLD, port, backend="gloo")
    try:
        model = K3Model(cfg, ep).eval()
        model.load_state_dict(shard_state_dict(state, ep))
        ep_full, decoded = decode(model, ids[rank:rank + 1])
        diffs = {"ep2 full vs ep1 full": float(np.abs(ep_full - full[rank]).max()),
                 "ep2 decode vs full": float(np.abs(decoded - full[rank]).max()),
                 "ep2 decode vs mlx-lm decode": float(np.abs(decoded - mlx_steps[rank]).max())}
        Path(out, f"{rank}.json").write_text(json.dumps(diffs))
    finally:
        dist.destroy_process_group()


def test_ep2_decoding_agrees_with_a_full_forward_and_with_mlx_lm(tmp_path):
    import mlx.core as mx
    from mlx_lm.utils import load_model

    from policy.hf_format import write_checkpoint
    from tests.unit.policy.test_policy_hf_format import K3_PARTS_ON, MLX_TOL, SMALL, random_model, tokens
    cfg = k3_mini(**SMALL, **K3_PARTS_ON)
    model = random_model(cfg)
    ids = tokens()
    with torch.no_grad():
        full = model(ids)[0].numpy()
    reference, _ = load_model(write_checkpoint(model.state_dict(), cfg, tmp_path / "k3"))
    mlx_cache = reference.make_cache()
    mlx_steps = np.stack([np.array(reference(mx.array(ids[:, t:t + 1].numpy()), cache=mlx_cache))[:, 0]
                          for t in range(ids.shape[1])], axis=1)
    mp.spawn(_decode_worker, args=(_free_port(), cfg, model.state_dict(), ids, full, mlx_steps, str(tmp_path)),
             nprocs=WORLD, join=True)
    diffs = {k: max(json.loads((tmp_path / f"{r}.json").read_text())[k] for r in range(WORLD))
             for k in json.loads((tmp_path / "0.json").read_text())}
    print("K3 all parts on (KDA, MLA, AttnRes, LatentMoE+norm, SiTU), EP=2: max abs logit diff " +
          ", ".join(f"{k} {v:.3g}" for k, v in diffs.items()))
    assert all(v < MLX_TOL for v in diffs.values()), diffs


def test_expert_range_shards_evenly():
    assert list(EPGroup(1, 4).expert_range(8)) == [2, 3]
    with pytest.raises(ValueError):
        EPGroup(0, 3).expert_range(8)
