"""SandboxEnv: the episode lifecycle of an env whose state lives in one sandbox, written once.

The base owns what every such env does the same way:

- ``api``: where sandboxes live — a ``Backend``: this host (the ``agentenv`` module; also for None), a
  server (``agentenv.connect(...)``) or several (``agentenv.Pool``);
- ``sandbox``: started at ``reset()`` (or on first use, ``box()``, when ``lazy_sandbox``), closed at the
  next reset and at ``close()``; made with ``share_memory=None`` unless the env's kwargs say otherwise, so the
  forks of a group or a search tree share the pages none of them wrote where the host can (KSM, fixed when the
  sandbox is made: ``agentenv.host.ksm``); ``share_memory=False`` (``--env-arg share_memory=false``, or
  ``[env] kwargs`` in a train config) opts out, True insists;
- the sandbox's deadline: ``ttl`` (``ENV_TTL`` unless the kwargs say otherwise; None: none), for the episode's
  sandbox, its forks and restores, and moved on from now as the episode steps (``_keep``), so that a slow CPU
  generation or a weight push between two steps never loses it, while one nobody closes goes in time. A
  rollout run sets its own (``rollout.ownership``);
- the guards: ``step()`` before ``reset()`` raises; a step after the episode ended says so and changes nothing;
- the step count and the step limit (below);
- ``snapshot()`` / ``fork(n)`` / ``restore(snapshot)``: a snapshot's labels carry the task and the step
  count (``agentenv.task``, ``agentenv.steps``), so any env of the same kind continues from it;
- the observation: fitted into ``observation_space`` (cut in the middle with a marker; see ``envs.spaces``),
  and kept for ``render()`` (``render_mode="ansi"``).

A subclass supplies the rest, top to bottom: its spaces and ``__init__``, then the hooks

    _resolve_task(ref)         the task of an episode: ``ref`` from ``reset(options={"task": ref})`` or a
                               snapshot's label; None: the env's default task, or a draw with ``np_random``
    _task_id(task)             the id a snapshot label keeps
    _start_sandbox(task)       a fresh sandbox for the task
    _start_episode(task)       (optional) the sandbox of a new episode and the task as it runs (default:
                               ``_start_sandbox``, or no sandbox yet when ``lazy_sandbox``)
    _task_labels(task)         (optional) more snapshot labels, e.g. where the task came from
    _snapshot_task(labels)     (optional) the task of a snapshot from its labels (default: ``_resolve_task``
                               of its task label)
    _forked(kid)               (optional) what a fork shares with its parent besides the settings
    _settle()                  (optional) finish background work on a new sandbox; every read of ``sandbox``
                               (so every tool, ``box()``, fork, snapshot and close) waits for it first
    _first_observation(task)   what the agent sees at reset
    _act(action)               one step: (observation, reward, terminated, info); ``self.steps`` already counts it
    _info()                    what the info of reset (and of a step after the end) holds
    _make_toolbox()            the env's tools (optional): ``self.toolbox`` is made from it on first use

The step limit. ``gymnasium.make`` wraps each registered env in Gymnasium's ``TimeLimit`` (the
``max_episode_steps`` it was registered with, see ``envs/__init__.py``), and the registration passes
the same number as the env's ``max_steps``. The env needs the number itself: it finishes the episode
on its last step (``SWEEnv`` grades there), and a fork or a restored env — an unwrapped env — keeps
counting from the step it continues. On that step it reports ``truncated`` as ``TimeLimit`` does, so an
env made directly stops at its ``max_steps`` too (by default the registered limit; ``None``: no limit). To change the limit of a made env, pass both: ``gymnasium.make(id, max_steps=N,
max_episode_steps=N)``.
"""

from __future__ import annotations

import copy
import time
from typing import Any, ClassVar, Generic, Self, TypeVar

import gymnasium as gym

import agentenv
from agentenv.api import Backend, SandboxLike, SnapshotLike
from envs.spaces import TextSpace
from envs.task import TaskError
from envs.tools import Toolbox

TASK_LABEL, STEPS_LABEL = "agentenv.task", "agentenv.steps"
SHARE_WHERE_POSSIBLE = None  # share_memory's default for an env's sandboxes (see the module doc)
ENV_TTL = 3600.0  # an episode sandbox's deadline in seconds, moved on as it steps (see the module doc)
OVER = "The episode is over; call reset()."

TaskT = TypeVar("TaskT")


class SandboxEnv(gym.Env[str, Any], Generic[TaskT]):
    """An episode of a task in one sandbox; subclasses supply the task, the tools and the reward."""

    metadata: dict[str, Any] = {"render_modes": ["ansi"], "render_fps": 1}
    workdir: str = "/"      # where the task's files are: a harness playing the episode starts there
    observation_space: TextSpace
    lazy_sandbox: ClassVar[bool] = False  # True: the sandbox starts when a tool first needs it, not at reset

    def __init__(self, *, api: Backend | None = None, max_steps: int | None = None, render_mode: str | None = None,
                 sandbox_kwargs: dict[str, Any] | None = None) -> None:
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps must be at least 1 (or None: no limit), got {max_steps}")
        self.api: Backend = agentenv if api is None else api
        self.max_steps, self.render_mode = max_steps, render_mode
        self.sandbox_kwargs = {"share_memory": SHARE_WHERE_POSSIBLE, "ttl": ENV_TTL, **(sandbox_kwargs or {})}
        self._kept_at = 0.0  # when the sandbox's deadline was last moved on (time.monotonic())
        self.task: TaskT | None = None
        self._sandbox: SandboxLike | None = None
        self.steps, self.done, self.last_observation = 0, False, ""
        self._started = False
        self._toolbox: Toolbox | None = None

    # --- what a subclass supplies -----------------------------------------------------------------

    def _resolve_task(self, ref: Any) -> TaskT:
        raise NotImplementedError

    def _task_id(self, task: TaskT) -> str:
        raise NotImplementedError

    def _start_sandbox(self, task: TaskT) -> SandboxLike:
        raise NotImplementedError

    def _first_observation(self, task: TaskT) -> str:
        raise NotImplementedError

    def _act(self, action: Any) -> tuple[str, float, bool, dict[str, Any]]:
        raise NotImplementedError

    def _start_episode(self, task: TaskT) -> tuple[SandboxLike | None, TaskT]:
        return (None if self.lazy_sandbox else self._start_sandbox(task)), task

    def _task_labels(self, task: TaskT) -> dict[str, str]:
        return {}

    def _snapshot_task(self, labels: dict[str, str]) -> TaskT:
        return self._resolve_task(labels.get(TASK_LABEL))

    def _forked(self, kid: Self) -> None:
        return None

    def _settle(self) -> None:
        """Finish what the env still does with a new sandbox in the background (nothing, by default)."""
        return None

    @property
    def sandbox(self) -> SandboxLike | None:
        """The episode's sandbox (None before reset, or before a lazy env's first tool needs it); reading it
        first lets the env finish any background work on it (``_settle``), so nothing reaches it before."""
        self._settle()
        return self._sandbox

    @sandbox.setter
    def sandbox(self, value: SandboxLike | None) -> None:
        self._sandbox = value

    def _info(self) -> dict[str, Any]:
        return {}

    def _make_toolbox(self) -> Toolbox:
        raise NotImplementedError(f"{type(self).__name__} has no tools")

    # --- the episode ------------------------------------------------------------------------------

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """A fresh episode (``options``: ``task``, or ``snapshot`` to continue from one)."""
        super().reset(seed=seed)
        opts = options or {}
        if opts.get("snapshot") is not None:
            self.restore(opts["snapshot"])
            return self.last_observation, self._info()
        task = self._resolve_task(opts.get("task"))
        self._end()
        sandbox, task = self._start_episode(task)
        self._begin(task, sandbox, steps=0)
        return self._observe(self._first_observation(task)), self._info()

    def step(self, action: Any) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if not self._started:
            raise RuntimeError("call reset() before step()")
        if self.done:
            return self._observe(OVER), 0.0, True, False, {**self._info(), "error": True}
        self.steps += 1
        self._keep()
        obs, reward, terminated, info = self._act(action)
        truncated = not terminated and self.at_step_limit
        self.done = terminated or truncated
        return self._observe(obs), reward, terminated, truncated, info

    @property
    def sandbox_ttl(self) -> float | None:
        """The deadline of the episode's sandboxes, in seconds (None: none)."""
        ttl = self.sandbox_kwargs.get("ttl")
        return None if ttl is None else float(ttl)

    def _keep(self) -> None:
        """Move the sandbox's deadline ``sandbox_ttl`` on from now, at most once a quarter of it (one call to the
        sandbox's server in a long episode): what the agent spent thinking since the last step never counts."""
        ttl, sandbox = self.sandbox_ttl, self._sandbox
        if ttl is not None and sandbox is not None and time.monotonic() - self._kept_at >= ttl / 4:
            sandbox.set_ttl(ttl)
            self._kept_at = time.monotonic()

    @property
    def at_step_limit(self) -> bool:
        """The step just taken is the last one allowed (``_act`` finishes the episode on it)."""
        return self.max_steps is not None and self.steps >= self.max_steps

    @property
    def toolbox(self) -> Toolbox:
        if self._toolbox is None:
            self._toolbox = self._make_toolbox()
        return self._toolbox

    def box(self) -> SandboxLike:
        """The episode's sandbox, started now if it has not been yet."""
        if not self._started or self.task is None:
            raise RuntimeError("call reset() first")
        if self.sandbox is None:
            self.sandbox = self._start_sandbox(self.task)
        return self.sandbox

    def _begin(self, task: TaskT, sandbox: SandboxLike | None, steps: int) -> None:
        self.task, self.sandbox, self.steps, self.done, self._started = task, sandbox, steps, False, True
        self._kept_at = time.monotonic()  # a new sandbox: its deadline is a whole ttl away

    def _observe(self, text: str) -> str:
        self.last_observation = self.observation_space.fit(text)
        return self.last_observation

    # --- branching --------------------------------------------------------------------------------

    def snapshot(self, memory: bool = False) -> SnapshotLike:
        """The sandbox's files (and with ``memory=True`` its processes), labelled with the task and the step."""
        sandbox = self.box()
        assert self.task is not None  # box() checked
        return sandbox.snapshot(memory=memory, labels={**self._task_labels(self.task),
                                                       TASK_LABEL: self._task_id(self.task),
                                                       STEPS_LABEL: str(self.steps)})

    def fork(self, n: int, memory: bool = False) -> list[Self]:
        """``n`` independent envs continuing this episode from now, each with its own branch of the sandbox.

        By default the children start from a filesystem snapshot (no CRIU dump); ``memory=True`` forks
        every process too.
        """
        boxes = self.box().fork(n, memory=memory, ttl=self.sandbox_ttl)
        kids = []
        for sandbox in boxes:
            kid = copy.copy(self)  # the same settings; what belongs to one episode is set below
            kid._np_random, kid._np_random_seed, kid._toolbox = None, None, None
            assert self.task is not None
            kid._begin(self.task, sandbox, self.steps)
            kid.done = self.done
            self._forked(kid)
            kids.append(kid)
        return kids

    def restore(self, snapshot: SnapshotLike | str) -> str:
        """Continue from a snapshot taken with ``snapshot()`` (this env's sandbox is replaced)."""
        snap = self.api.Snapshot.get(snapshot) if isinstance(snapshot, str) else snapshot
        ref = snap.labels.get(TASK_LABEL)
        same = ref is None or (self.task is not None and self._task_id(self.task) == ref)
        task = self.task if same else self._snapshot_task(dict(snap.labels))
        if task is None:
            raise TaskError(f"snapshot {snap.id} names no task; reset() with a task first")
        self._end()
        sandbox = self.api.Sandbox.restore(snap, labels={TASK_LABEL: self._task_id(task)}, ttl=self.sandbox_ttl)
        self._begin(task, sandbox, steps=int(snap.labels.get(STEPS_LABEL, "0")))
        return self._observe(f"Restored snapshot {snap.id} of task {self._task_id(task)} at step {self.steps}.")

    # --- the rest ---------------------------------------------------------------------------------

    def grade_submission(self, submission: str) -> tuple[float, dict[str, Any]]:
        """The reward of an episode a harness played in this env's sandbox (``rollout.harnesses``), from what it
        submitted and the sandbox as it left it, and the grader's details; graded on the host, never trusting the
        sandbox's own say. An env whose episodes end only through its own actions has no such grader."""
        raise NotImplementedError(f"{type(self).__name__} grades only its own actions; a harness episode needs an "
                                  "env with grade_submission (agentenv/Lookup-v0, agentenv/SWE-v0)")

    def render(self) -> str | None:  # render_mode "ansi": the last observation
        return self.last_observation if self.render_mode == "ansi" else None

    def _end(self) -> None:
        """Close the episode's sandbox; step() needs a reset() again."""
        self._started = False
        if self.sandbox is not None:
            sandbox, self.sandbox = self.sandbox, None
            sandbox.close()

    def close(self) -> None:
        self._end()
        super().close()
