"""SWEEnv (``agentenv/SWE-v0``): a coding agent fixes a repository in a sandbox; graded like SWE-bench.

Tasks come as ``tasks=`` (a list of Tasks, records or ids; a task file: JSONL, JSON or Parquet; or a
``datasets.Dataset``; ``dataset=`` names the dataset its records come from when their fields cannot tell, see
``envs.datasets``) or ``task=``. ``reset(options={"task": ...})`` starts a sandbox of the task's image (fetched
by its dataset's rule when the host lacks it: ``envs.task_sandbox.image_sandbox``) with the repository at its
base commit; the observation is the problem statement and the tool list. Each step is one action
(K3 tool-call text or a dict) holding one or more tool calls (``bash``, ``view``, ``str_replace``,
``create``, ``submit``; see ``envs.tools``), run in order; the observation is their output.
``submit`` (or the last allowed step) grades: reward 1.0 when every FAIL_TO_PASS test passes and every
PASS_TO_PASS test still passes, else 0.0; ``info`` then carries the per-test results, the agent's
patch and ``info["grading"]`` (what of the patch was not graded and why, a ``tampering`` flag).

Grading never runs in the agent's sandbox (see ``envs.grading``): at reset, once the task's sandbox
is set up and before the agent acts, the env takes a filesystem snapshot of it — the task's pristine
state (``Pristine``; taken on a worker thread while ``reset`` returns, and every read of ``env.sandbox``,
hence every tool call, waits for it) — and a grade restores a fresh sandbox from it, applies the agent's filtered
patch and runs the tests there. The snapshot is shared with the env's forks, kept while the env resets
to the same task (such a reset restores it instead of setting the task up again), and deleted when
the last env holding it closes or moves to another task. An env restored from a snapshot of another
task takes that task's pristine state at its first grade.

``snapshot()``, ``fork(n)`` and ``restore(snap)`` branch an episode (the step count goes along). A
snapshot names its task (and the task file it came from, when it came from one); a fresh env restores
it when it knows the task: one of its own (``task=``, ``tasks=``), one it ran before, a shipped one, or
one in the task file the snapshot names.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, wait
from pathlib import Path
from typing import Any

from agentenv.api import Backend, SandboxLike, SnapshotLike
from envs.base import TASK_LABEL, SandboxEnv
from envs.grading import GradeResult, grade
from envs.grading.workers import run_in_background
from envs.spaces import MAX_ACTION, MAX_OBSERVATION, UnicodeText
from envs.task import Task, TaskError, load_tasks, resolve_task, shipped_tasks
from envs.task_sandbox import start_task
from envs.tools import BashTool, FileTools, SubmitTool, Toolbox

DEFAULT_MAX_STEPS = 50  # also the step limit it is registered with (envs/__init__.py)
TASK_FILE_LABEL = "agentenv.task_file"
PRISTINE_LABEL = "agentenv.pristine"


class Pristine:
    """A task's sandbox as its setup left it, before any agent acted: the filesystem snapshot grading restores.

    ``task`` is the task as it runs (its base commit resolved); ``source`` the record it was made from.
    Held by an env and its forks; the snapshot is deleted when the last holder releases it.
    """

    def __init__(self, snapshot: SnapshotLike, task: Task, source: Task) -> None:
        self.snapshot, self.task, self.source = snapshot, task, source
        self._holders = 1
        self._lock = threading.Lock()

    def matches(self, task: Task) -> bool:
        return task == self.source or task == self.task

    def share(self) -> Pristine:
        with self._lock:
            if self._holders <= 0:
                raise RuntimeError("this pristine snapshot was already deleted")
            self._holders += 1
        return self

    def release(self) -> None:
        with self._lock:
            self._holders -= 1
            last = self._holders == 0
        if last:
            with contextlib.suppress(Exception):  # already gone (e.g. removed by `agentenv gc`): nothing to do
                self.snapshot.delete()

    @classmethod
    def take(cls, sandbox: SandboxLike, task: Task, source: Task) -> Pristine:
        """Snapshot ``sandbox`` (files only) as the pristine state of ``task``."""
        snap = sandbox.snapshot(memory=False, labels={PRISTINE_LABEL: "1", TASK_LABEL: task.instance_id})
        return cls(snap, task, source)


class SWEEnv(SandboxEnv[Task]):
    """One task per episode in its own sandbox; actions are tool calls, reward comes from grading."""

    workdir = "/testbed"

    def __init__(self, task: Task | str | Mapping[str, Any] | None = None,
                 tasks: Iterable[Task | str | Mapping[str, Any]] | str | os.PathLike[str] | None = None,
                 max_steps: int | None = DEFAULT_MAX_STEPS, max_output: int = 10_000,
                 bash_timeout: float = 60.0, test_timeout: float | None = None, render_mode: str | None = None,
                 api: Backend | None = None, dataset: str | None = None, trust_official_log: bool = False,
                 **sandbox_kwargs: Any) -> None:
        super().__init__(api=api, max_steps=max_steps, render_mode=render_mode, sandbox_kwargs=sandbox_kwargs)
        self.trust_official_log = trust_official_log  # envs.grading.grade: a forgeable reading may set the reward
        self.observation_space = UnicodeText(MAX_OBSERVATION)
        self.action_space = UnicodeText(MAX_ACTION, min_length=1)
        self.max_output, self.bash_timeout, self.test_timeout = max_output, bash_timeout, test_timeout
        self._known: dict[str, Task] = {}     # every task this env was given or ran, by id
        self._files: dict[str, str] = {}      # id -> the task file it came from
        self._pristine: Pristine | None = None
        self._closing: list[Future[None]] = []  # grading sandboxes being closed in the background
        self._taking: Future[Pristine] | None = None  # the pristine snapshot being taken after reset
        self._default: Task | None = self._remember(task) if task is not None else None
        self._pool: list[Task] | None = None
        if isinstance(tasks, str | os.PathLike):
            path = Path(tasks)
            if not path.exists():
                raise TaskError("tasks= takes a list of tasks, a datasets.Dataset, or the path of a task file "
                                "(JSONL, JSON or Parquet, or a folder of Parquet files)", where=str(path))
            self._pool = [self._remember(t, source=path) for t in load_tasks(path, dataset=dataset)]
        elif tasks is not None and type(tasks).__module__.startswith("datasets."):  # a Hugging Face dataset
            self._pool = [self._remember(t) for t in load_tasks(tasks, dataset=dataset)]
        elif tasks is not None:
            self._pool = [self._remember(t) for t in tasks]

    # --- tasks -----------------------------------------------------------------------------------

    def _remember(self, ref: Task | str | Mapping[str, Any], source: Path | None = None) -> Task:
        task = resolve_task(ref)
        if source is None and isinstance(ref, str) and Path(ref.partition("::")[0]).is_file():
            source = Path(ref.partition("::")[0])
        self._known[task.instance_id] = task
        if source is not None:
            self._files[task.instance_id] = str(source.resolve())
        return task

    def _resolve_task(self, ref: Any) -> Task:
        if isinstance(ref, str) and ref in self._known:  # an id: this env's own tasks first (a snapshot label names one)
            return self._known[ref]
        if ref is not None:
            try:
                return self._remember(ref)
            except TaskError as e:
                if not isinstance(ref, str) or Path(ref.partition("::")[0]).is_file():
                    raise
                raise TaskError(f"{e}. It is none of this env's tasks, of those it ran, or of the shipped ones: "
                                f"give the env the task, e.g. SWEEnv(task=<the Task, its record, or "
                                f"'tasks.jsonl::{ref}'>) or SWEEnv(tasks=[...] or tasks='tasks.jsonl'), or "
                                f"reset(options={{'task': ...}}) with it first", task=ref) from None
        if self._default is not None:
            return self._default
        if self._pool is None:
            self._pool = shipped_tasks()
        if not self._pool:
            raise TaskError("no task given and the task pool is empty")
        task = self._pool[int(self.np_random.integers(len(self._pool)))]
        self._known.setdefault(task.instance_id, task)
        return task

    def _task_id(self, task: Task) -> str:
        return task.instance_id

    def _task_labels(self, task: Task) -> dict[str, str]:
        source = self._files.get(task.instance_id)
        return {TASK_FILE_LABEL: source} if source else {}

    def _snapshot_task(self, labels: dict[str, str]) -> Task:
        ref = labels.get(TASK_LABEL)
        source = labels.get(TASK_FILE_LABEL)
        if ref is not None and ref not in self._known and source and Path(source).is_file():
            with contextlib.suppress(TaskError):
                return self._remember(f"{source}::{ref}", source=Path(source))
        return self._resolve_task(ref)

    # --- the sandbox and its pristine state --------------------------------------------------------

    def _start_sandbox(self, task: Task) -> SandboxLike:
        return self._start_episode(task)[0]

    def _start_episode(self, task: Task) -> tuple[SandboxLike, Task]:
        held = self._pristine
        if held is not None and held.matches(task):  # the same task again: its pristine state, restored
            return (self.api.Sandbox.restore(held.snapshot, labels={TASK_LABEL: task.instance_id}, ttl=self.sandbox_ttl),
                    held.task)
        sandbox, started = start_task(task, self.api, **self.sandbox_kwargs)
        # taken while reset returns and the agent thinks; every read of self.sandbox waits for it (_settle)
        self._taking = run_in_background(Pristine.take, sandbox, started, task)
        return sandbox, started

    def _settle(self) -> None:
        taking, self._taking = self._taking, None
        if taking is not None:
            # without a pristine state (the snapshot failed) the first grade takes one from a fresh sandbox
            with contextlib.suppress(Exception):
                self._hold(taking.result())

    def _hold(self, pristine: Pristine | None) -> None:
        old, self._pristine = self._pristine, pristine
        if old is not None and old is not pristine:
            old.release()

    def pristine(self) -> Pristine:
        """The pristine state of the episode's task (taken now, from a fresh sandbox, if the env has none)."""
        if self.task is None:
            raise RuntimeError("call reset() first")
        self._settle()
        held = self._pristine
        if held is not None and held.matches(self.task):
            return held
        sandbox, started = start_task(self.task, self.api, **self.sandbox_kwargs)
        try:
            fresh = Pristine.take(sandbox, started, self.task)
        finally:
            sandbox.close()
        self._hold(fresh)
        return fresh

    def _forked(self, kid: SWEEnv) -> None:
        self._settle()
        kid._pristine = self._pristine.share() if self._pristine is not None else None
        kid._taking = None
        kid._known, kid._files, kid._closing = dict(self._known), dict(self._files), []

    def close(self) -> None:
        super().close()
        self._hold(None)
        self.wait_graders_closed()

    def wait_graders_closed(self) -> None:
        """Wait until the grading sandboxes being closed in the background are gone."""
        closing, self._closing = self._closing, []
        wait(closing)

    # --- the episode ------------------------------------------------------------------------------

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
        return f"{turn.text}{ending}\n{result.summary()}", result.reward, submitted, info

    def grade_submission(self, submission: str) -> tuple[float, dict[str, Any]]:
        """A harness's episode is graded as a submitted one: the sandbox's /testbed, whatever the harness printed."""
        result = self.grade()
        return result.reward, {**self._info(), **result.to_info()}

    def grade(self) -> GradeResult:
        """Grade the episode's /testbed now (SWE-bench rules) in a fresh sandbox at the task's pristine state.

        The episode's sandbox is left as it is; only its files are read. The grading sandbox is closed in
        the background (``close()`` waits for it).
        """
        sandbox = self.box()
        pristine = self.pristine()
        self._closing = [f for f in self._closing if not f.done()]
        return grade(sandbox, pristine.task, pristine=pristine.snapshot, api=self.api, timeout=self.test_timeout,
                     closing=self._closing, trust_official_log=self.trust_official_log)
