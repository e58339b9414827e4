"""GRPO groups forked from one identical state: the one group player, of ``agentenv rollout`` and ``agentenv train``.

A group of ``G`` episodes of one task starts from one reset: the task is set up once (image, setup commands,
any long-running process the task starts), then ``env.fork(G)`` gives ``G`` children that continue from a
byte-identical state — the sandbox's files (the default), or its files and every process (``memory=True``,
a CRIU fork). Each child plays an episode from the parent's reset observation (``first_observation``), so the
group's trajectories share their group id and their prompt token ids. The usual way — ``G`` independent
resets — hopes that setup is deterministic; a fork makes it so.

An env that has not started its sandbox at reset (``lazy_sandbox``: Tool-v0 starts one only when a tool needs
it) has no state to fork: its children are fresh envs reset to the same task, which is the same state.

Faults: an episode that ends in ``env_error`` or ``policy_error`` is played again from a new fork of the parent
(the parent stays untouched until the group is over), at most ``max_retries`` times, then kept with its finish
reason (reward None). A reset that fails is retried the same way; when it keeps failing, every episode of the
group is recorded as ``env_error``. With ``G == 1`` the episode runs in the parent itself (no fork); a retry
resets again. When a policy call failed because the server is unreachable and a probe confirms it, nothing is
retried and the result says ``policy_down``. The parent and every child are closed when the group ends, also
when it is cancelled.

**Pause and resume** (``Partial``; the training loop's partial rollouts, trainer/loop/rollouts.py). Between two turns
each episode asks ``should_pause()``; when it says so, the episode stops after its current turn and is paused
(rollout/pausing.py: its env's state to the snapshot store, its conversation kept). The group's result is then
not complete: ``info["paused"]`` holds the paused episodes (``Paused``, by index) and ``info["finished"]`` the
group's episodes that are done; ``trajectories`` is empty. Played again with ``resume`` (and ``finished``), each
paused episode is restored from its state and goes on from its conversation (a play of it that fails on
infrastructure is retried from the same state); the group is complete when all ``G`` episodes are.
``metadata["resumes"]`` counts an episode's pauses. The snapshot a resumed episode was restored from is deleted
once the episode is done or paused again, unless ``keep_resumed`` (the training loop's checkpoints may name it).
``served_version()``, read before each request, is the weight version of a turn whose answer reports none.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import gymnasium as gym

from envs.protocol import GymEnv, unwrap
from policy.client import PolicyClient, PolicyError
from rollout.agent import AgentConfig, Episode, Tokenizer, begin, play
from rollout.pausing import Partial, Paused, drop_snapshot, pause_env, restore_env
from rollout.trajectory import Trajectory

if TYPE_CHECKING:
    from rollout.harnesses import HarnessDriver

T = TypeVar("T")
UNREACHABLE = ("PolicyUnreachable", "PolicyTimeout")  # policy_error texts that may mean the server is gone


@dataclass(frozen=True)
class GroupSpec:
    """One group to play: the task (a record, an id, or None for the env's own draw), the group's size and id."""

    group_id: str
    task: Any = None
    task_id: str = ""
    group_size: int = 1
    seed: int | None = None
    index: int = 0                  # the group's position in its run
    attempt: int = 1                # 2, 3, ...: the group is played again (its worker died); counts toward retries


@dataclass
class GroupResult:
    """The group's trajectories (one per index, in order) and how it went."""

    spec: GroupSpec
    trajectories: list[Trajectory]
    attempts: int = 1               # plays of the most-tried episode (1: none was retried)
    reset_s: float = 0.0
    fork_s: float = 0.0
    policy_down: bool = False       # a policy call failed and the server did not answer a probe
    error: str = ""                 # the last infrastructure error, if any
    info: dict[str, Any] = field(default_factory=dict)
    branches: list[Trajectory] = field(default_factory=list)   # a harness's other branches (rollout.harnesses)

    @property
    def rewards(self) -> list[float | None]:
        return [t.reward for t in self.trajectories]


class _Timed:
    """An env seen through the agent loop, noting when its first step (the first tool call) began."""

    def __init__(self, env: GymEnv) -> None:
        self.env = env
        self.first_step_at: float | None = None

    @property
    def unwrapped(self) -> gym.Env[Any, Any]:
        return self.env.unwrapped

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        return self.env.reset(seed=seed, options=options)

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        if self.first_step_at is None:
            self.first_step_at = time.time()
        return self.env.step(action)

    def close(self) -> None:
        self.env.close()


async def _settled(fut: Awaitable[T], cleanup: Callable[[T], object] | None = None) -> T:
    """Await work running in a thread; if we are cancelled meanwhile, let it finish first and hand what it
    made to ``cleanup`` (so nothing it started is left open), then pass the cancellation on."""
    task = asyncio.ensure_future(fut)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        with contextlib.suppress(BaseException):
            made = await task
            if cleanup is not None:
                await asyncio.to_thread(cleanup, made)
        raise


def close_all(envs: Sequence[GymEnv]) -> None:
    for env in envs:
        with contextlib.suppress(Exception):
            env.close()


def failed(spec: GroupSpec, reason: str, error: str, env_id: str = "", index: int | None = None) -> Trajectory:
    """An episode that could not be played: its finish reason, no reward, the error."""
    t = Trajectory(task_id=spec.task_id, env_id=env_id, group_id=spec.group_id,
                   group_index=spec.index if index is None else index, seed=spec.seed)
    t.finish_reason, t.reward, t.error = reason, None, error[:2000]
    return t


def branch(parent: GymEnv, n: int, memory: bool, make_env: Callable[[], GymEnv], seed: int | None) -> list[GymEnv]:
    """``n`` envs continuing the parent's reset state: ``fork(n)`` of its sandbox, or, for an env that has no
    sandbox yet (lazy), ``n`` fresh envs reset to the same task."""
    base = unwrap(parent)
    if base.lazy_sandbox and base.sandbox is None:
        kids: list[GymEnv] = []
        try:
            for _ in range(n):
                kid = make_env()
                kids.append(kid)
                kid.reset(seed=seed, options={"task": base.task})
        except BaseException:
            close_all(kids)
            raise
        return kids
    return list(base.fork(n, memory=memory))


async def policy_alive(policy: PolicyClient, timeout: float = 15.0) -> bool:
    """Whether the policy server answers ``GET /v1/models`` within ``timeout`` seconds."""
    try:
        await asyncio.wait_for(policy.models(), timeout)
    except (PolicyError, TimeoutError):
        return False
    return True


async def run_group(make_env: Callable[[], GymEnv], spec: GroupSpec, policy: PolicyClient, tokenizer: Tokenizer,
                    config: AgentConfig | None = None, *, memory: bool = False, env_id: str = "",
                    max_retries: int = 2, keep_messages: bool = False, metadata: dict[str, Any] | None = None,
                    partial: Partial | None = None, harness: HarnessDriver | None = None) -> GroupResult:
    """Play the group ``spec`` (see the module docstring): ``make_env()`` makes one env of the task's kind; a result
    with ``info["paused"]`` is not complete yet. ``harness``: each episode is played by an agent harness through the
    LLM gateway (``rollout.harnesses``) instead of the agent loop; its episodes run to their end (no pause)."""
    if spec.group_size < 1:
        raise ValueError(f"group_size must be at least 1, got {spec.group_size}")
    group = _Group(make_env, spec, policy, tokenizer, config or AgentConfig(), memory, env_id, max_retries,
                   keep_messages, dict(metadata or {}), partial or Partial(), harness)
    return await group.play()


@dataclass
class _Play:
    """One play of one episode: from the parent's reset (``resumed`` None) or from its paused state."""

    index: int
    episode: Episode
    env: _Timed
    resumed: Paused | None
    start: float = 0.0


@dataclass
class _Group:
    """A group being played: its episodes done, paused and tried so far, and the parent's reset."""

    make_env: Callable[[], GymEnv]
    spec: GroupSpec
    policy: PolicyClient
    tokenizer: Tokenizer
    config: AgentConfig
    memory: bool
    env_id: str
    max_retries: int
    keep_messages: bool
    meta: dict[str, Any]
    partial: Partial
    harness: HarnessDriver | None = None
    parent: GymEnv | None = None
    first: str = ""
    opened: list[GymEnv] = field(default_factory=list)    # envs of this round not closed yet

    def __post_init__(self) -> None:
        spec = self.spec
        self.result = GroupResult(spec, [], attempts=0)
        self.side: dict[int, list[Trajectory]] = {}   # a harness episode's other branches, by index
        self.done = {t.group_index: t for t in self.partial.finished}
        self.paused: dict[int, Paused] = {}
        self.resuming = {p.index: p for p in self.partial.resume}
        self.tries = dict.fromkeys(range(spec.group_size), spec.attempt - 1)  # plays so far (earlier attempts too)
        self.group_start, self.task_id = time.time(), spec.task_id
        if self.resuming:
            for t in self.done.values():  # they waited for the group's paused episodes: the same staleness allowance
                t.metadata["resumes"] = int(t.metadata.get("resumes", 0) or 0) + 1

    async def play(self) -> GroupResult:
        g = self.spec.group_size
        try:
            while pending := [i for i in range(g) if i not in self.done and i not in self.paused]:
                plays = [p for i in pending if i in self.resuming and (p := await self._resume(i)) is not None]
                fresh = [i for i in pending if i not in self.resuming]
                plays += await self._branch(fresh) if fresh else []
                if plays:
                    await self._round(plays)
        finally:
            await asyncio.to_thread(close_all, self.opened + ([self.parent] if self.parent is not None else []))
            self.opened, self.parent = [], None
        self.result.attempts = max(self.tries.values())
        if self.paused:
            self.result.info.update(paused=[self.paused[i] for i in sorted(self.paused)],
                                    finished=[self.done[i] for i in sorted(self.done)])
        else:
            self.result.trajectories = [self.done[i] for i in range(g)]
            self.result.branches = [t for i in sorted(self.side) if i in self.done for t in self.side[i]]
        return self.result

    # --- the envs the pending episodes play in ---------------------------------------------------------------

    async def _resume(self, i: int) -> _Play | None:
        """A paused episode restored from its state (None: the restore failed, counted as a play)."""
        paused = self.resuming[i]
        try:
            env = await _settled(asyncio.to_thread(restore_env, self.make_env, paused.env_state, self.spec.seed),
                                 lambda env: close_all([env]))
        except Exception as e:  # noqa: BLE001 - the episode's result, retried
            await self._not_started(i, f"resume: {type(e).__name__}: {e}")
            return None
        self.opened.append(env)
        episode = paused.episode(self.tokenizer)
        episode.traj.metadata["resumes"] = paused.resumes + 1
        return _Play(i, episode, _Timed(env), paused)

    async def _branch(self, fresh: list[int]) -> list[_Play]:
        """The fresh episodes' envs: the parent's reset (made once, again for a lone episode), then its branches."""
        spec = self.spec
        if self.parent is None:
            t0 = time.perf_counter()
            opts = None if spec.task is None else {"task": spec.task}
            try:
                self.parent = await _settled(asyncio.to_thread(self.make_env), lambda env: close_all([env]))
                obs, info = await _settled(asyncio.to_thread(self.parent.reset, seed=spec.seed, options=opts))
            except Exception as e:  # noqa: BLE001 - every fresh episode failed to start: retried
                if self.parent is not None:
                    await asyncio.to_thread(close_all, [self.parent])
                    self.parent = None
                for i in fresh:
                    await self._not_started(i, f"reset: {type(e).__name__}: {e}")
                return []
            self.result.reset_s += time.perf_counter() - t0
            self.first, self.task_id = str(obs), str(info.get("task") or spec.task_id)
        t0 = time.perf_counter()
        if spec.group_size == 1:
            kids, self.parent, fork_s = [self.parent], None, 0.0   # a lone episode plays in the parent itself
        else:
            try:
                kids = await _settled(asyncio.to_thread(branch, self.parent, len(fresh), self.memory, self.make_env,
                                                        spec.seed), close_all)
            except Exception as e:  # noqa: BLE001 - every fresh episode failed to start: retried
                for i in fresh:
                    await self._not_started(i, f"fork: {type(e).__name__}: {e}")
                return []
            fork_s = time.perf_counter() - t0
            self.result.fork_s += fork_s
        self.opened.extend(kids)
        plays = []
        for i, kid in zip(fresh, kids, strict=True):
            traj = Trajectory(task_id=self.task_id, env_id=self.env_id, seed=spec.seed, group_id=spec.group_id,
                              group_index=i)
            traj.fork_s = fork_s / len(kids)
            timed = _Timed(kid)
            plays.append(_Play(i, await begin(timed, self.tokenizer, self.config, traj, self.first, None,
                                              self.keep_messages), timed, None))
        return plays

    async def _not_started(self, i: int, error: str) -> None:
        """Episode ``i`` could not start (reset, fork or restore failed): counted as a play, recorded at the last."""
        self.result.error = error
        self.tries[i] += 1
        if self.tries[i] <= self.max_retries:
            return
        paused = self.resuming.get(i)
        if paused is None:
            t = failed(self.spec, "env_error", error, self.env_id, i)
        else:
            t = paused.episode(self.tokenizer).traj
            t.finish_reason, t.reward, t.error = "env_error", None, error[:2000]
            t.metadata["resumes"] = paused.resumes + 1
            await self._drop(paused)
        t.metadata.update({k: v for k, v in self.meta.items() if k not in t.metadata}, attempt=self.tries[i])
        self.done[i] = t.check()

    # --- one round: the started episodes play until each is done, paused or failed ---------------------------

    async def _round(self, plays: list[_Play]) -> None:
        for one in plays:
            one.start = time.time()
        outcomes = await asyncio.gather(*(self._drive(one) for one in plays), return_exceptions=True)
        ended: list[tuple[_Play, Trajectory]] = []
        for one, out in zip(plays, outcomes, strict=True):
            if isinstance(out, asyncio.CancelledError):
                raise out
            if isinstance(out, BaseException):
                ended.append((one, one.episode.fail("env_error", out)))
            elif out is not None:
                ended.append((one, out))
            elif (failure := await self._pause(one)) is not None:
                ended.append((one, failure))
        closing = [one.env.env for one, _ in ended if one.env.env in self.opened]
        self.opened = [env for env in self.opened if env not in closing]
        await asyncio.to_thread(close_all, closing)
        down = False
        if any(t.finish_reason == "policy_error" and t.error.startswith(UNREACHABLE) for _, t in ended):
            down = not await policy_alive(self.policy)
            self.result.policy_down = self.result.policy_down or down
        for one, t in ended:
            i = one.index
            self.tries[i] += 1
            self._stamp(one, t, self.tries[i])
            if t.infra_error:
                self.result.error = t.error
            if not t.infra_error or self.tries[i] > self.max_retries or down:
                self.done[i] = t.check()
                if one.resumed is not None:
                    await self._drop(one.resumed)

    async def _drive(self, one: _Play) -> Trajectory | None:
        """One play: the agent loop (None: paused between two turns), or the harness, to the episode's end."""
        if self.harness is None:
            p = self.partial
            return await play(one.episode, one.env, self.policy, self.config, p.should_pause, p.served_version)
        main, others = await self.harness.play(one.env, self.first, one.episode.traj)
        self.side[one.index] = others      # a play again (after an infrastructure error) replaces them
        return main

    async def _pause(self, one: _Play) -> Trajectory | None:
        """Pause an episode between two turns (its env to the store, then closed); a pause that fails ends the
        play as an env error (returned)."""
        env = one.env.env
        self.opened.remove(env)
        try:
            state = await _settled(asyncio.to_thread(pause_env, env, self.memory))
        except Exception as e:  # noqa: BLE001 - the play's result
            return one.episode.fail("env_error", e)
        ep = one.episode
        self._stamp(one, ep.traj, self.tries[one.index] + 1)
        before = one.resumed.resumes + 1 if one.resumed is not None else 0
        self.paused[one.index] = Paused(one.index, ep.traj, ep.messages, ep.tools, state, before)
        if one.resumed is not None:
            await self._drop(one.resumed)
        return None

    def _stamp(self, one: _Play, t: Trajectory, attempt: int) -> None:
        """The play's metadata: the caller's, the group's timings, this attempt; a resumed episode keeps what its
        first play recorded."""
        stamps = {**self.meta, "group_start": self.group_start, "episode_start": one.start,
                  "first_step_at": one.env.first_step_at, "reset_s": self.result.reset_s}
        if one.resumed is None:
            t.metadata.update(stamps)
            t.metadata.setdefault("resumes", 0)
        else:
            t.metadata.update({k: v for k, v in stamps.items() if k not in t.metadata})
        t.metadata["attempt"] = attempt

    async def _drop(self, paused: Paused) -> None:
        if not self.partial.keep_resumed:
            await asyncio.to_thread(drop_snapshot, self.partial.store, paused.env_state)
