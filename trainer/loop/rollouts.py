"""The training loop's rollouts: GRPO groups on the rollout workers, and partial rollouts (pause / resume).

The loop hands ``rollout.driver.Rollout`` a ``GroupSpec`` per group whose ``task`` is a ``Job``: which env, which
task, the agent loop's settings and the phase (train / eval / swe), so one set of workers plays every phase.
``LoopWorker`` (a ``RolloutWorker``, on Ray or in-process) plays a job with the one group player of ``agentenv
rollout`` too (``rollout.groups.run_group``: the task is reset once and forked ``G`` ways, the ``G`` episodes run on
the agent loop, faults are retried), passing the job's env, agent settings and phase, and its pause and resume
(``rollout.groups.Partial``). Everything else — Ray, placement, backpressure, a dead worker's groups played again,
trajectory shards, the sweep of what a run left — is ``Rollout``'s.

**Partial rollouts** (as Kimi k1.5). Between two turns an episode checks its worker's pause flag. When the loop
has the batch it needs and asks the workers to pause (``LoopRollout.pause``), each episode still running stops after
its current turn (the generation in flight finishes on the weights it began with), and is *paused to the snapshot
store* (rollout/pausing.py): its env is snapshotted (``SandboxEnv.snapshot``: the files, and the processes with ``memory``; an env whose
sandbox never started keeps only its task and step count) and closed, and its conversation — the trajectory so
far, token ids, logprobs, each turn's weight version — travels back to the loop in the group's result
(``info["paused"]``, with the episodes of the group that had finished in ``info["finished"]``; nothing is written
to the shards yet). The next iteration sends the group again as a ``Job`` with ``resume``: any worker restores
each env from its snapshot (``reset(options={"snapshot": id})``) and the episode goes on under the new weights;
its new turns record the new version, its old turns keep theirs, so the trainer sees — and the truncated
importance weight corrects — exactly which weights sampled each token. The group is complete, and written, when
all ``G`` episodes are. ``resumes`` in a trajectory's metadata counts its pauses.

Snapshots a resumed episode was restored from are deleted by the worker once it is done or paused again, unless
the job says ``keep_resumed``: the training loop's jobs do, because its newest checkpoint may still name them
(trainer/loop/partial.py deletes them once no checkpoint does).

**Weight versions** for servers that report none (vLLM, SGLang): a ``Job`` carries the loop's version when it was
made and each worker holds the newest the loop announced (``LoopRollout.set_version``, after a push returned); a
turn whose answer has no ``weight_version`` records the larger of the two as it was when its request went out.

Faults inside a job are those of ``agentenv rollout`` (``rollout.groups``): an episode that ends in ``env_error`` /
``policy_error`` is played again, from a new fork or from the state it was resumed from, at most
``RolloutConfig.max_retries`` times, then kept so (reward None, left out of the group's statistics); a policy
server that a probe finds gone stops the run (``PolicyUnavailable``). A worker that dies is handled by ``Rollout``
(the group is sent again).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from agentenv.api import Backend
from envs.protocol import GymEnv
from rollout.agent import AgentConfig
from rollout.driver import Rollout
from rollout.groups import GroupResult, GroupSpec
from rollout.harnesses import HarnessConfig
from rollout.pausing import Partial, Paused
from rollout.raycluster import await_ref
from rollout.trajectory import Trajectory
from rollout.workers import RolloutWorker

log = logging.getLogger(__name__)


@dataclass
class Job:
    """What a group plays (``GroupSpec.task``): env, task, agent settings, phase; or the resumption of a group."""

    env_id: str
    task: Any = None                     # a record, an id, or None (the env draws from the spec's seed)
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    agent: AgentConfig = field(default_factory=AgentConfig)
    phase: str = "train"                 # train | eval | swe
    iteration: int = 0                   # the loop iteration that launched it
    memory_fork: bool = False
    resume: list[Paused] = field(default_factory=list)
    finished: list[Trajectory] = field(default_factory=list)   # the group's episodes already done
    weight_version: int = 0              # the loop's weight version when it made the job (module docstring)
    keep_resumed: bool = False           # leave the snapshots resumed from to the loop (module docstring)
    harness: HarnessConfig | None = None  # an agent harness plays the episodes (rollout.harnesses)

    @property
    def resuming(self) -> bool:
        return bool(self.resume)

    def partial(self, should_pause: Callable[[], bool] | None, served_version: Callable[[], int] | None,
                store: Backend | None) -> Partial:
        """The job's pause and resume as the group player takes them (``store``: where its snapshots live)."""
        return Partial(should_pause, served_version, self.resume, self.finished, store, self.keep_resumed)


@dataclass
class Collected:
    """What one collection of groups brought back."""

    groups: list[GroupResult] = field(default_factory=list)  # complete groups
    wall_s: float = 0.0
    env_s: float = 0.0                                      # summed over episodes: reset, fork, steps
    policy_s: float = 0.0
    paused: int = 0                                         # episodes paused at the end of this collection
    resumed: int = 0                                        # episodes resumed in it
    launched: int = 0
    cursor: int | None = None                               # the task cursor after its new groups (training)
    pending: bytes | None = None                            # the groups paused at its end (PartialRollouts.dump)
    consumed: list[dict[str, Any]] = field(default_factory=list)   # env states its resumed groups started from

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g.trajectories]

    @property
    def branches(self) -> list[Trajectory]:
        """The other branches of harness episodes (``GroupResult.branches``): samples of their episode's advantage."""
        return [t for g in self.groups for t in g.branches]

    def split(self) -> dict[str, float]:
        """The wall time split between environment and policy in proportion to the episodes' summed times."""
        total = self.env_s + self.policy_s
        share = self.env_s / total if total > 0 else 0.5
        return {"time/env": self.wall_s * share, "time/policy": self.wall_s * (1 - share),
                "time/rollout": self.wall_s}


def turn_times(trajs: Sequence[Any]) -> tuple[float, float]:
    """Seconds in the environment (reset, fork, steps) and in the policy, summed over the episodes' turns."""
    env = sum(sum(u.env_s for u in t.turns) + t.fork_s + float(t.metadata.get("reset_s") or 0.0) for t in trajs)
    policy = sum(sum(u.policy_s for u in t.turns) for t in trajs)
    return env, policy


# --- the worker and the driver ----------------------------------------------------------------------------------


class LoopWorker(RolloutWorker):
    """A rollout worker that plays ``Job``s (any env, any phase) and pauses between turns when asked."""

    def __init__(self, config: Any, key: str, run_id: str) -> None:
        super().__init__(config, key, run_id)
        self._pause = False
        self._version = 0

    def set_version(self, version: int) -> None:
        """The loop's newest weight version (a push that returned); see the module docstring."""
        self._version = max(self._version, int(version))

    def pause(self) -> int:
        """Ask every training episode of this worker to stop after its current turn (evaluation and SWE episodes
        play on); returns the groups running."""
        self._pause = True
        return self.running

    def unpause(self) -> None:
        self._pause = False

    def _make(self, env_id: str, kwargs: dict[str, Any]) -> Callable[[], GymEnv]:
        def make() -> GymEnv:
            import gymnasium

            import envs  # noqa: F401  (registers the env ids)

            return gymnasium.make(env_id, api=self.api, **kwargs)
        return make

    async def run_group(self, spec: GroupSpec) -> GroupResult:
        job = spec.task
        if not isinstance(job, Job):
            return await super().run_group(spec)
        partial = job.partial(lambda: self._pause and job.phase == "train",
                              lambda: max(job.weight_version, self._version), self.api)
        result = await self.play(replace(spec, task=job.task), self._make(job.env_id, job.env_kwargs), job.agent,
                                 env_id=job.env_id, memory=job.memory_fork,
                                 metadata={"phase": job.phase, "iteration": job.iteration}, partial=partial,
                                 harness=job.harness)
        result.spec = spec   # the loop's spec, whose task is the job: a paused group is resumed from it
        return result


class LoopRollout(Rollout):
    """``Rollout`` with ``LoopWorker``s, and the pause / unpause of every worker."""

    worker_class = LoopWorker

    async def _each(self, local: Callable[[LoopWorker], object], remote: Callable[[Any], Any]) -> None:
        """Call every live worker: ``local(worker)`` in process, ``remote(actor)`` (an ObjectRef) on Ray."""
        for s in self.slots:
            if s.dead:
                continue
            if isinstance(s.handle, LoopWorker):
                local(s.handle)
            else:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(await_ref(remote(s.handle)), 60)

    async def pause(self) -> None:
        """Every worker's running episodes stop after their current turn and come back paused."""
        await self._each(LoopWorker.pause, lambda actor: actor.pause.remote())

    async def unpause(self) -> None:
        await self._each(LoopWorker.unpause, lambda actor: actor.unpause.remote())

    async def set_version(self, version: int) -> None:
        """Tell every worker the loop's weight version now (after a push returned)."""
        await self._each(lambda worker: worker.set_version(version), lambda actor: actor.set_version.remote(version))
