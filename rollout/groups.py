"""GRPO groups forked from one identical state.

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
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from policy.client import PolicyClient, PolicyError
from rollout.agent import AgentConfig, Tokenizer, run_episode
from rollout.trajectory import Trajectory

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

    @property
    def rewards(self) -> list[float | None]:
        return [t.reward for t in self.trajectories]


class _Timed:
    """An env seen through the agent loop, noting when its first step (the first tool call) began."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.first_step_at: float | None = None

    @property
    def unwrapped(self) -> Any:
        return getattr(self.env, "unwrapped", self.env)

    def reset(self, **kw: Any) -> Any:
        return self.env.reset(**kw)

    def step(self, action: Any) -> Any:
        if self.first_step_at is None:
            self.first_step_at = time.time()
        return self.env.step(action)


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


def close_all(envs: list[Any]) -> None:
    for env in envs:
        with contextlib.suppress(Exception):
            env.close()


def failed(spec: GroupSpec, reason: str, error: str, env_id: str = "", index: int | None = None) -> Trajectory:
    """An episode that could not be played: its finish reason, no reward, the error."""
    t = Trajectory(task_id=spec.task_id, env_id=env_id, group_id=spec.group_id,
                   group_index=spec.index if index is None else index, seed=spec.seed)
    t.finish_reason, t.reward, t.error = reason, None, error[:2000]
    return t


def branch(parent: Any, n: int, memory: bool, make_env: Callable[[], Any], seed: int | None) -> list[Any]:
    """``n`` envs continuing the parent's reset state: ``fork(n)`` of its sandbox, or, for an env that has no
    sandbox yet (lazy), ``n`` fresh envs reset to the same task."""
    base = getattr(parent, "unwrapped", parent)
    if getattr(base, "lazy_sandbox", False) and getattr(base, "sandbox", None) is None:
        kids: list[Any] = []
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


async def run_group(make_env: Callable[[], Any], spec: GroupSpec, policy: PolicyClient, tokenizer: Tokenizer,
                    config: AgentConfig | None = None, *, memory: bool = False, env_id: str = "",
                    max_retries: int = 2, keep_messages: bool = False,
                    metadata: dict[str, Any] | None = None) -> GroupResult:
    """Play the group ``spec`` (see the module docstring): ``make_env()`` makes one env of the task's kind."""
    config = config or AgentConfig()
    if spec.group_size < 1:
        raise ValueError(f"group_size must be at least 1, got {spec.group_size}")
    g, result = spec.group_size, GroupResult(spec, [], attempts=0)
    done: dict[int, Trajectory] = {}
    tries = dict.fromkeys(range(g), spec.attempt - 1)  # plays of each episode so far (earlier attempts too)
    group_start = time.time()
    opts = None if spec.task is None else {"task": spec.task}
    parent: Any = None
    try:
        while len(done) < g:
            pending = [i for i in range(g) if i not in done]
            # --- the state to start from: the parent's reset (again, for a lone episode that is retried)
            if parent is None:
                t0 = time.perf_counter()
                try:
                    parent = await _settled(asyncio.to_thread(make_env), lambda env: close_all([env]))
                    obs, info = await _settled(asyncio.to_thread(parent.reset, seed=spec.seed, options=opts))
                except Exception as e:  # noqa: BLE001 - the group's result, retried below
                    result.error = f"reset: {type(e).__name__}: {e}"
                    if parent is not None:
                        await asyncio.to_thread(close_all, [parent])
                        parent = None
                    for i in pending:
                        tries[i] += 1
                        if tries[i] > max_retries:
                            done[i] = failed(spec, "env_error", result.error, env_id, i)
                    continue
                result.reset_s += time.perf_counter() - t0
                first, task_id = obs, str(info.get("task") or spec.task_id)
            # --- the envs the pending episodes run in
            t0 = time.perf_counter()
            if g == 1:
                kids, own = [parent], False  # a lone episode plays in the parent itself
            else:
                try:
                    kids = await _settled(asyncio.to_thread(branch, parent, len(pending), memory, make_env, spec.seed),
                                          close_all)
                except Exception as e:  # noqa: BLE001 - every pending episode failed to start: retried below
                    result.error = f"fork: {type(e).__name__}: {e}"
                    for i in pending:
                        tries[i] += 1
                        if tries[i] > max_retries:
                            done[i] = failed(spec, "env_error", result.error, env_id, i)
                    continue
                own = True
            fork_s = time.perf_counter() - t0 if own else 0.0
            result.fork_s += fork_s
            timed = [_Timed(k) for k in kids]
            try:
                starts = [time.time()] * len(timed)
                trajs = await asyncio.gather(*(
                    run_episode(env, policy, tokenizer, config, task_id=task_id, env_id=env_id,
                                first_observation=first, seed=spec.seed, group_id=spec.group_id, group_index=i,
                                keep_messages=keep_messages)
                    for i, env in zip(pending, timed, strict=True)))
            finally:
                await asyncio.to_thread(close_all, kids)
                if not own:
                    parent = None
            down = False
            if any(t.finish_reason == "policy_error" and t.error.startswith(UNREACHABLE) for t in trajs):
                down = not await policy_alive(policy)
                result.policy_down = result.policy_down or down
            for i, env, t, start in zip(pending, timed, trajs, starts, strict=True):
                tries[i] += 1
                t.fork_s = fork_s / len(kids)
                t.metadata.update(metadata or {})
                t.metadata.update(attempt=tries[i], group_start=group_start, episode_start=start,
                                  first_step_at=env.first_step_at, reset_s=result.reset_s)
                if t.infra_error:
                    result.error = t.error
                if not t.infra_error or tries[i] > max_retries or down:
                    done[i] = t
    finally:
        if parent is not None:
            await asyncio.to_thread(close_all, [parent])
    result.trajectories = [done[i] for i in range(g)]
    result.attempts = max(tries.values())
    return result
