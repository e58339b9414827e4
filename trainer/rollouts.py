"""The training loop's rollouts: GRPO groups on the rollout workers, and partial rollouts (pause / resume).

The loop hands ``rollout.driver.Rollout`` a ``GroupSpec`` per group whose ``task`` is a ``Job``: which env, which
task, the agent loop's settings and the phase (train / eval / swe), so one set of workers plays every phase.
``LoopWorker`` (a ``RolloutWorker``, on Ray or in-process) plays a job with ``play_group``: the task is reset once
and forked ``G`` ways (``rollout.groups.branch``), then the ``G`` episodes run on the agent loop's turn primitives
(``Episode.ask / take / act``). Everything else — Ray, placement, backpressure, a dead worker's groups played
again, trajectory shards, the sweep of what a run left — is ``Rollout``'s.

**Partial rollouts** (as Kimi k1.5). Between two turns an episode checks its worker's pause flag. When the loop
has the batch it needs and asks the workers to pause (``LoopRollout.pause``), each episode still running stops after
its current turn (the generation in flight finishes on the weights it began with), and is *paused to the snapshot
store*: its env is snapshotted (``SandboxEnv.snapshot``: the files, and the processes with ``memory``; an env whose
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
(trainer/partial.py deletes them once no checkpoint does).

**Weight versions** for servers that report none (vLLM, SGLang): a ``Job`` carries the loop's version when it was
made and each worker holds the newest the loop announced (``LoopRollout.set_version``, after a push returned); a
turn whose answer has no ``weight_version`` records the larger of the two as it was when its request went out.

Faults inside a job are recorded, not retried: an env or policy failure ends that episode as ``env_error`` /
``policy_error`` (reward None, left out of the group's statistics); a reset or fork that fails makes every
episode of the group ``env_error``. A worker that dies is handled by ``Rollout`` (the group is sent again).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout.agent import AgentConfig, EnvFailed, Episode, Tokenizer, begin, play
from rollout.driver import Rollout, await_ref
from rollout.groups import GroupResult, GroupSpec, branch, close_all, failed
from rollout.trajectory import Trajectory
from rollout.workers import RolloutWorker

log = logging.getLogger(__name__)


@dataclass
class Paused:
    """One episode paused between two turns: its conversation, and where its env's state lives."""

    index: int                           # group index
    traj: Trajectory
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    env_state: dict[str, Any]            # {"snapshot": id, "steps": n} or {"task": task, "steps": n}
    resumes: int = 0                     # how many times it was paused before this one


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

    @property
    def resuming(self) -> bool:
        return bool(self.resume)


PauseCheck = Callable[[], bool]


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


# --- the env's state across a pause ---------------------------------------------------------------------------


def pause_env(env: Any, memory: bool = False) -> dict[str, Any]:
    """Put an env's state in the snapshot store (or, for an env with no sandbox yet, keep its task) and close it."""
    base = getattr(env, "unwrapped", env)
    try:
        if getattr(base, "lazy_sandbox", False) and getattr(base, "sandbox", None) is None:
            return {"task": base.task, "steps": int(base.steps)}
        snap = base.snapshot(memory=memory)
        return {"snapshot": snap.id, "steps": int(base.steps)}
    finally:
        with contextlib.suppress(Exception):
            env.close()


def restore_env(make_env: Callable[[], Any], state: dict[str, Any], seed: int | None = None) -> Any:
    """An env continuing a paused one (``pause_env``'s state)."""
    env = make_env()
    try:
        if "snapshot" in state:
            env.reset(options={"snapshot": state["snapshot"]})
        else:
            env.reset(seed=seed, options={"task": state["task"]})
            base = getattr(env, "unwrapped", env)
            base.steps = int(state.get("steps", 0))
    except BaseException:
        close_all([env])
        raise
    return env


def drop_snapshot(api: Any, state: dict[str, Any]) -> None:
    """Delete a paused episode's snapshot once its env is restored and done (best effort; the run's sweep is the
    backstop)."""
    sid = state.get("snapshot")
    if sid is None or api is None:
        return
    with contextlib.suppress(Exception):
        api.Snapshot.get(sid).delete()


# --- one group ----------------------------------------------------------------------------------------------------


async def play_group(make_env: Callable[[], Any], spec: GroupSpec, job: Job, policy: Any, tokenizer: Tokenizer,
                     should_pause: PauseCheck | None = None, api: Any = None,
                     metadata: dict[str, Any] | None = None,
                     served_version: Callable[[], int] | None = None) -> GroupResult:
    """Play (or resume) the group ``spec`` / ``job``; a result with ``info["paused"]`` is not complete yet (see the
    module docstring). ``make_env()`` makes one env of the job's kind; ``served_version()``: the version of turns
    whose answer reports none (default: the job's)."""
    g = spec.group_size
    version = served_version or (lambda: job.weight_version)
    drop = (lambda api, state: None) if job.keep_resumed else drop_snapshot
    result = GroupResult(spec, [])
    done: dict[int, Trajectory] = {t.group_index: t for t in job.finished}
    running: list[tuple[int, Episode, Any, dict[str, Any]]] = []     # index, episode, env, its paused state
    meta = {"phase": job.phase, "iteration": job.iteration, **(metadata or {})}
    if job.resuming:
        for t in done.values():   # they waited for the group's paused episodes: the same staleness allowance
            t.metadata["resumes"] = int(t.metadata.get("resumes", 0) or 0) + 1
        for p in job.resume:
            try:
                env = await asyncio.to_thread(restore_env, make_env, p.env_state, spec.seed)
            except Exception as e:  # noqa: BLE001 - the episode's result
                p.traj.finish_reason, p.traj.reward = "env_error", None
                p.traj.error = f"resume: {type(e).__name__}: {e}"[:2000]
                p.traj.metadata.update(resumes=p.resumes + 1)
                done[p.index] = p.traj
                await asyncio.to_thread(drop, api, p.env_state)
                continue
            episode = Episode(tokenizer, p.tools, p.traj)
            episode.messages = p.messages
            p.traj.metadata["resumes"] = p.resumes + 1
            running.append((p.index, episode, env, p.env_state))
    else:
        opts = None if job.task is None else {"task": job.task}
        parent: Any = None
        t0 = time.perf_counter()
        try:
            parent = await asyncio.to_thread(make_env)
            obs, info = await asyncio.to_thread(parent.reset, seed=spec.seed, options=opts)
            result.reset_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            kids = [parent] if g == 1 else await asyncio.to_thread(branch, parent, g, job.memory_fork, make_env,
                                                                   spec.seed)
            result.fork_s = time.perf_counter() - t1 if g > 1 else 0.0
        except Exception as e:  # noqa: BLE001 - every episode of the group failed to start
            if parent is not None:
                await asyncio.to_thread(close_all, [parent])
            result.error = f"reset: {type(e).__name__}: {e}"
            result.trajectories = [failed(spec, "env_error", result.error, job.env_id, i) for i in range(g)]
            for t in result.trajectories:
                t.metadata.update(meta)
            return result
        if g > 1:
            await asyncio.to_thread(close_all, [parent])
        task_id = str(info.get("task") or spec.task_id)
        for i, kid in enumerate(kids):
            traj = Trajectory(task_id=task_id, env_id=job.env_id, seed=spec.seed, group_id=spec.group_id,
                              group_index=i)
            traj.fork_s = result.fork_s / len(kids)
            traj.metadata.update(meta, reset_s=result.reset_s, resumes=0)
            try:
                episode = await begin(kid, tokenizer, job.agent, traj, obs, None)
            except EnvFailed as e:   # cannot happen with a first observation; kept for safety
                traj.finish_reason, traj.reward, traj.error = "env_error", None, str(e)
                done[i] = traj
                continue
            running.append((i, episode, kid, {}))
    outcomes = await asyncio.gather(*(play(ep, env, policy, job.agent, should_pause, version)
                                      for _, ep, env, _ in running), return_exceptions=True)
    paused: list[Paused] = []
    previous = {p.index: p for p in job.resume}
    for (i, episode, env, state), out in zip(running, outcomes, strict=True):
        if isinstance(out, BaseException):
            if isinstance(out, asyncio.CancelledError):
                await asyncio.to_thread(close_all, [r[2] for r in running])
                raise out
            done[i] = episode.fail("env_error", out)
            await asyncio.to_thread(close_all, [env])
        elif out is None:   # paused between two turns
            try:
                new_state = await asyncio.to_thread(pause_env, env, job.memory_fork)
            except Exception as e:  # noqa: BLE001 - a pause that fails ends the episode as an env error
                done[i] = episode.fail("env_error", e)
            else:
                before = previous[i].resumes + 1 if i in previous else 0
                paused.append(Paused(i, episode.traj, episode.messages, episode.tools, new_state, before))
        else:
            done[i] = out
            await asyncio.to_thread(close_all, [env])
        if state:
            await asyncio.to_thread(drop, api, state)
    for t in done.values():
        t.metadata.update({k: v for k, v in meta.items() if k not in t.metadata})
        t.check()
    if paused:
        result.info.update(paused=paused, finished=list(done.values()))
        return result
    result.trajectories = [done[i] for i in range(g)]
    return result


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
        return self._running

    def unpause(self) -> None:
        self._pause = False

    def _make(self, env_id: str, kwargs: dict[str, Any]) -> Callable[[], Any]:
        def make() -> Any:
            import gymnasium

            import envs  # noqa: F401  (registers the env ids)

            return gymnasium.make(env_id, api=self.api, **kwargs)
        return make

    async def run_group(self, spec: GroupSpec) -> GroupResult:
        job = spec.task
        if not isinstance(job, Job):
            return await super().run_group(spec)
        policy = self._policy_client()
        self._running += 1
        try:
            meta = {"worker": self.key, "node_id": self.node_id, "env_url": self.env_url}
            result = await play_group(self._make(job.env_id, job.env_kwargs), spec, job, policy, self.tokenizer,
                                      lambda: self._pause and job.phase == "train", self.api, meta,
                                      lambda: max(job.weight_version, self._version))
            result.info.update(worker=self.key)
            return result
        finally:
            self._running -= 1
            self.groups_done += 1


class LoopRollout(Rollout):
    """``Rollout`` with ``LoopWorker``s, and the pause / unpause of every worker."""

    worker_class = LoopWorker

    async def _each(self, method: str, *args: Any) -> None:
        for s in self.slots:
            if s.dead:
                continue
            if isinstance(s.handle, LoopWorker):
                getattr(s.handle, method)(*args)
            else:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(await_ref(getattr(s.handle, method).remote(*args)), 60)

    async def pause(self) -> None:
        """Every worker's running episodes stop after their current turn and come back paused."""
        await self._each("pause")

    async def unpause(self) -> None:
        await self._each("unpause")

    async def set_version(self, version: int) -> None:
        """Tell every worker the loop's weight version now (after a push returned)."""
        await self._each("set_version", version)
