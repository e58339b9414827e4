"""RL health figures: what an RL engineer reads first when a run goes wrong, in every step's metrics.

From the trainer step (``Trainer.step``, reduced over micro-batches and ranks by ``merge``):

    ratio_min / ratio_max                 PPO ratio pi_theta / pi_old over the loss tokens (1 with one mini-batch)
    tis_weight_min / tis_weight_max       truncated IS weight pi_old / pi_rollout (before the cap when TIS is off)
    skipped_updates                       optimizer updates skipped for a non-finite gradient norm
    routing_replay/coverage               fraction of the positions that shape a loss token (each episode's up
                                          to its last generated token) that replayed a routing the engine
                                          recorded (with ``routing_replay``; otherwise absent). Below 1 only for
                                          episodes recorded without routing: the trainer logs a warning
    routing_replay/coverage_loss          the same over the positions that produce loss tokens
    router/load_imbalance                 max expert load / mean expert load of the step's training forward

From the batch (``batch_health``, before the step):

    advantage/mean, /std, /min, /max      over the episodes that go into the loss
    groups_all_equal                      groups whose usable rewards were all equal (no signal); dropped from the
                                          loss when ``rl.drop_all_equal`` (``groups_dropped`` counts those)
    response_length                       generated tokens per episode (``trainer.algorithm.batch.episode_stats``)
    malformed_rate                        fraction of policy turns whose tool call failed to parse
                                          (``Turn.malformed``, set from ``policy.chat.parse_assistant``)

``plot_health`` draws them into ``rl_health.png`` (the loop writes it next to ``metrics.png``).

Extremes cannot be summed: ``merge`` reduces keys ending in ``_min`` by min and ``_max`` by max, everything else
by sum; ``token_means`` then divides the summed per-token metrics by the token count.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rollout.trajectory import Trajectory

HEALTH_PANELS: list[tuple[str, list[str]]] = [
    ("PPO ratio (min / mean / max)", ["ratio_min", "ratio", "ratio_max"]),
    ("TIS weight (min / mean / max)", ["tis_weight_min", "tis_weight", "tis_weight_max"]),
    ("advantage", ["advantage/mean", "advantage/std", "advantage/min", "advantage/max"]),
    ("groups: all-equal / dropped", ["groups_all_equal", "groups_dropped"]),
    ("response length (tokens)", ["response_length"]),
    ("malformed tool-call rate", ["malformed_rate"]),
    ("skipped updates (non-finite)", ["skipped_updates"]),
    ("routing replay coverage", ["routing_replay/coverage", "routing_replay/coverage_loss"]),
    ("router load imbalance (max / mean)", ["router/load_imbalance"]),
]

# keys of the step's reduced sums that are not token sums (left out of the token means)
NOT_TOKEN_SUMS = frozenset({"tokens", "loss", "grad_norm_sum", "updates", "rank_train_s", "skipped_updates",
                            "replay_positions", "replay_covered", "replay_loss_positions", "replay_loss_covered"})


def merge(acc: dict[str, float], part: Mapping[str, float]) -> dict[str, float]:
    """Fold ``part`` into ``acc``: ``*_min`` by min, ``*_max`` by max, the rest by sum; returns ``acc``."""
    for k, v in part.items():
        if k.endswith("_min"):
            acc[k] = min(acc.get(k, math.inf), v)
        elif k.endswith("_max"):
            acc[k] = max(acc.get(k, -math.inf), v)
        else:
            acc[k] = acc.get(k, 0.0) + v
    return acc


def token_means(tot: Mapping[str, float]) -> dict[str, float]:
    """The step's metrics from its reduced sums: token means of the per-token sums, extremes as they are, and
    routing-replay coverage (when positions were replayed)."""
    tokens = max(tot.get("tokens", 0.0), 1.0)
    out: dict[str, float] = {}
    for k, v in tot.items():
        if k in NOT_TOKEN_SUMS:
            continue
        if k.endswith(("_min", "_max")):
            out[k] = v
        else:
            out["kl" if k == "kl_ref" else k] = v / tokens
    if tot.get("replay_positions"):
        out["routing_replay/coverage"] = tot.get("replay_covered", 0.0) / tot["replay_positions"]
        out["routing_replay/coverage_loss"] = (tot.get("replay_loss_covered", 0.0)
                                               / max(tot.get("replay_loss_positions", 0.0), 1.0))
    return out


def replay_coverage(mb: Any) -> dict[str, float]:
    """The positions of ``mb`` that shape a loss token (each sample's, up to its last loss position: the causal
    model's later positions, e.g. a final tool output the policy never saw, affect nothing), and how many of them
    replayed a recorded routing (every MoE layer); the same over the positions that produce loss tokens.
    ``mb``: a ``trainer.algorithm.batch.MicroBatch`` with its replay tensor."""
    assert mb.routing is not None
    loss = mb.mask.bool()
    shaping = (mb.mask.flip(-1).cumsum(-1).flip(-1) > 0) & mb.positions.bool()
    covered = (mb.routing >= 0).flatten(2).all(-1) & shaping
    return {"replay_positions": float(shaping.sum()), "replay_covered": float(covered.sum()),
            "replay_loss_positions": float(loss.sum()), "replay_loss_covered": float((covered & loss).sum())}


def batch_health(trajectories: Sequence[Trajectory], advantages: Iterable[float], groups_all_equal: int) -> dict[str, float]:
    """Advantage statistics, all-equal groups and the malformed-call rate of one iteration's episodes."""
    adv = [float(a) for a in advantages]
    n = len(adv)
    mean = math.fsum(adv) / n if n else 0.0
    turns = [t for traj in trajectories for t in traj.turns]
    return {
        "advantage/mean": mean,
        "advantage/std": math.sqrt(math.fsum((a - mean) ** 2 for a in adv) / n) if n else 0.0,
        "advantage/min": min(adv, default=0.0),
        "advantage/max": max(adv, default=0.0),
        "groups_all_equal": float(groups_all_equal),
        "malformed_rate": sum(1 for t in turns if t.malformed) / len(turns) if turns else 0.0,
    }


def plot_health(rows: Sequence[dict[str, Any]] | str | os.PathLike[str], out: str | os.PathLike[str],
                title: str = "RL health") -> Path | None:
    """``rl_health.png``: the panels above that the rows have data for (None when none)."""
    from trainer.metrics import plot

    return plot(rows, out, title, panels=HEALTH_PANELS, with_time=False)
