"""The training loop's paused groups (partial rollouts) across batches, weight versions and checkpoints.

A group whose episodes were still running when a batch was complete comes back paused (trainer/loop/rollouts.py); it is
kept here with the loop's weight version at that moment, and the next batch resumes it first.

**Staleness allowance.** A trajectory may be ``rl.max_staleness`` versions old when trained on, plus the weight
versions that passed while it was paused: ``metadata["paused_versions"]`` grows by (version at resume - version
at pause) on every resume (``trainer.algorithm.batch.allowed_staleness``). A group paused and resumed in the producer's next
batch before any new weights were pushed gets no extra allowance; one that waited through a push gets one.

**Checkpoints.** A checkpoint after the step on batch ``t`` holds the data position as batch ``t`` left it: the
task cursor after batch ``t``'s new groups and the groups paused at the end of batch ``t`` (``PAUSED_FILE`` in
the checkpoint folder, pickled as the rank files are; their snapshots stay in the snapshot store). With
``max_staleness >= 1`` the producer may be batches ahead: the tasks of batches not trained yet are handed out
again on ``--resume``, not skipped, and groups those batches resumed are resumed again from the same snapshots.
So a snapshot an episode was resumed from is not deleted by the worker (``Job.keep_resumed``) but here, once a
newer checkpoint no longer names it (or at once when the run writes no checkpoints); the snapshots the newest
checkpoint names are spared by the rollout's sweeps (``Rollout.keep_snapshots``) and left in the store at the
end of the run (counted ``partial_kept_for_resume``); other paused groups left at the end are dropped (counted
``partial_left_at_end``). On a remote env server (``ray.env_url``) deletion is left to the run's sweep.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rollout.groups import GroupResult, GroupSpec
from rollout.pausing import drop_snapshot
from trainer.loop.rollouts import Collected, LoopRollout, turn_times

PAUSED_FILE = "paused-groups.pkl"
# where the classes a checkpoint pickled before issue 42 split trainer/ by concern live now (old runs' --resume)
MOVED = {**{f"trainer.{m}": f"trainer.loop.{m}" for m in ("rollouts", "partial", "config", "typed_toml", "tasks",
                                                         "schedule", "evaluation", "services", "report", "parts")},
         **{f"trainer.{m}": f"trainer.algorithm.{m}" for m in ("advantages", "losses", "batch", "balance", "health")},
         **{f"trainer.{m}": f"trainer.distributed.{m}" for m in ("parallel", "rank", "ray_ranks", "sync")}}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        return super().find_class(MOVED.get(module, module), name)


def load_groups(data: bytes) -> list[PausedGroup]:
    """The paused groups ``dump`` wrote, by this version or one from before the trainer's modules moved."""
    groups: list[PausedGroup] = _Unpickler(io.BytesIO(data)).load()
    return groups


@dataclass
class PausedGroup:
    """A group that came back paused, and the loop's weight version when it did."""

    result: GroupResult  # with info["paused"] (and info["finished"])
    version: int


def snapshot_ids(groups: Iterable[PausedGroup]) -> set[str]:
    return {str(p.env_state["snapshot"]) for g in groups for p in g.result.info["paused"] if "snapshot" in p.env_state}


class PartialRollouts:
    """Paused groups between batches (see the module docstring). ``env_url``: the remote env server, if any."""

    def __init__(self, max_resumes: int, env_url: str = "", api: Any = None,
                 counts: Counter[str] | None = None) -> None:
        self.max_resumes, self.env_url = max_resumes, env_url
        self.api = api                                # the snapshot store (None: this host's, ``agentenv``)
        self.groups: list[PausedGroup] = []
        self.consumed: list[dict[str, Any]] = []      # env states resumed from, in trained but uncheckpointed batches
        self.referenced: set[str] = set()             # snapshot ids the newest checkpoint names
        self.referenced_groups: set[str] = set()      # and its paused groups' ids
        self.counts: Counter[str] = Counter() if counts is None else counts

    def add(self, result: GroupResult, version: int) -> None:
        self.groups.append(PausedGroup(result, version))

    def dump(self) -> bytes:
        """The paused groups as they are now (a copy: resuming them later changes the objects)."""
        return pickle.dumps(self.groups)

    def resume_specs(self, version: int, iteration: int) -> tuple[list[GroupSpec], list[dict[str, Any]]]:
        """Jobs that resume every paused group under weight version ``version`` (groups paused more than
        ``max_resumes`` times are dropped, counted), and the env states they consume."""
        specs: list[GroupSpec] = []
        consumed: list[dict[str, Any]] = []
        for g in self.groups:
            spec, paused = g.result.spec, g.result.info["paused"]
            finished = list(g.result.info.get("finished", []))
            consumed.extend(p.env_state for p in paused)
            if any(p.resumes + 1 > self.max_resumes for p in paused):
                self.counts["partial_dropped_groups"] += 1
                continue
            passed = max(0, version - g.version)
            for t in [p.traj for p in paused] + finished:
                t.metadata["paused_versions"] = int(t.metadata.get("paused_versions", 0) or 0) + passed
            job = replace(spec.task, resume=list(paused), finished=finished, iteration=iteration,
                          weight_version=version, keep_resumed=True)
            specs.append(GroupSpec(spec.group_id, job, spec.task_id, spec.group_size, spec.seed, spec.index))
        self.groups = []
        return specs, consumed

    # -- snapshots and checkpoints --
    def trained(self, consumed: list[dict[str, Any]], checkpointed: bool, pending: bytes | None,
                checkpoints: bool) -> set[str]:
        """A batch was trained on (``consumed``: the env states it resumed from); ``checkpointed``: a checkpoint
        holding ``pending`` (the batch's ``dump``) was written. Deletes the snapshots no checkpoint needs now;
        returns the ids the newest checkpoint names."""
        self.consumed.extend(consumed)
        if checkpointed and pending is not None:
            self._refer(load_groups(pending))
        if checkpointed or not checkpoints:
            keep = [s for s in self.consumed if s.get("snapshot") in self.referenced]
            self.drop([s for s in self.consumed if s.get("snapshot") not in self.referenced])
            self.consumed = keep
        return self.referenced

    def restore(self, folder: Path) -> int:
        """The paused groups of the checkpoint in ``folder`` (none when it holds no file); returns how many."""
        path = Path(folder) / PAUSED_FILE
        if not path.is_file():
            return 0
        self.groups = load_groups(path.read_bytes())
        self._refer(self.groups)
        return len(self.groups)

    def _refer(self, groups: list[PausedGroup]) -> None:
        self.referenced = snapshot_ids(groups)
        self.referenced_groups = {g.result.spec.group_id for g in groups}

    def finish(self) -> None:
        """The run's end: paused groups the newest checkpoint names stay (counted), the rest are dropped."""
        for g in self.groups:
            paused = g.result.info["paused"]
            named = g.result.spec.group_id in self.referenced_groups
            self.counts["partial_kept_for_resume" if named else "partial_left_at_end"] += len(paused)
            if not named:
                self.drop([p.env_state for p in paused])
        self.groups = []
        self.drop([s for s in self.consumed if s.get("snapshot") not in self.referenced])
        self.consumed = []

    def drop(self, states: Iterable[dict[str, Any]]) -> None:
        """Delete these env states' snapshots (local store only; a remote one is left to the run's sweep)."""
        states = [s for s in states if "snapshot" in s]
        if self.env_url or not states:
            return
        api = self.api
        if api is None:
            import agentenv as api
        for s in states:
            with contextlib.suppress(Exception):
                drop_snapshot(api, s)


# --- the loop's data position in a checkpoint -----------------------------------------------------------------


@dataclass
class DataState:
    """What a checkpoint's ``meta.json`` holds of the loop's data position: the iteration, the task cursor as the
    newest trained batch left it (module docstring), the group counter (group ids stay unique), counts, evaluations,
    the weight version. The paused groups go beside it (``PAUSED_FILE``)."""

    iteration: int = 0
    task_cursor: int = 0
    group_seq: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    evals: dict[str, dict[str, Any]] = field(default_factory=dict)
    version: int = 0

    def meta(self) -> dict[str, Any]:
        """As ``meta.json`` holds it (``Trainer.checkpoint``'s ``data_state``)."""
        return {"iteration": self.iteration, "task_cursor": self.task_cursor, "group_seq": self.group_seq,
                "counts": self.counts, "evals": self.evals, "version": self.version}

    @classmethod
    def read(cls, data: Mapping[str, Any], iteration: int = 0) -> DataState:
        """``meta()``'s dict back, for ``--resume`` (a missing iteration: ``iteration``)."""
        return cls(int(data.get("iteration", iteration)), int(data.get("task_cursor", 0)),
                   int(data.get("group_seq", 0)), dict(data.get("counts", {})), dict(data.get("evals", {})),
                   int(data.get("version", 0)))


# --- a batch of the loop, cut short ------------------------------------------------------------------------------


class InfraError(RuntimeError):
    """Every episode of a batch or an evaluation failed on infrastructure (env or policy): nothing to learn from."""


async def collect(rollout: LoopRollout, partial: PartialRollouts, specs: list[GroupSpec], need: int | None = None,
                  *, version: Callable[[], int]) -> Collected:
    """``Loop.collect``: play ``specs`` on ``rollout``; with ``need``, once ``need`` groups are complete the workers
    are asked to pause and the groups still running come back paused, kept in ``partial`` with the weight version
    ``version()`` as it is when each comes back (a push may land while a producer's batch plays)."""
    out = Collected(launched=len(specs))
    out.resumed = sum(len(s.task.resume) for s in specs)
    stop = False

    def feed() -> Iterator[GroupSpec]:
        for s in specs:
            if stop:
                return
            yield s

    t0 = time.perf_counter()
    if need is not None:
        await rollout.unpause()
    async for result in rollout.stream(feed()):
        paused = result.info.get("paused")
        trajs = list(result.trajectories) or [*result.info.get("finished", []), *(p.traj for p in paused or [])]
        env_s, policy_s = turn_times(trajs)
        out.env_s += env_s
        out.policy_s += policy_s
        if paused:
            partial.add(result, version())
            out.paused += len(paused)
        else:
            out.groups.append(result)
        if need is not None and not stop and len(out.groups) >= need:
            stop = True
            await rollout.pause()
    out.wall_s = time.perf_counter() - t0
    trajs = out.trajectories
    if trajs and all(t.infra_error for t in trajs):   # the env or the policy is down: stop, never train on nothing
        raise InfraError(f"every one of the {len(trajs)} episodes failed on infrastructure "
                         f"({trajs[0].finish_reason}: {trajs[0].error[:400]})")
    return out
