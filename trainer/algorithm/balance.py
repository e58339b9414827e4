"""Auxiliary-loss-free load balancing of the MoE routers (DeepSeek-V3, section 2.1.2).

Each router carries a bias (``policy.moe.Router.e_score_correction_bias``) that is added to the expert scores for
the top-k choice only; the gate weights come from the unbiased scores, so the bias changes which experts a token
goes to, never how much of each it gets, and no gradient touches it. After every training step each MoE layer's
bias moves by a fixed amount toward balance:

    load_i  = tokens the step's training forwards routed to expert i (every rank's, padding left out)
    bias_i += gamma * sign(mean(load) - load_i)        an overloaded expert becomes less attractive, an idle one more

``gamma`` is ``rl.router_bias_rate`` (``TrainConfig.router_bias_rate``; 0 turns it off). With routing replay on,
the loads are those of the replayed routing (the engine's choice), which is what the served model will do with
the updated bias. The bias is a buffer of the model, so it is in ``state_dict``: it goes to the policy server with
every weight push and into every checkpoint, like the weights.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from policy.model import K3Model


def expert_load(model: K3Model, valid: torch.Tensor) -> torch.Tensor:
    """(MoE layers, experts) token counts of the last forward of ``model`` over the positions where ``valid``
    (B, S) is set (the routing of padding is left out)."""
    moes = model.moe_layers()
    if not moes:
        return torch.zeros(0, 0, dtype=torch.long)
    keep = valid.reshape(-1).bool().to(moes[0].last_routing.device)
    n = moes[0].router.e_score_correction_bias.numel()
    return torch.stack([torch.bincount(m.last_routing[keep].reshape(-1), minlength=n).cpu() for m in moes])


def reduce_load(load: torch.Tensor | None, shape: tuple[int, int], distributed: bool) -> torch.Tensor:
    """Sum ``load`` (None: this rank had no data, zeros of ``shape``) over every rank (each counted its own
    tokens' routing)."""
    if load is None:
        load = torch.zeros(shape, dtype=torch.long)
    if distributed:
        t = load.to(torch.float64)
        dist.all_reduce(t)
        return t.round().to(torch.long)
    return load


@torch.no_grad()
def update_router_bias(model: K3Model, load: torch.Tensor, rate: float) -> dict[str, float]:
    """``bias_i += rate * sign(mean(load) - load_i)`` in every MoE layer (``load``: (layers, experts), the same on
    every rank); returns the load imbalance (max / mean, averaged over layers) the update reacted to."""
    moes = model.moe_layers()
    if not moes or load.numel() == 0 or int(load.sum()) == 0:
        return {}
    imbalance = []
    for m, row in zip(moes, load.to(torch.float64), strict=True):
        mean = row.mean()
        bias = m.router.e_score_correction_bias
        if rate > 0:
            bias.add_((rate * torch.sign(mean - row)).to(bias))
        imbalance.append(float(row.max() / mean) if mean > 0 else 0.0)
    return {"router/load_imbalance": sum(imbalance) / len(imbalance)}
