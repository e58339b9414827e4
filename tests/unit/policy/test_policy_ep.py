"""Expert parallelism: EP=1 and EP=2 (two gloo processes on 127.0.0.1) give the same logits, gradients,
training step and per-expert load."""

import socket

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


def test_expert_range_shards_evenly():
    assert list(EPGroup(1, 4).expert_range(8)) == [2, 3]
    with pytest.raises(ValueError):
        EPGroup(0, 3).expert_range(8)
