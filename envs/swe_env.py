"""SWEEnv (``agentenv/SWE-v0``): a coding agent fixes a repository in a sandbox; graded like SWE-bench.

``reset(options={"task": ...})`` starts a sandbox of the task's image with the repository at its
base commit; the observation is the problem statement and the tool list. Each step is one tool call
(``bash``, ``view``, ``str_replace``, ``create``, ``submit``; see ``envs.tools``) as K3 tool-call
text or a dict; the observation is the tool's output. ``submit`` (or the last allowed step) grades:
reward 1.0 when every FAIL_TO_PASS test passes and every PASS_TO_PASS test still passes, else 0.0;
``info`` then carries the per-test results and the model's patch.

``snapshot()``, ``fork(n)`` and ``restore(snap)`` branch an episode (the step count goes along).
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from typing import Any

import gymnasium as gym
from gymnasium import spaces

import agentenv
from agentenv.errors import AgentEnvError
from agentenv.sandbox import Sandbox
from agentenv.store import Snapshot
from envs.grading import GradeResult, grade
from envs.task import Task, TaskError, resolve_task, shipped_tasks
from envs.tools import SWETools, describe_tools

MAX_OBSERVATION = 65_536
MAX_ACTION = 65_536
SAMPLE_CHARSET = "".join(chr(c) for c in range(32, 127)) + "\n\t"


class UnicodeText(spaces.Text):
    """Text of any Unicode characters up to ``max_length`` (samples use printable ASCII).

    Code and tool output are not ASCII; ``spaces.Text`` with a fixed charset would reject them.
    """

    def __init__(self, max_length: int, *, min_length: int = 0, seed: int | None = None) -> None:
        super().__init__(max_length=max_length, min_length=min_length, charset=SAMPLE_CHARSET, seed=seed)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length

    def __repr__(self) -> str:
        return f"UnicodeText({self.min_length}, {self.max_length})"


class SetupError(AgentEnvError):
    """A task's sandbox could not be brought to its base commit."""


def start_task_sandbox(task: Task, api: Any = agentenv, **sandbox_kwargs: Any) -> Sandbox:
    """A sandbox of ``task.image`` with /testbed at the task's base commit (the image is never rebuilt).

    ``api`` is ``agentenv`` itself or a remote one (``agentenv.connect(...)``, ``agentenv.Pool``).
    """
    kwargs = {"cpus": 1.0, "memory": "2g", **sandbox_kwargs}
    sb: Sandbox = api.Sandbox.create(task.image, labels={"agentenv.task": task.instance_id}, **kwargs)
    try:
        commands = list(task.setup_commands) or [
            f"git checkout -q -f {shlex.quote(task.base_commit)} && git clean -fdq"]
        for cmd in commands:
            r = sb.exec(cmd, timeout=300, cwd="/testbed")
            if r.exit_code != 0:
                raise SetupError(f"task {task.instance_id}: setup command failed ({r.exit_code}): "
                                 f"{(r.stdout + r.stderr).strip()[-600:]}", fix="check the task's image and setup")
        head = sb.exec("git rev-parse HEAD", timeout=60, cwd="/testbed").stdout.strip()
        if not head.startswith(task.base_commit):
            raise SetupError(f"task {task.instance_id}: /testbed is at {head or 'no commit'}, not the base "
                             f"commit {task.base_commit}", fix="rebuild the image (python -m envs.tasks images)")
    except BaseException:
        sb.close()
        raise
    return sb


def first_observation(task: Task, tools: list[dict[str, Any]]) -> str:
    return (f"You are working in a git repository at /testbed ({task.repo}). Solve this issue:\n\n"
            f"<issue>\n{task.problem_statement.strip()}\n</issue>\n\n"
            f"Edit the source files so the issue is fixed. Tools:\n{describe_tools(tools)}\n"
            "Call submit when you are done.")


class SWEEnv(gym.Env[str, Any]):
    """One task per episode in its own sandbox; actions are tool calls, reward comes from grading."""

    metadata = {"render_modes": ["ansi"], "render_fps": 1}

    def __init__(self, task: Task | str | Mapping[str, Any] | None = None,
                 tasks: Sequence[Task | str] | None = None, max_steps: int = 50, max_output: int = 10_000,
                 bash_timeout: float = 60.0, test_timeout: float = 900.0, render_mode: str | None = None,
                 api: Any = None, **sandbox_kwargs: Any) -> None:
        self.api = api if api is not None else agentenv  # or a remote client / Pool: the same calls
        self.observation_space = UnicodeText(MAX_OBSERVATION)
        self.action_space = UnicodeText(MAX_ACTION, min_length=1)
        self.render_mode = render_mode
        self.max_steps, self.max_output = max_steps, max_output
        self.bash_timeout, self.test_timeout = bash_timeout, test_timeout
        self._sandbox_kwargs = sandbox_kwargs
        self._default: Task | None = resolve_task(task) if task is not None else None
        self._pool: list[Task] | None = [resolve_task(t) for t in tasks] if tasks is not None else None
        self.task: Task | None = None
        self.sandbox: Sandbox | None = None
        self.tools: SWETools | None = None
        self.steps = 0
        self.done = False
        self.last_grade: GradeResult | None = None
        self._last = ""

    # --- episode ----------------------------------------------------------------------------------

    def _pick(self, options: Mapping[str, Any]) -> Task:
        if options.get("task") is not None:
            return resolve_task(options["task"])
        if self._default is not None:
            return self._default
        if self._pool is None:
            self._pool = shipped_tasks()
        pool = self._pool
        if not pool:
            raise TaskError("no task given and the task pool is empty")
        return pool[int(self.np_random.integers(len(pool)))]

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """A fresh sandbox at the task's base commit (``options``: ``task``, or ``snapshot`` to restore)."""
        super().reset(seed=seed)
        opts = options or {}
        if opts.get("snapshot") is not None:
            return self.restore(opts["snapshot"]), self._info()
        task = self._pick(opts)
        self._close_sandbox()
        self._attach(start_task_sandbox(task, self.api, **self._sandbox_kwargs), task, steps=0)
        self._last = first_observation(task, SWETools.tools)
        return self._last, self._info()

    def _attach(self, sandbox: Sandbox, task: Task, steps: int) -> None:
        self.sandbox, self.task, self.steps, self.done, self.last_grade = sandbox, task, steps, False, None
        self.tools = SWETools(sandbox, max_output=self.max_output, default_timeout=self.bash_timeout)

    def _info(self) -> dict[str, Any]:
        return {"task": self.task.instance_id if self.task else None, "steps": self.steps}

    def step(self, action: Any) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.sandbox is None or self.tools is None or self.task is None:
            raise RuntimeError("call reset() before step()")
        if self.done:
            return "The episode is over; call reset().", 0.0, True, False, {**self._info(), "error": True}
        call, out = self.tools.run(action)
        self.steps += 1
        info = {**self._info(), "tool": call.name if call else None, "error": out.error}
        obs, reward, terminated = out.text, 0.0, False
        truncated = self.steps >= self.max_steps and not out.submitted
        if out.submitted or truncated:
            result = self.grade()
            reward, terminated, self.done = result.reward, out.submitted, True
            info.update(result.to_info())
            verdict = "resolved" if result.resolved else "not resolved"
            obs = (obs if out.submitted else obs + "\n[step limit reached; graded]") + f"\nGraded: {verdict}."
        self._last = obs
        return obs, reward, terminated, truncated, info

    def grade(self) -> GradeResult:
        """Grade /testbed now (SWE-bench rules); the episode's sandbox is left graded."""
        if self.sandbox is None or self.task is None:
            raise RuntimeError("call reset() before grade()")
        self.last_grade = grade(self.sandbox, self.task, timeout=self.test_timeout)
        return self.last_grade

    # --- branching --------------------------------------------------------------------------------

    def snapshot(self, memory: bool = False) -> Snapshot:
        """The sandbox's files (and with ``memory=True`` its processes), labelled with the task and step."""
        if self.sandbox is None or self.task is None:
            raise RuntimeError("call reset() before snapshot()")
        return self.sandbox.snapshot(memory=memory, labels={"agentenv.task": self.task.instance_id,
                                                            "agentenv.steps": str(self.steps)})

    def fork(self, n: int, memory: bool = False) -> list[SWEEnv]:
        """``n`` independent envs continuing this episode from now (each owns a branched sandbox).

        An SWE episode keeps its state in files, so by default the children start from a filesystem
        snapshot (no CRIU dump); ``memory=True`` forks every process too.
        """
        if self.sandbox is None or self.task is None:
            raise RuntimeError("call reset() before fork()")
        boxes = self.sandbox.fork(n, memory=memory)
        kids = []
        for sb in boxes:
            env = self._clone()
            env._attach(sb, self.task, self.steps)
            env._last = self._last
            kids.append(env)
        return kids

    def restore(self, snapshot: Snapshot | str) -> str:
        """Continue from a snapshot taken with ``snapshot()`` (this env's sandbox is replaced)."""
        snap = self.api.Snapshot.get(snapshot) if isinstance(snapshot, str) else snapshot
        tid = snap.labels.get("agentenv.task")
        task = self.task if self.task and self.task.instance_id == tid else resolve_task(tid) if tid else self.task
        if task is None:
            raise TaskError(f"snapshot {snap.id} names no task; reset() with a task first")
        self._close_sandbox()
        self._attach(self.api.Sandbox.restore(snap, labels={"agentenv.task": task.instance_id}), task,
                     int(snap.labels.get("agentenv.steps", "0")))
        self._last = f"Restored snapshot {snap.id} of task {task.instance_id} at step {self.steps}."
        return self._last

    def _clone(self) -> SWEEnv:
        env = SWEEnv(task=self._default, tasks=self._pool, max_steps=self.max_steps, max_output=self.max_output,
                     bash_timeout=self.bash_timeout, test_timeout=self.test_timeout, render_mode=self.render_mode,
                     api=self.api, **self._sandbox_kwargs)
        return env

    # --- the rest ---------------------------------------------------------------------------------

    def render(self) -> str | None:
        return self._last if self.render_mode == "ansi" else None

    def _close_sandbox(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()
            self.sandbox, self.tools = None, None

    def close(self) -> None:
        self._close_sandbox()
        super().close()
