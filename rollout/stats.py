"""The running totals of a rollout run: what its progress bar shows and its ``summary.json`` keeps.

``ksmd_cpu_s``: the CPU seconds this host's ksmd spent while the run ran, what merging its groups' memory cost
(the envs share memory within a fork family by default: ``envs/base.py``, ``agentenv.host.ksm``); None where the
host has no ksmd. Host-wide: sandboxes of other runs on the host count too, and env servers on other hosts do not.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from agentenv.host import ksm
from rollout.groups import GroupResult


@dataclass
class RunStats:
    """Running totals of a run (the progress bar and the summary)."""

    started: float = field(default_factory=time.monotonic)
    groups: int = 0
    episodes: int = 0
    rewards: list[float] = field(default_factory=list)
    finish: Counter[str] = field(default_factory=Counter)
    generated_tokens: int = 0
    turns: int = 0
    policy_s: float = 0.0
    env_s: float = 0.0
    reset_s: float = 0.0
    fork_s: float = 0.0
    retried: int = 0             # episodes played more than once
    worker_failures: int = 0     # group attempts lost to a dead worker
    groups_total: int | None = None
    ended: float | None = None
    ksmd: int | None = field(default_factory=ksm.ksmd_pid)
    ksmd_cpu: list[float | None] = field(default_factory=list)  # at the start, and once read after the end

    def __post_init__(self) -> None:
        self.ksmd_cpu.append(self._ksmd_now())

    def _ksmd_now(self) -> float | None:
        return ksm.ksmd_cpu_seconds(self.ksmd) if self.ksmd is not None else None

    @property
    def ksmd_cpu_s(self) -> float | None:
        """ksmd's CPU seconds from the run's start to now, or to its end once ended (see the module doc)."""
        if self.ended is not None and len(self.ksmd_cpu) == 1:
            self.ksmd_cpu.append(self._ksmd_now())
        start, now = self.ksmd_cpu[0], self.ksmd_cpu[1] if len(self.ksmd_cpu) > 1 else self._ksmd_now()
        return None if start is None or now is None else now - start

    def add(self, result: GroupResult) -> None:
        self.groups += 1
        self.reset_s += result.reset_s
        self.fork_s += result.fork_s
        for t in result.trajectories:
            self.episodes += 1
            self.finish[t.finish_reason] += 1
            if t.reward is not None:
                self.rewards.append(t.reward)
            self.generated_tokens += t.generated_tokens
            self.turns += len(t.turns)
            self.policy_s += sum(x.policy_s for x in t.turns)
            self.env_s += sum(x.env_s for x in t.turns)
            if int(t.metadata.get("attempt", 1)) > 1:
                self.retried += 1

    @property
    def elapsed(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    @property
    def reward_mean(self) -> float | None:
        return sum(self.rewards) / len(self.rewards) if self.rewards else None

    @property
    def reward_std(self) -> float | None:
        m = self.reward_mean
        return None if m is None else math.sqrt(sum((r - m) ** 2 for r in self.rewards) / len(self.rewards))

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def episodes_per_min(self) -> float:
        return 60.0 * self.episodes / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def env_total_s(self) -> float:
        return self.env_s + self.reset_s + self.fork_s

    @property
    def env_share(self) -> float | None:
        """Environment time (reset, fork, steps) over environment + policy time, summed over episodes."""
        total = self.env_total_s + self.policy_s
        return self.env_total_s / total if total > 0 else None

    def to_json(self) -> dict[str, Any]:
        share = self.env_share
        return {"groups": self.groups, "episodes": self.episodes, "reward_mean": self.reward_mean,
                "reward_std": self.reward_std, "rewarded_episodes": len(self.rewards),
                "finish_reasons": dict(self.finish), "generated_tokens": self.generated_tokens, "turns": self.turns,
                "elapsed_s": round(self.elapsed, 3), "tokens_per_s": round(self.tokens_per_s, 2),
                "episodes_per_min": round(self.episodes_per_min, 2), "policy_s": round(self.policy_s, 3),
                "env_step_s": round(self.env_s, 3), "reset_s": round(self.reset_s, 3), "fork_s": round(self.fork_s, 3),
                "env_share": None if share is None else round(share, 4),
                "policy_share": None if share is None else round(1 - share, 4),
                "retried_episodes": self.retried, "worker_failures": self.worker_failures,
                "ksmd_cpu_s": None if (k := self.ksmd_cpu_s) is None else round(k, 2)}
