"""An episode paused between two turns (partial rollouts): its conversation, and its env's state in the store.

``rollout.groups.run_group`` pauses an episode when its ``should_pause()`` says so between two turns: the env is
snapshotted (``BranchingEnv.snapshot``: the files, and the processes with ``memory``; an env whose sandbox never
started keeps only its task and step count) and closed (``pause_env``), and the episode comes back as a ``Paused``
in the group's result. A later ``run_group`` given it resumes it: any worker restores the env (``restore_env``:
``reset(options={"snapshot": id})``) and the episode goes on from its conversation. The training loop keeps paused
groups across batches and checkpoints (trainer/loop/partial.py); a checkpoint pickles them, so ``Paused`` keeps its
fields.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from agentenv.api import Backend
from envs.protocol import GymEnv, unwrap
from rollout.agent import Episode, Tokenizer
from rollout.trajectory import Trajectory

EnvState = dict[str, Any]  # {"snapshot": id, "steps": n} or {"task": task, "steps": n}


@dataclass(frozen=True)
class Partial:
    """Pause and resume of a group's episodes (``rollout.groups``' module docstring); the default plays every episode out."""

    should_pause: Callable[[], bool] | None = None
    served_version: Callable[[], int] | None = None
    resume: Sequence[Paused] = ()           # the group's paused episodes, to play on
    finished: Sequence[Trajectory] = ()     # and its episodes already done
    store: Backend | None = None            # where the snapshots resumed from are deleted
    keep_resumed: bool = False              # leave those snapshots to the caller


@dataclass
class Paused:
    """One episode paused between two turns: its conversation, and where its env's state lives."""

    index: int                           # group index
    traj: Trajectory
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    env_state: EnvState
    resumes: int = 0                     # how many times it was paused before this one

    def episode(self, tokenizer: Tokenizer) -> Episode:
        """The episode going on from here: a copy, so that a resumed play that fails can start from here again."""
        episode = Episode(tokenizer, self.tools, self.traj)
        episode.messages = self.messages
        return episode.copy()


def pause_env(env: GymEnv, memory: bool = False) -> EnvState:
    """Put an env's state in the snapshot store (or, for an env with no sandbox yet, keep its task) and close it."""
    try:
        base = unwrap(env)
        if base.lazy_sandbox and base.sandbox is None:
            return {"task": base.task, "steps": int(base.steps)}
        snap = base.snapshot(memory=memory)
        return {"snapshot": snap.id, "steps": int(base.steps)}
    finally:
        with contextlib.suppress(Exception):
            env.close()


def restore_env(make_env: Callable[[], GymEnv], state: EnvState, seed: int | None = None) -> GymEnv:
    """An env continuing a paused one (``pause_env``'s state)."""
    env = make_env()
    try:
        if "snapshot" in state:
            env.reset(options={"snapshot": state["snapshot"]})
        else:
            env.reset(seed=seed, options={"task": state["task"]})
            unwrap(env).steps = int(state.get("steps", 0))
    except BaseException:
        with contextlib.suppress(Exception):
            env.close()
        raise
    return env


def drop_snapshot(store: Backend | None, state: EnvState) -> None:
    """Delete a paused episode's snapshot once its env is restored and done (best effort; the run's sweep is the
    backstop)."""
    sid = state.get("snapshot")
    if sid is None or store is None:
        return
    with contextlib.suppress(Exception):
        store.Snapshot.get(sid).delete()
