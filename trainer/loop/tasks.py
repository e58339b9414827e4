"""The tasks of a run: where training and held-out tasks come from, in which order, and each env's step limit.

A spec (``seeds:A-B``, ``ids:...``, ``py:module:function key=value ...``, or a JSONL file) names a list of tasks;
``TaskSource`` walks it in a seeded order, pass after pass (training), or from its start (held-out evaluation:
the same tasks every time). The position in that walk (``task_cursor``) is part of a checkpoint, so a resumed
run neither repeats nor skips tasks.

``resolve_function`` finds a ``module:function`` a config names (a task list, an expert). ``check_apart`` is the pre-flight's proof that the held-out and validation tasks are not training tasks: it compares
the tasks by the env module's ``task_key`` (what a policy sees and must answer: two seeds of Lookup-v0 can make one
task), or by task id where the env has none, and refuses ``seeds:`` sets, whose tasks only the env knows.
"""

from __future__ import annotations

import importlib
import random
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from trainer.loop.config import ConfigError, parse_task_spec


@dataclass(frozen=True)
class TaskRef:
    """One task to play: a record / id (``task``) or None with a ``seed`` from which the env draws it."""

    task: Any = None
    seed: int | None = None

    @property
    def task_id(self) -> str:
        if self.task is None:
            return f"seed-{self.seed}"
        from rollout.workers import task_id_of

        return task_id_of(self.task)


def resolve_function(ref: str) -> Callable[..., Any]:
    """``module:function`` -> the function (ImportError / AttributeError name what is missing)."""
    module, sep, name = ref.partition(":")
    if not sep or not module or not name:
        raise ConfigError(f"{ref!r} is not module:function")
    fn = getattr(importlib.import_module(module), name)
    if not callable(fn):
        raise ConfigError(f"{ref} is not callable")
    return fn


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


def key_function(env_id: str) -> Callable[[Any], Hashable] | None:
    """The ``task_key`` function of the module that defines ``env_id``'s env class (None where it has none)."""
    import importlib

    import gymnasium

    import envs  # noqa: F401  (registers the env ids)

    spec = gymnasium.registry.get(env_id)
    entry = spec.entry_point if spec is not None else None
    if not isinstance(entry, str) or ":" not in entry:
        return None
    fn = getattr(importlib.import_module(entry.partition(":")[0]), "task_key", None)
    return fn if callable(fn) else None


def check_apart(env_id: str, sets: dict[str, str], train: str = "train") -> str | None:
    """A problem when the task sets ``{name: spec}`` share a task with the training set (and each other), or
    cannot be compared; None when they are apart."""
    keyed = key_function(env_id)
    where = f"{env_id}'s task_key" if keyed else "task id"
    seen: dict[Hashable, str] = {}
    for name, spec in sets.items():
        src = TaskSource(spec)
        if src.kind == "seeds":
            return (f"{name} = {spec!r}: the env draws a task from each seed, so the pre-flight cannot check that "
                    f"held-out, validation and training tasks differ; list them (ids:, py:MODULE:FUNCTION, a file), "
                    f"e.g. py:envs.lookup_env:task_ids split=heldout or py:envs.tool_env:task_ids split=heldout")
        for item in src.items:
            key = keyed(item) if keyed else TaskRef(item).task_id
            other = seen.setdefault(key, name)
            if other != name:
                return (f"{name} and {other} share a task ({TaskRef(item).task_id}, same {where}): the "
                        f"held-out and validation tasks must never be trained on; choose disjoint sets")
    return None
