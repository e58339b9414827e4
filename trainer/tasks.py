"""The tasks of a run: where training and held-out tasks come from, in which order, and each env's step limit.

A spec (``seeds:A-B``, ``ids:...``, ``py:module:function key=value ...``, or a JSONL file) names a list of tasks;
``TaskSource`` walks it in a seeded order, pass after pass (training), or from its start (held-out evaluation:
the same tasks every time). The position in that walk (``task_cursor``) is part of a checkpoint, so a resumed
run neither repeats nor skips tasks.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from trainer.config import parse_task_spec
from trainer.services import resolve_function


@dataclass(frozen=True)
class TaskRef:
    """One task to play: a record / id (``task``) or None with a ``seed`` from which the env draws it."""

    task: Any = None
    seed: int | None = None

    @property
    def task_id(self) -> str:
        if isinstance(self.task, dict):
            return str(self.task.get("instance_id") or self.task.get("id") or "")
        if self.task is not None:
            return str(self.task)
        return f"seed-{self.seed}"


class TaskSource:
    """The tasks of a spec (``seeds:A-B``, ``ids:...``, ``py:...``, a file), drawn in a seeded order, endlessly."""

    def __init__(self, spec: str, seed: int = 0) -> None:
        self.kind, value = parse_task_spec(spec)
        self.seed = seed
        if self.kind == "seeds":
            self.seeds: range = value
            self.items: list[Any] = []
        elif self.kind == "ids":
            self.items = list(value)
        elif self.kind == "py":
            ref, kwargs = value
            self.items = list(resolve_function(ref)(**kwargs))
        else:
            from rollout.workers import load_task_refs
            self.items = list(load_task_refs(value))

    def __len__(self) -> int:
        return len(self.seeds) if self.kind == "seeds" else len(self.items)

    def first(self, n: int) -> list[TaskRef]:
        """The first ``n`` tasks in listed order (held-out evaluation: the same tasks every time)."""
        if self.kind == "seeds":
            return [TaskRef(None, s) for s in self.seeds[:n]]
        return [TaskRef(t, self.seed + i) for i, t in enumerate(self.items[:n])]

    def at(self, i: int) -> TaskRef:
        """The ``i``-th task of the run's training order (a seeded permutation per pass over the list)."""
        n = len(self)
        if self.kind == "seeds":
            return TaskRef(None, self.seeds[(self.seed * 1_000_003 + i) % n])
        epoch, j = divmod(i, n)
        order = list(range(n))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return TaskRef(self.items[order[j]], self.seed * 1_000_003 + i)

    def values(self, n: int) -> list[Any]:
        """``n`` tasks as an expert takes them: seeds for a seeds spec, else the ids / records."""
        refs = [self.at(i) for i in range(n)]
        return [r.seed if self.kind == "seeds" else r.task for r in refs]


def step_limit(env_id: str, turns: int) -> dict[str, Any]:
    """The env's own step limit set to the agent's turn limit, so that the env ends (and grades) the episode on
    its last turn instead of the loop stopping it ungraded: for envs registered with ``max_steps`` (our
    ``SandboxEnv``s), ``max_steps`` and Gymnasium's ``max_episode_steps``; nothing for other envs."""
    import gymnasium

    import envs  # noqa: F401  (registers the env ids)

    spec = gymnasium.registry.get(env_id)
    if spec is None or "max_steps" not in (spec.kwargs or {}):
        return {}
    return {"max_steps": turns, "max_episode_steps": turns}
