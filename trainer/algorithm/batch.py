"""From trajectories to training tensors: samples, batches, micro-batches by token budget, and the split over ranks.

A ``Sample`` is one episode as the trainer sees it: the whole conversation (``token_ids``), the ``loss_mask`` (1 on
tokens the policy generated), the serving engine's ``logprobs`` aligned to it, the episode's advantage, and the
experts the engine routed every position to (``routing``, see ``rollout.trajectory.Trajectory.routing``). A
``Batch`` is what one training step consumes.

Alignment (``collate``): position t of a micro-batch reads ``token_ids[t]`` and predicts ``token_ids[t + 1]``;
its loss mask, rollout log-prob and advantage are those of token t + 1, and its replayed routing is the routing
the engine recorded at position t (prompt, tool output or generated: every position's experts shape the hidden
states the later ones attend to, so every position is replayed, not only those that produce loss tokens).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from rollout.trajectory import Trajectory
from trainer.algorithm.advantages import AdvantageConfig, grpo_advantages
from trainer.algorithm.health import batch_health


@dataclass
class Sample:
    """One episode ready for training (see the module docstring)."""

    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]                       # rollout log-probs aligned with token_ids, 0.0 off the mask
    advantage: float = 0.0
    routing: list[Any] | None = None            # per position: [moe layer][k] global expert ids (None: unknown)
    weight_version: int = 0                     # the oldest weights that generated any of its tokens
    episode_id: str = ""
    reward: float | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def loss_tokens(self) -> int:
        """Tokens that carry loss: generated tokens after the first position (position 0 predicts nothing)."""
        return sum(self.loss_mask[1:])

    @classmethod
    def from_trajectory(cls, traj: Trajectory, advantage: float = 0.0) -> Sample:
        """A ``rollout.trajectory.Trajectory`` (or anything with its fields) as a training sample."""
        versions = [t.weight_version for t in getattr(traj, "turns", [])]
        return cls(list(traj.token_ids), list(traj.loss_mask), list(traj.logprobs), advantage,
                   getattr(traj, "routing", None), min(versions) if versions else 0, traj.episode_id, traj.reward)


@dataclass
class Batch:
    """The samples of one training step; ``kind`` picks the loss ("rl": PPO-clip with advantages, "sft": NLL)."""

    samples: list[Sample]
    kind: Literal["rl", "sft"] = "rl"
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def loss_tokens(self) -> int:
        return sum(s.loss_tokens for s in self.samples)

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.samples)


def episode_stats(trajectories: Sequence[Trajectory], current_version: int | None = None, pass_threshold: float = 1.0,
                  prefix: str = "train") -> dict[str, float]:
    """Reward, pass rate, response length and staleness of a set of episodes (infrastructure failures counted)."""
    rewards = [t.reward for t in trajectories if t.reward is not None]
    gen = [sum(t.loss_mask) for t in trajectories]
    out = {
        f"reward/{prefix}": math.fsum(rewards) / len(rewards) if rewards else float("nan"),
        f"pass_rate/{prefix}": sum(r >= pass_threshold for r in rewards) / len(rewards) if rewards else float("nan"),
        "response_length": math.fsum(gen) / len(gen) if gen else 0.0,
        "infra_errors": float(len(trajectories) - len(rewards)),
    }
    if current_version is not None:
        stale = [staleness(t, current_version) for t in trajectories]
        out["staleness/mean"] = math.fsum(stale) / len(stale) if stale else 0.0
        out["staleness/max"] = float(max(stale, default=0))
    return out


def pass_rate(trajectories: Sequence[Trajectory], threshold: float) -> tuple[float, float, int]:
    """(pass rate, reward mean, rewarded episodes); infrastructure failures count as failures here."""
    rewards = [t.reward for t in trajectories]
    n = len(rewards)
    if n == 0:
        return float("nan"), float("nan"), 0
    ok = sum(1 for r in rewards if r is not None and r >= threshold)
    scored = [r for r in rewards if r is not None]
    return ok / n, (math.fsum(scored) / len(scored) if scored else float("nan")), len(scored)


# --- staleness ------------------------------------------------------------------------------------------------


def staleness(traj: Trajectory, current_version: int) -> int:
    """Versions between the current weights and the oldest that generated a token of ``traj`` (0: none)."""
    versions = [t.weight_version for t in traj.turns]
    return max(0, current_version - min(versions)) if versions else 0


def allowed_staleness(traj: Trajectory, max_staleness: int) -> int:
    """The bound for ``traj``: ``max_staleness``, plus the weight versions pushed while it was paused
    (``metadata["paused_versions"]``, trainer/loop/partial.py): a partial rollout spans the versions it waited through,
    and no more. A trajectory paused before that count existed: one per pause (``resumes``)."""
    md = traj.metadata
    if "paused_versions" in md:
        return max_staleness + int(md["paused_versions"] or 0)
    return max_staleness + int(md.get("resumes", 0) or 0)


def filter_stale(trajectories: Sequence[Trajectory], current_version: int, max_staleness: int
                 ) -> tuple[list[Any], list[Any]]:
    """(kept, dropped): a trajectory is dropped when it is more versions old than its bound allows."""
    kept: list[Any] = []
    dropped: list[Any] = []
    for t in trajectories:
        (dropped if staleness(t, current_version) > allowed_staleness(t, max_staleness) else kept).append(t)
    return kept, dropped


def rl_batch(trajectories: Sequence[Trajectory], cfg: AdvantageConfig | None = None, *,
             current_version: int | None = None, pass_threshold: float = 1.0,
             branches: Sequence[Trajectory] = ()) -> Batch:
    """GRPO advantages over ``trajectories`` (grouped by ``group_id``), then the kept episodes as samples.

    ``current_version``: the weight version being trained (staleness = it minus an episode's oldest turn version).
    ``branches``: the other branches of harness episodes (docs/harnesses.md), each a sample with its own mask and the
    advantage of its episode (the record of the same group and index); a branch whose episode is not kept is not.
    """
    adv = grpo_advantages(trajectories, cfg or AdvantageConfig())
    samples = [Sample.from_trajectory(t, adv.values[t.episode_id]) for t in adv.kept]
    episode = {(t.group_id, t.group_index): adv.values[t.episode_id] for t in adv.kept}
    samples += [Sample.from_trajectory(b, episode[(b.group_id, b.group_index)]) for b in branches
                if (b.group_id, b.group_index) in episode]
    empty = sum(1 for s in samples if s.loss_tokens == 0)
    kept = [s for s in samples if s.loss_tokens > 0]
    stats = {**episode_stats(trajectories, current_version, pass_threshold),
             **{k: v for k, v in adv.stats.items() if k != "reward_mean"}, "episodes_empty": float(empty),
             **batch_health(trajectories, [s.advantage for s in kept], int(adv.stats["groups_all_equal"]))}
    return Batch(kept, "rl", stats)


# --- splitting ----------------------------------------------------------------------------------------------------

def split_ranks(lengths: Sequence[int], world: int) -> list[list[int]]:
    """Assign samples to ``world`` data-parallel ranks, longest first to the rank with the fewest tokens so far."""
    loads = [0] * world
    out: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = loads.index(min(loads))
        out[r].append(i)
        loads[r] += lengths[i]
    return [sorted(x) for x in out]


def pack(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Micro-batches (lists of indices) whose padded size ``count * longest`` stays within ``token_budget``
    (a sample longer than the budget goes alone). Longest first, so padding stays small."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    out: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        if cur and (len(cur) + 1) * lengths[cur[0]] > token_budget:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


def chunks(items: Sequence[int], n: int) -> list[list[int]]:
    """``items`` in ``n`` contiguous, nearly equal parts (mini-batches)."""
    n = max(1, min(n, len(items))) if items else 1
    q, r = divmod(len(items), n)
    out, start = [], 0
    for j in range(n):
        end = start + q + (1 if j < r else 0)
        out.append(list(items[start:end]))
        start = end
    return out


# --- tensors ------------------------------------------------------------------------------------------------------

@dataclass
class MicroBatch:
    """Padded tensors for one forward/backward; every (B, S) tensor is aligned to the predicted token."""

    input_ids: torch.Tensor            # (B, S) tokens fed
    targets: torch.Tensor              # (B, S) the next tokens
    mask: torch.Tensor                 # (B, S) float, 1 where the target is a generated token
    rollout_logprobs: torch.Tensor     # (B, S) the engine's log-prob of each target
    advantages: torch.Tensor           # (B, S) the episode's advantage on every position
    routing: torch.Tensor | None = None    # (B, S, MoE layers, k) replayed experts, -1 where none was recorded
    old_logprobs: torch.Tensor | None = None
    valid: torch.Tensor | None = None      # (B, S) 1 on the positions of a sample (0: padding); all ones if None

    @property
    def positions(self) -> torch.Tensor:
        """(B, S) 1 on the positions that belong to a sample (not padding)."""
        return self.valid if self.valid is not None else torch.ones_like(self.mask)

    @property
    def tokens(self) -> int:
        return int(self.mask.sum())

    def to(self, device: torch.device | str) -> MicroBatch:
        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)
        return MicroBatch(self.input_ids.to(device), self.targets.to(device), self.mask.to(device),
                          self.rollout_logprobs.to(device), self.advantages.to(device), mv(self.routing),
                          mv(self.old_logprobs), mv(self.valid))


def collate(samples: Sequence[Sample], pad_id: int = 0, routing_shape: tuple[int, int] | None = None) -> MicroBatch:
    """Right-pad ``samples`` into a micro-batch (causal model: padding after a sequence never affects it).
    ``routing_shape`` (MoE layers, k) builds the replay tensor from the samples' ``routing`` (position t of the
    micro-batch replays ``routing[t]``; positions without one keep -1 and route freely)."""
    B = len(samples)
    S = max(len(s) for s in samples) - 1
    if S < 1:
        raise ValueError("every sample needs at least two tokens")
    ids = torch.full((B, S + 1), pad_id, dtype=torch.long)
    mask = torch.zeros(B, S)
    rollout = torch.zeros(B, S)
    adv = torch.zeros(B, S)
    valid = torch.zeros(B, S)
    routing = None if routing_shape is None else torch.full((B, S, *routing_shape), -1, dtype=torch.long)
    for b, s in enumerate(samples):
        n = len(s)
        ids[b, :n] = torch.tensor(s.token_ids, dtype=torch.long)
        mask[b, :n - 1] = torch.tensor(s.loss_mask[1:], dtype=torch.float32)
        rollout[b, :n - 1] = torch.tensor(s.logprobs[1:], dtype=torch.float32)
        adv[b, :n - 1] = s.advantage
        valid[b, :n - 1] = 1.0
        if routing is not None and s.routing is not None:
            if len(s.routing) > n:
                raise ValueError(f"episode {s.episode_id}: {len(s.routing)} routing entries for {n} tokens")
            rows = [(t, r) for t, r in enumerate(s.routing[:n - 1]) if r is not None]
            if rows:
                pos = torch.tensor([p for p, _ in rows])
                rec = torch.tensor([r for _, r in rows], dtype=torch.long)
                if rec.shape[1:] != routing.shape[2:]:
                    raise ValueError(f"episode {s.episode_id}: routing entries of shape {tuple(rec.shape[1:])}, "
                                     f"the model has {tuple(routing.shape[2:])} (MoE layers, k)")
                routing[b, pos] = rec
    return MicroBatch(ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), mask, rollout, adv, routing, None, valid)


