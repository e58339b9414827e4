"""GRPO advantages: every episode's reward compared with the other episodes of its group.

For a group of G episodes started from one state, with rewards r_1..r_G:

    GRPO (group-normalised):    A_i = (r_i - mean(r)) / (std(r) + eps)
    Dr. GRPO (no std division): A_i =  r_i - mean(r)
    leave-one-out baseline:     A_i =  r_i - mean(r_j, j != i)  =  G / (G - 1) * (r_i - mean(r))

``std`` is the sample standard deviation (Bessel's correction, ``torch.std``'s default, as verl and TRL use),
``eps`` keeps a group of equal rewards at A = 0. The leave-one-out baseline may be combined with the std division
(``std_normalize``) too. A group with one usable episode has no baseline: its advantage is 0.

An episode that ended in an infrastructure failure (``reward is None``: ``env_error`` / ``policy_error``) is not a
task failure: it is left out of its group's statistics and out of the loss, and counted. ``drop_all_equal`` drops
groups whose usable rewards are all equal (all solved or all failed: no learning signal, as DAPO's dynamic
sampling does), so that they do not dilute the token mean of the loss; they are counted too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol


@dataclass(frozen=True)
class AdvantageConfig:
    """How to turn a group's rewards into advantages (the defaults are GRPO's)."""

    baseline: Literal["mean", "loo"] = "mean"   # group mean, or the mean of the other episodes (RLOO)
    std_normalize: bool = True                  # divide by the group's std (GRPO); False is Dr. GRPO
    eps: float = 1e-6
    drop_all_equal: bool = False                # drop groups whose usable rewards are all equal

    def __post_init__(self) -> None:
        if self.baseline not in ("mean", "loo"):
            raise ValueError(f"baseline must be 'mean' or 'loo', not {self.baseline!r}")


def group_advantages(rewards: Sequence[float | None], cfg: AdvantageConfig | None = None) -> list[float | None]:
    """Advantages of one group, None where the reward is None (an infrastructure failure)."""
    cfg = cfg or AdvantageConfig()
    valid = [float(r) for r in rewards if r is not None]
    n = len(valid)
    if n < 2:
        return [None if r is None else 0.0 for r in rewards]
    mean = math.fsum(valid) / n
    std = math.sqrt(math.fsum((r - mean) ** 2 for r in valid) / (n - 1))
    out: list[float | None] = []
    for r in rewards:
        if r is None:
            out.append(None)
            continue
        a = r - mean if cfg.baseline == "mean" else r - (math.fsum(valid) - r) / (n - 1)
        out.append(a / (std + cfg.eps) if cfg.std_normalize else a)
    return out


class Scored(Protocol):
    """What advantages need of an episode (``rollout.trajectory.Trajectory`` has it)."""

    group_id: str
    reward: float | None
    episode_id: str


@dataclass
class Advantages:
    """Per-episode advantages of the episodes that stay in the loss, and what was left out."""

    values: dict[str, float] = field(default_factory=dict)   # episode_id -> advantage (kept episodes only)
    kept: list[Any] = field(default_factory=list)            # the kept episodes, in input order
    stats: dict[str, float] = field(default_factory=dict)


def _reward(ep: Scored) -> float | None:
    """The reward, None for an infrastructure failure (also when a record says so only by its finish reason)."""
    return None if getattr(ep, "infra_error", False) else ep.reward


def grpo_advantages(episodes: Sequence[Scored], cfg: AdvantageConfig | None = None) -> Advantages:
    """Group ``episodes`` by ``group_id`` (an empty id is a group of its own), compute each group's advantages, and
    keep the episodes that go into the loss (not infrastructure failures, not dropped groups)."""
    cfg = cfg or AdvantageConfig()
    groups: dict[str, list[int]] = {}
    for i, ep in enumerate(episodes):
        groups.setdefault(ep.group_id or f"\0{i}", []).append(i)
    adv: list[float | None] = [None] * len(episodes)
    dropped_groups = dropped_episodes = singleton_groups = all_equal = 0
    for members in groups.values():
        rewards = [_reward(episodes[i]) for i in members]
        valid = [r for r in rewards if r is not None]
        equal = len(valid) > 1 and all(r == valid[0] for r in valid)
        all_equal += equal
        if cfg.drop_all_equal and valid and all(r == valid[0] for r in valid):
            dropped_groups += 1
            dropped_episodes += len(valid)
            continue
        singleton_groups += len(valid) == 1
        for i, a in zip(members, group_advantages(rewards, cfg), strict=True):
            adv[i] = a
    out = Advantages()
    for i, ep in enumerate(episodes):
        a = adv[i]
        if a is not None:
            out.values[ep.episode_id] = a
            out.kept.append(ep)
    rewards_all = [r for r in (_reward(ep) for ep in episodes) if r is not None]
    kept_adv = list(out.values.values())
    out.stats = {
        "episodes": float(len(episodes)),
        "episodes_kept": float(len(out.kept)),
        "infra_errors": float(sum(1 for ep in episodes if _reward(ep) is None)),
        "groups": float(len(groups)),
        "groups_dropped": float(dropped_groups),
        "groups_all_equal": float(all_equal),      # two or more usable rewards, all equal: advantage 0 (no signal)
        "episodes_dropped": float(dropped_episodes),
        "groups_singleton": float(singleton_groups),
        "reward_mean": math.fsum(rewards_all) / len(rewards_all) if rewards_all else float("nan"),
        "advantage_abs_mean": math.fsum(abs(a) for a in kept_adv) / len(kept_adv) if kept_adv else 0.0,
    }
    return out
