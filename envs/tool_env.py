"""ToolEnv (``agentenv/Tool-v0``): small tasks with a checkable answer, solved with tools in a sandbox.

Tools: ``python`` (run a program in the sandbox), ``search`` (case-insensitive search over the
shipped document set at ``/docs``), ``calculator`` (arithmetic, evaluated safely on the host) and
``answer`` (ends the episode). Reward 1.0 when the answer matches: exact match after normalising
case and spaces, or a number within the task's tolerance. The sandbox starts only when a tool needs
it, so calculator-only episodes cost no container. Small and fast: the workhorse for checking that
the RL loop learns.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym

import agentenv
from agentenv.sandbox import DEFAULT_IMAGE, Sandbox
from envs.swe_env import MAX_ACTION, MAX_OBSERVATION, UnicodeText
from envs.task import TaskError
from envs.tools import ActionError, ToolOutput, _fn, check_arguments, describe_tools, parse_action, truncate

DATA = Path(__file__).with_name("data")
DOCS_DIR = DATA / "docs"
TASKS_FILE = DATA / "tool_tasks.jsonl"
SANDBOX_DOCS = "/docs"

TOOL_TOOLS: list[dict[str, Any]] = [
    _fn("python", "Run a Python 3 program in a sandbox (no network) and see what it prints.",
        {"code": {"type": "string"}}, ["code"]),
    _fn("search", f"Search the documents in {SANDBOX_DOCS} (case-insensitive); shows matching lines with context.",
        {"query": {"type": "string"}}, ["query"]),
    _fn("calculator", "Evaluate an arithmetic expression: + - * / // % ** ( ), sqrt, log, exp, factorial, pi, e.",
        {"expression": {"type": "string"}}, ["expression"]),
    _fn("answer", "Give the final answer; the episode ends.", {"answer": {"type": "string"}}, ["answer"]),
]


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


_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_FUNCS: dict[str, Callable[..., Any]] = {"sqrt": math.sqrt, "log": math.log, "exp": math.exp, "abs": abs,
                                         "factorial": math.factorial, "round": round, "sin": math.sin,
                                         "cos": math.cos, "tan": math.tan, "log10": math.log10, "log2": math.log2}
_CONSTS = {"pi": math.pi, "e": math.e}


def calculate(expression: str) -> int | float:
    """Evaluate arithmetic safely (no names but a few math functions; bounded powers)."""
    if len(expression) > 500:
        raise ActionError("calculator: expression too long (500 characters at most)")
    try:
        tree = ast.parse(expression.replace("^", "**"), mode="eval")
    except SyntaxError as e:
        raise ActionError(f"calculator: not an expression ({e.msg})") from None

    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and (abs(b) > 10_000 or (abs(a) > 1 and abs(b) * math.log2(abs(a)) > 100_000)):
                raise ActionError("calculator: power too large")
            return _BINOPS[type(node.op)](a, b)
        if isinstance(node, ast.Name) and node.id in _CONSTS:
            return _CONSTS[node.id]
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS
                and not node.keywords):
            args = [ev(a) for a in node.args]
            if node.func.id == "factorial" and (not args or args[0] > 5000):
                raise ActionError("calculator: factorial argument too large")
            return _FUNCS[node.func.id](*args)
        raise ActionError(f"calculator: unsupported element {ast.dump(node)[:60]}")

    try:
        value = ev(tree)
    except ActionError:
        raise
    except (ArithmeticError, ValueError, TypeError) as e:
        raise ActionError(f"calculator: {type(e).__name__}: {e}") from None
    if not isinstance(value, int | float):
        raise ActionError("calculator: the result is not a number")
    return value


class ToolEnv(gym.Env[str, Any]):
    """One question per episode; tool calls as K3 text or dicts; reward from the final answer."""

    metadata = {"render_modes": ["ansi"], "render_fps": 1}

    def __init__(self, task: str | Mapping[str, Any] | None = None, tasks: Sequence[ToolTask] | None = None,
                 max_steps: int = 10, max_output: int = 4000, timeout: float = 20.0, image: str = DEFAULT_IMAGE,
                 render_mode: str | None = None, api: Any = None, **sandbox_kwargs: Any) -> None:
        self.api = api if api is not None else agentenv  # or a remote client / Pool: the same calls
        self.observation_space = UnicodeText(MAX_OBSERVATION)
        self.action_space = UnicodeText(MAX_ACTION, min_length=1)
        self.render_mode = render_mode
        self.max_steps, self.max_output, self.timeout, self.image = max_steps, max_output, timeout, image
        self._sandbox_kwargs = {"cpus": 1.0, "memory": "512m", **sandbox_kwargs}
        self.tasks = list(tasks) if tasks is not None else load_tool_tasks()
        self._default = self._find(task) if task is not None else None
        self.task: ToolTask | None = None
        self.sandbox: Sandbox | None = None
        self.steps, self.done, self._last = 0, False, ""

    def _find(self, task: str | Mapping[str, Any] | ToolTask) -> ToolTask:
        if isinstance(task, ToolTask):
            return task
        if isinstance(task, Mapping):
            return ToolTask.from_json(task)
        for t in self.tasks:
            if t.id == task:
                return t
        raise TaskError(f"no tool task {task!r}")

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        opts = options or {}
        if opts.get("task") is not None:
            self.task = self._find(opts["task"])
        elif self._default is not None:
            self.task = self._default
        else:
            self.task = self.tasks[int(self.np_random.integers(len(self.tasks)))]
        self._close_sandbox()
        self.steps, self.done = 0, False
        self._last = (f"Answer this question. Use the tools; finish with the answer tool.\n\n"
                      f"Question: {self.task.question}\n\nTools:\n{describe_tools(TOOL_TOOLS)}")
        return self._last, {"task": self.task.id}

    def _box(self) -> Sandbox:
        if self.sandbox is None:
            sb = self.api.Sandbox.create(self.image, **self._sandbox_kwargs)
            try:
                for doc in sorted(DOCS_DIR.iterdir()):
                    sb.write_file(f"{SANDBOX_DOCS}/{doc.name}", doc.read_bytes())
            except BaseException:
                sb.close()
                raise
            self.sandbox = sb
        return self.sandbox

    def step(self, action: Any) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.task is None:
            raise RuntimeError("call reset() before step()")
        if self.done:
            return "The episode is over; call reset().", 0.0, True, False, {"task": self.task.id, "error": True}
        name, out, reward = None, ToolOutput(""), 0.0
        try:
            call = parse_action(action)
            name = call.name
            args = check_arguments(call, TOOL_TOOLS)
            out = self._run(call.name, args)
        except ActionError as e:
            out = ToolOutput(f"Error: {e}", error=True)
        self.steps += 1
        info: dict[str, Any] = {"task": self.task.id, "tool": name, "error": out.error, "steps": self.steps}
        if out.submitted:
            reward = self.task.score(out.text)
            self.done = True
            info.update(answer=out.text, correct=reward == 1.0, expected=self.task.answer)
            obs = f"Answer recorded: {out.text}"
        else:
            obs = truncate(out.text, self.max_output)
        truncated = not self.done and self.steps >= self.max_steps
        self.done = self.done or truncated
        self._last = obs
        return obs, reward, bool(out.submitted), truncated, info

    def _run(self, name: str, args: dict[str, Any]) -> ToolOutput:
        if name == "answer":
            return ToolOutput(str(args["answer"]), submitted=True)
        if name == "calculator":
            v = calculate(args["expression"])
            return ToolOutput(repr(v) if isinstance(v, float) else str(v))
        if name == "search":
            q = args["query"].strip()
            if not q:
                raise ActionError("search: the query is empty")
            r = self._box().exec(f"grep -rinF -C1 -- {shlex.quote(q)} {SANDBOX_DOCS} | head -n 60", timeout=self.timeout)
            return ToolOutput(r.stdout.replace(SANDBOX_DOCS + "/", "") or f"no match for {q!r}")
        sb = self._box()
        sb.write_file("/tmp/main.py", args["code"])
        r = sb.exec("python3 /tmp/main.py", timeout=self.timeout, cwd="/tmp")
        text = r.stdout + r.stderr
        if r.timed_out:
            text += f"\n[timed out after {self.timeout:g} s and killed]"
        elif r.exit_code:
            text += f"\n[exit code {r.exit_code}]"
        return ToolOutput(text or "[no output]", error=r.timed_out)

    def render(self) -> str | None:
        return self._last if self.render_mode == "ansi" else None

    def _close_sandbox(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()
            self.sandbox = None

    def close(self) -> None:
        self._close_sandbox()
        super().close()
