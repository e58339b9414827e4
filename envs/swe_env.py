"""SWEEnv (``agentenv/SWE-v0``): a coding agent fixes a repository in a sandbox; graded like SWE-bench.

``reset(options={"task": ...})`` starts a sandbox of the task's image with the repository at its
base commit; the observation is the problem statement and the tool list. Each step is one action
(K3 tool-call text or a dict) holding one or more tool calls (``bash``, ``view``, ``str_replace``,
``create``, ``submit``; see ``envs.tools``), run in order; the observation is their output.
``submit`` (or the last allowed step) grades: reward 1.0 when every FAIL_TO_PASS test passes and every
PASS_TO_PASS test still passes, else 0.0; ``info`` then carries the per-test results and the model's patch.

``snapshot()``, ``fork(n)`` and ``restore(snap)`` branch an episode (the step count goes along).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from agentenv.api import Backend, SandboxLike
from envs.base import SandboxEnv
from envs.grading import GradeResult, grade
from envs.spaces import MAX_ACTION, MAX_OBSERVATION, UnicodeText
from envs.task import Task, TaskError, resolve_task, shipped_tasks
from envs.task_sandbox import start_task_sandbox
from envs.tools import BashTool, FileTools, SubmitTool, Toolbox

DEFAULT_MAX_STEPS = 50  # also the step limit it is registered with (envs/__init__.py)


class SWEEnv(SandboxEnv[Task]):
    """One task per episode in its own sandbox; actions are tool calls, reward comes from grading."""

    def __init__(self, task: Task | str | Mapping[str, Any] | None = None,
                 tasks: Sequence[Task | str] | None = None, max_steps: int | None = DEFAULT_MAX_STEPS, max_output: int = 10_000,
                 bash_timeout: float = 60.0, test_timeout: float = 900.0, render_mode: str | None = None,
                 api: Backend | None = None, **sandbox_kwargs: Any) -> None:
        super().__init__(api=api, max_steps=max_steps, render_mode=render_mode, sandbox_kwargs=sandbox_kwargs)
        self.observation_space = UnicodeText(MAX_OBSERVATION)
        self.action_space = UnicodeText(MAX_ACTION, min_length=1)
        self.max_output, self.bash_timeout, self.test_timeout = max_output, bash_timeout, test_timeout
        self._default: Task | None = resolve_task(task) if task is not None else None
        self._pool: list[Task] | None = [resolve_task(t) for t in tasks] if tasks is not None else None

    def _resolve_task(self, ref: Any) -> Task:
        if isinstance(ref, str):  # an id: this env's own tasks first (a snapshot label names one)
            own = [t for t in (self._default, *(self._pool or ())) if t is not None and t.instance_id == ref]
            return own[0] if own else resolve_task(ref)
        if ref is not None:
            return resolve_task(ref)
        if self._default is not None:
            return self._default
        if self._pool is None:
            self._pool = shipped_tasks()
        if not self._pool:
            raise TaskError("no task given and the task pool is empty")
        return self._pool[int(self.np_random.integers(len(self._pool)))]

    def _task_id(self, task: Task) -> str:
        return task.instance_id

    def _start_sandbox(self, task: Task) -> SandboxLike:
        return start_task_sandbox(task, self.api, **self.sandbox_kwargs)

    def _make_toolbox(self) -> Toolbox:
        return Toolbox(BashTool(self.box, timeout=self.bash_timeout), FileTools(self.box), SubmitTool(),
                       max_output=self.max_output)

    def _first_observation(self, task: Task) -> str:
        return (f"You are working in a git repository at /testbed ({task.repo}). Solve this issue:\n\n"
                f"<issue>\n{task.problem_statement.strip()}\n</issue>\n\n"
                f"Edit the source files so the issue is fixed. Tools:\n{self.toolbox.describe()}\n"
                "Call submit when you are done.")

    def _info(self) -> dict[str, Any]:
        return {"task": self.task.instance_id if self.task else None, "steps": self.steps}

    def _act(self, action: Any) -> tuple[str, float, bool, dict[str, Any]]:
        turn = self.toolbox.run(action)
        info = {**self._info(), **turn.info()}
        submitted = turn.ending is not None
        if not (submitted or self.at_step_limit):
            return turn.text, 0.0, False, info
        result = self.grade()
        info.update(result.to_info())
        ending = "" if submitted else "\n[step limit reached; graded]"
        verdict = "resolved" if result.resolved else "not resolved"
        return f"{turn.text}{ending}\nGraded: {verdict}.", result.reward, submitted, info

    def grade(self) -> GradeResult:
        """Grade /testbed now (SWE-bench rules); the episode's sandbox is left graded."""
        sandbox = self.box()
        assert self.task is not None  # box() checked
        return grade(sandbox, self.task, timeout=self.test_timeout)
