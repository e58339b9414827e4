"""ToolEnv (``agentenv/Tool-v0``): small tasks with a checkable answer, solved with tools in a sandbox.

Tools: ``python`` (run a program in the sandbox), ``search`` (case-insensitive search over the
shipped document set at ``/docs``), ``calculator`` (arithmetic, evaluated safely on the host) and
``answer`` (ends the episode). Reward 1.0 when the answer matches: exact match after normalising
case and spaces, or a number within the task's tolerance. The sandbox starts only when a tool needs
it, so calculator-only episodes cost no container. Small and fast: the workhorse for checking that
the RL loop learns.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentenv.api import DEFAULT_IMAGE, Backend, SandboxLike
from envs.base import SandboxEnv
from envs.spaces import MAX_ACTION, MAX_OBSERVATION, UnicodeText
from envs.task import TaskError
from envs.tools import AnswerTool, CalculatorTool, PythonTool, SearchTool, Toolbox
from envs.tools.programs import DOCS

DATA = Path(__file__).with_name("data")
DOCS_DIR = DATA / "docs"
TASKS_FILE = DATA / "tool_tasks.jsonl"

DEFAULT_MAX_STEPS = 10  # also the step limit it is registered with (envs/__init__.py)


@dataclass(frozen=True)
class ToolTask:
    id: str
    question: str
    answer: str
    match: str = "exact"            # "exact" or "numeric"
    tolerance: float = 1e-6         # absolute, for "numeric"

    @classmethod
    def from_json(cls, d: Any, where: str = "") -> ToolTask:
        if not isinstance(d, Mapping):
            raise TaskError("a tool task must be an object", where=where)
        tid = d.get("id")
        for f in ("id", "question", "answer"):
            if not isinstance(d.get(f), str) or not d[f]:
                raise TaskError(f"required, a non-empty string; got {d.get(f)!r}", task=str(tid), field=f, where=where)
        match = d.get("match", "exact")
        if match not in ("exact", "numeric"):
            raise TaskError(f"must be 'exact' or 'numeric', got {match!r}", task=tid, field="match", where=where)
        tol = d.get("tolerance", 1e-6)
        if not isinstance(tol, int | float) or tol < 0:
            raise TaskError(f"must be a number >= 0, got {tol!r}", task=tid, field="tolerance", where=where)
        if match == "numeric" and _number(d["answer"]) is None:
            raise TaskError(f"a numeric task needs a numeric answer, got {d['answer']!r}", task=tid, field="answer",
                            where=where)
        return cls(str(tid), d["question"], d["answer"], match, float(tol))

    def score(self, given: str) -> float:
        if self.match == "numeric":
            got, want = _number(given), _number(self.answer)
            return 1.0 if got is not None and want is not None and abs(got - want) <= self.tolerance + 1e-12 else 0.0
        return 1.0 if _norm(given) == _norm(self.answer) else 0.0


def _norm(s: str) -> str:
    return re.sub(r"\s+", " ", s.strip().strip("'\"`").rstrip(".").strip()).lower()


def _number(s: str) -> float | None:
    m = re.fullmatch(r"\s*[$]?\s*(-?[\d,]*\.?\d+(?:[eE][-+]?\d+)?)\s*%?\s*\.?\s*", s or "")
    if not m:
        return None
    try:
        return float(m.group(1).replace(",", ""))
    except ValueError:
        return None


def load_tool_tasks(path: str | Path = TASKS_FILE) -> list[ToolTask]:
    out, seen = [], set()
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise TaskError(f"not valid JSON: {e}", where=f"{path}:{n}") from None
            t = ToolTask.from_json(rec, where=f"{path}:{n}")
            if t.id in seen:
                raise TaskError("duplicate id", task=t.id, field="id", where=f"{path}:{n}")
            seen.add(t.id)
            out.append(t)
    return out


SPLITS = ("train", "heldout", "validation")


def task_split(task: ToolTask, tasks: Sequence[ToolTask]) -> str:
    """The split of a shipped task, by its place in the file: of five, one held out, one validation, three train."""
    r = [t.id for t in tasks].index(task.id) % 5
    return "heldout" if r == 0 else "validation" if r == 1 else "train"


def task_ids(split: str = "train", path: str = str(TASKS_FILE)) -> list[str]:
    """The ids of a split of the tasks in ``path`` (``py:envs.tool_env:task_ids split=heldout`` in a run's config)."""
    if split not in SPLITS:
        raise ValueError(f"split is one of {SPLITS}, got {split!r}")
    tasks = load_tool_tasks(path)
    return [t.id for t in tasks if task_split(t, tasks) == split]


def task_key(ref: Any) -> tuple[str, str]:
    """The identity of a task to a policy: its question and answer (a shipped task's id, a record or a task)."""
    if isinstance(ref, ToolTask):
        t = ref
    elif isinstance(ref, Mapping):
        t = ToolTask.from_json(ref)
    else:
        found = [t for t in load_tool_tasks() if t.id == ref]
        if not found:
            raise TaskError(f"no tool task {ref!r}")
        t = found[0]
    return (_norm(t.question), _norm(t.answer))


class ToolEnv(SandboxEnv[ToolTask]):
    """One question per episode; tool calls as K3 text or dicts; reward from the final answer."""

    lazy_sandbox = True

    def __init__(self, task: str | Mapping[str, Any] | ToolTask | None = None, tasks: Sequence[ToolTask] | None = None,
                 max_steps: int | None = DEFAULT_MAX_STEPS, max_output: int = 4000, timeout: float = 20.0,
                 image: str = DEFAULT_IMAGE, render_mode: str | None = None, api: Backend | None = None,
                 **sandbox_kwargs: Any) -> None:
        super().__init__(api=api, max_steps=max_steps, render_mode=render_mode,
                         sandbox_kwargs={"cpus": 1.0, "memory": "512m", **sandbox_kwargs})
        self.observation_space = UnicodeText(MAX_OBSERVATION)
        self.action_space = UnicodeText(MAX_ACTION, min_length=1)
        self.max_output, self.timeout, self.image = max_output, timeout, image
        self.tasks = list(tasks) if tasks is not None else load_tool_tasks()
        self._default = self._resolve_task(task) if task is not None else None

    def _resolve_task(self, ref: Any) -> ToolTask:
        if isinstance(ref, ToolTask):
            return ref
        if isinstance(ref, Mapping):
            return ToolTask.from_json(ref)
        if ref is None:
            return self._default or self.tasks[int(self.np_random.integers(len(self.tasks)))]
        for t in self.tasks:
            if t.id == ref:
                return t
        raise TaskError(f"no tool task {ref!r}")

    def _task_id(self, task: ToolTask) -> str:
        return task.id

    def _start_sandbox(self, task: ToolTask) -> SandboxLike:
        sb = self.api.Sandbox.create(self.image, **self.sandbox_kwargs)
        try:
            for doc in sorted(DOCS_DIR.iterdir()):
                sb.write_file(f"{DOCS}/{doc.name}", doc.read_bytes())
        except BaseException:
            sb.close()
            raise
        return sb

    def _make_toolbox(self) -> Toolbox:
        return Toolbox(PythonTool(self.box, timeout=self.timeout), SearchTool(self.box, timeout=self.timeout),
                       CalculatorTool(), AnswerTool(), max_output=self.max_output)

    def _first_observation(self, task: ToolTask) -> str:
        return (f"Answer this question. Use the tools; finish with the answer tool.\n\n"
                f"Question: {task.question}\n\nTools:\n{self.toolbox.describe()}")

    def _info(self) -> dict[str, Any]:
        return {"task": self.task.id if self.task else None}

    def _act(self, action: Any) -> tuple[str, float, bool, dict[str, Any]]:
        turn = self.toolbox.run(action)
        info = {**self._info(), **turn.info(), "steps": self.steps}
        if turn.ending is None or self.task is None:
            return turn.text, 0.0, False, info
        answer = str(turn.ending.arguments["answer"])
        reward = self.task.score(answer)
        info.update(answer=answer, correct=reward == 1.0, expected=self.task.answer)
        return turn.text, reward, True, info
