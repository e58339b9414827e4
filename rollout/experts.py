"""Scripted experts for the shipped env families, and demonstrations written through the real rollout path.

An expert is a ``rollout.scripted.Script``: (decoded prompt, turn) -> the assistant's text. It reads the
conversation as the policy would see it and answers with K3 tool calls:

- ``agentenv/Lookup-v0`` (``lookup_expert``): solves from the conversation alone — ``cat`` the file the question
  names (``cat *`` when it names none: level 0; ``grep`` the key for level 2), follow a ``see OTHER`` link, answer the code the tool printed (with the
  ``answer`` tool, or as a plain reply when the env declares none: ``answer_tool=False``);
- ``agentenv/Tool-v0`` (``tool_expert(tasks)``): the task's answer; a task that names a sandbox tool
  (``python``, ``search``) calls it first, the others (``calculator``) answer directly;
- ``agentenv/SWE-v0`` (``swe_expert(tasks)``): the task's gold patch, written with ``create`` to
  ``/testbed/.gold.patch``, applied with ``bash git apply``, then ``submit``.

The Tool and SWE experts know the tasks they may meet (records, task objects; by default the shipped sets) and
find the episode's task from the prompt (the question, the issue text). ``expert(env_id, tasks)`` picks one.

``write_demonstrations(env_id, tasks, out, n)`` plays an expert through the real env (``gymnasium.make``) and
``rollout.agent.run_episode`` with the script served in process (``httpx.ASGITransport`` on
``rollout.scripted.create_app``), and writes the trajectories with ``rollout.trajectory.ShardWriter``: the
same format as RL data (token ids, loss mask, logprobs, reward). Only episodes with reward 1.0 are written;
the others are reported (``DemoReport.failed``; ``strict=True`` raises). ``python -m rollout.experts --env
agentenv/Lookup-v0 --n 300 --out runs/demos`` does the same from a shell.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from policy import chat
from rollout.agent import AgentConfig, Tokenizer
from rollout.scripted import Script, tool_call
from rollout.trajectory import Trajectory

LOOKUP, TOOL, SWE = "agentenv/Lookup-v0", "agentenv/Tool-v0", "agentenv/SWE-v0"
GOLD_PATH = "/testbed/.gold.patch"
# Generous limits: a scripted turn is never cut (a gold patch can be thousands of tokens).
DEMO_CONFIG = AgentConfig(max_turns=10, max_new_tokens=32_768, max_total_tokens=65_536, context_limit=131_072)

_USER = re.compile(re.escape(chat.IM_USER) + r"user" + re.escape(chat.IM_MIDDLE) + r"(.*?)" + re.escape(chat.IM_END),
                   re.DOTALL)
_TOOL = re.compile(re.escape(chat.IM_SYSTEM) + r"tool" + re.escape(chat.IM_MIDDLE) + r"## Return of [^\n]*\n(.*?)"
                   + re.escape(chat.IM_END), re.DOTALL)


def user_text(prompt: str) -> str:
    """The first user message of a rendered conversation ("" when there is none)."""
    m = _USER.search(prompt)
    return m.group(1) if m else ""


def tool_outputs(prompt: str) -> list[str]:
    """The tool results of a rendered conversation, in order."""
    return _TOOL.findall(prompt)


def answer(text: str, prompt: str | None = None) -> str:
    """The final answer: an ``answer`` tool call, or the plain text when ``prompt`` declares no ``answer`` tool."""
    if prompt is not None and '"name":"answer"' not in prompt.partition(chat.IM_END)[0]:
        return text
    return tool_call("answer", {"answer": text})


# --- Lookup-v0 -------------------------------------------------------------------------------------------

_FILE_Q = re.compile(r"code is in file (\w+)")
_KEY_Q = re.compile(r"code of (\w+) in the files")
_SEE = re.compile(r"see (\w+)")


def lookup_expert() -> Script:
    """The Lookup-v0 expert: reads what the question names, follows links, answers the code it was shown."""

    def script(prompt: str, turn: int) -> str:
        question, outputs = user_text(prompt), tool_outputs(prompt)
        key = _KEY_Q.search(question)
        if not outputs:
            if key:
                return tool_call("bash", {"command": f"grep {key.group(1)} *"})
            name = _FILE_Q.search(question)
            return tool_call("bash", {"command": f"cat {name.group(1) if name else '*'}"})
        out = outputs[-1].strip()
        if link := _SEE.fullmatch(out):
            return tool_call("bash", {"command": f"cat {link.group(1)}"})
        if key:
            found = re.search(rf"(?:^|:){re.escape(key.group(1))}=(\w+)", out, re.MULTILINE)
            return answer(found.group(1) if found else "", prompt)
        return answer(out.split()[0] if out else "", prompt)

    return script


# --- Tool-v0 -----------------------------------------------------------------------------------------------

_QUESTION = re.compile(r"Question: (.*?)\n\nTools:", re.DOTALL)
_SANDBOX_TOOLS = {"py": "python", "doc": "search", "mix": "search"}  # by id prefix, for records without "tool"
_NOT_NAMES = {"According", "What", "How", "Which", "Where", "When", "After", "If", "The"}


def _tool_records(tasks: Iterable[Any] | None) -> dict[str, dict[str, str]]:
    """question -> {"answer", "tool"} for Tool-v0 tasks (records or ``ToolTask``; default: the shipped file)."""
    from envs.tool_env import TASKS_FILE
    shipped = {r["id"]: r for r in (json.loads(line) for line in TASKS_FILE.read_text().splitlines() if line.strip())}
    out = {}
    for t in shipped.values() if tasks is None else tasks:
        if isinstance(t, str):  # a shipped task's id
            rec = shipped[t]
        elif isinstance(t, Mapping):
            rec = dict(t)
        else:  # a ToolTask
            rec = {"id": t.id, "question": t.question, "answer": t.answer}
        tool = rec.get("tool") or _SANDBOX_TOOLS.get(str(rec["id"]).split("-")[0], "")
        out[str(rec["question"]).strip()] = {"answer": str(rec["answer"]), "tool": str(tool)}
    return out


def _search_query(question: str) -> str:
    """A name from the question (a capitalised word that is not its first), else its longest word."""
    words = re.findall(r"[A-Za-z][A-Za-z']+", question)
    names = [w.removesuffix("'s") for w in words[1:] if w[0].isupper() and w not in _NOT_NAMES]
    return names[0] if names else max(words, key=len, default=question)


def tool_expert(tasks: Iterable[Any] | None = None) -> Script:
    """The Tool-v0 expert for ``tasks`` (default: the shipped tasks)."""
    known = _tool_records(tasks)

    def script(prompt: str, turn: int) -> str:
        m = _QUESTION.search(user_text(prompt))
        task = known.get(m.group(1).strip()) if m else None
        if task is None:
            return answer("unknown task")
        if not tool_outputs(prompt):
            if task["tool"] == "python":
                return tool_call("python", {"code": f"print({task['answer']!r})"})
            if task["tool"] == "search":
                return tool_call("search", {"query": _search_query(m.group(1) if m else "")})
        return answer(task["answer"])

    return script


# --- SWE-v0 ------------------------------------------------------------------------------------------------

_ISSUE = re.compile(r"<issue>\n(.*?)\n</issue>", re.DOTALL)


def swe_expert(tasks: Iterable[Any] | None = None) -> Script:
    """The SWE-v0 expert: the gold patch of the task whose issue the prompt shows (``tasks``: ``Task`` objects,
    records, ids or files as ``envs.task.resolve_task`` takes them; default: the shipped tasks)."""
    from envs.task import resolve_task, shipped_tasks

    resolved = shipped_tasks() if tasks is None else [resolve_task(t) for t in tasks]
    by_issue = {t.problem_statement.strip(): t for t in resolved}

    def script(prompt: str, turn: int) -> str:
        m = _ISSUE.search(user_text(prompt))
        task = by_issue.get(m.group(1).strip()) if m else None
        if task is None:
            return tool_call("submit", {})
        done = len(tool_outputs(prompt))
        if done == 0:
            return tool_call("create", {"path": GOLD_PATH, "file_text": task.patch})
        if done == 1:
            return tool_call("bash", {"command": f"git apply {GOLD_PATH} && rm {GOLD_PATH}"})
        return tool_call("submit", {})

    return script


def expert(env_id: str, tasks: Iterable[Any] | None = None) -> Script:
    """The scripted expert of a shipped env family (``tasks``: what it may meet, for Tool-v0 and SWE-v0)."""
    if env_id == LOOKUP:
        return lookup_expert()
    if env_id == TOOL:
        return tool_expert(tasks)
    if env_id == SWE:
        return swe_expert(tasks)
    raise ValueError(f"no scripted expert for {env_id!r}; there are: {LOOKUP}, {TOOL}, {SWE}")


# --- demonstrations ----------------------------------------------------------------------------------------

@dataclass
class DemoReport:
    """What ``write_demonstrations`` did: episodes played, demonstrations written (reward 1.0), the failures, and
    token counts per kind of task (``lookup-1``, ``calc``, ...: the task id without its trailing number)."""

    env_id: str
    out: str
    episodes: int = 0
    written: int = 0
    failed: list[dict[str, Any]] = field(default_factory=list)
    tokens: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _kind(task_id: str) -> str:
    return re.sub(r"-\d+(?:-w\d+)?$", "", task_id) or "?"  # lookup-2-17-w12 -> lookup-2, calc-001 -> calc


def token_stats(trajectories: Sequence[Trajectory]) -> dict[str, dict[str, float]]:
    """Per kind of task: episodes, mean prompt / generated / total tokens, the largest total, mean turns."""
    kinds: dict[str, list[Trajectory]] = {}
    for t in trajectories:
        kinds.setdefault(_kind(t.task_id), []).append(t)
    kinds["all"] = list(trajectories)
    return {k: {"episodes": len(ts), "prompt": statistics.fmean(t.prompt_len for t in ts),
                "generated": statistics.fmean(t.generated_tokens for t in ts),
                "total": statistics.fmean(len(t.token_ids) for t in ts),
                "max_total": max(len(t.token_ids) for t in ts),
                "turns": statistics.fmean(len(t.turns) for t in ts)}
            for k, ts in sorted(kinds.items()) if ts}


def _task_id(task: Any) -> str:
    from rollout.workers import task_id_of
    return task_id_of(task)


async def play_demonstrations(env_id: str, tasks: Sequence[Any], script: Script, tokenizer: Tokenizer, *,
                              env_kwargs: Mapping[str, Any] | None = None, config: AgentConfig = DEMO_CONFIG,
                              concurrency: int = 4) -> list[Trajectory]:
    """One episode of ``script`` per task through ``gymnasium.make(env_id, **env_kwargs)`` and the agent loop,
    at most ``concurrency`` at a time; the trajectories in the order of ``tasks``."""
    import gymnasium
    import httpx

    import envs  # noqa: F401  (registers the env ids)
    from policy.client import PolicyClient
    from rollout.agent import run_episode
    from rollout.scripted import create_app

    gate = asyncio.Semaphore(max(1, concurrency))
    app = create_app(script, tokenizer, model="expert")

    async def one(task: Any, policy: PolicyClient) -> Trajectory:
        async with gate:
            env = await asyncio.to_thread(gymnasium.make, env_id, **dict(env_kwargs or {}))
            try:
                return await run_episode(env, policy, tokenizer, config, task_id=_task_id(task), env_id=env_id,
                                         reset_options={"task": task})
            finally:
                await asyncio.to_thread(env.close)

    async with PolicyClient("http://expert", transport=httpx.ASGITransport(app=app), max_retries=0) as policy:
        return list(await asyncio.gather(*(one(t, policy) for t in tasks)))


def write_demonstrations(env_id: str, tasks: Iterable[Any] | None, out: str | Path, n: int | None = None, *,
                         script: Script | None = None, api: Any = None, env_kwargs: Mapping[str, Any] | None = None,
                         config: AgentConfig = DEMO_CONFIG, tokenizer: Tokenizer | None = None, concurrency: int = 4,
                         records_per_shard: int = 64, strict: bool = False) -> DemoReport:
    """Play the expert of ``env_id`` on ``tasks`` (the first ``n``; for Lookup-v0, None means ``n`` training
    tasks of every level) and write the episodes that scored 1.0 to the run folder ``out`` (msgpack shards, plus
    ``demos.json``: this report). ``api``: the sandboxes' Backend (passed to the env). ``strict``: raise
    RuntimeError, after writing, when an episode did not score 1.0."""
    from rollout.agent import LocalTokenizer
    from rollout.trajectory import ShardWriter

    if tasks is None:
        if env_id != LOOKUP:
            raise ValueError(f"give the tasks to play for {env_id}")
        from envs.lookup_env import task_ids
        tasks = task_ids("train", 300 if n is None else n)
    chosen = list(tasks)[:n] if n is not None else list(tasks)
    tok = tokenizer or LocalTokenizer()
    kwargs = {**({"api": api} if api is not None else {}), **dict(env_kwargs or {})}
    trajs = asyncio.run(play_demonstrations(env_id, chosen, script or expert(env_id, None if env_id == LOOKUP
                                                                             else chosen), tok,
                                            env_kwargs=kwargs, config=config, concurrency=concurrency))
    report = DemoReport(env_id, str(out), episodes=len(trajs))
    good = [t for t in trajs if t.reward == 1.0]
    with ShardWriter(out, records_per_shard) as w:
        for t in good:
            w.write(t)
    report.written = len(good)
    report.failed = [{"task": t.task_id, "finish_reason": t.finish_reason, "reward": t.reward,
                      "error": t.error, "grade": {k: v for k, v in t.grade.items() if isinstance(v, str | int | float
                                                                                              | bool | None)}}
                     for t in trajs if t.reward != 1.0]
    report.tokens = token_stats(good)
    Path(out, "demos.json").write_text(json.dumps(report.to_json(), indent=1))
    if strict and report.failed:
        raise RuntimeError(f"{len(report.failed)} of {report.episodes} expert episodes did not score 1.0: "
                           f"{report.failed[:3]}")
    return report


def main(argv: Iterable[str] | None = None) -> int:
    """Write expert demonstrations: ``python -m rollout.experts --env agentenv/Lookup-v0 --n 300 --out DIR``."""
    p = argparse.ArgumentParser(prog="python -m rollout.experts", description=main.__doc__)
    p.add_argument("--env", default=LOOKUP)
    p.add_argument("--out", required=True)
    p.add_argument("--n", type=int, default=None, help="the first N tasks (Lookup-v0: N training tasks)")
    p.add_argument("--tasks", default=None, help="task records (JSONL); default: the env's own set")
    p.add_argument("--levels", default="1,2,3", help="Lookup-v0: the levels of the training tasks")
    p.add_argument("--words", type=int, default=None, help="Lookup-v0: names and codes to draw from (default all)")
    p.add_argument("--env-kwargs", default="{}", help='JSON for gymnasium.make, e.g. {"answer_tool": false}')
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--strict", action="store_true", help="exit 1 unless every episode scored 1.0")
    a = p.parse_args(list(argv) if argv is not None else None)
    tasks: list[Any] | None = None
    if a.tasks:
        tasks = [json.loads(line) for line in Path(a.tasks).read_text().splitlines() if line.strip()]
    elif a.env == LOOKUP:
        from envs.lookup_env import WORDS, task_ids
        tasks = task_ids("train", 300 if a.n is None else a.n, [int(x) for x in a.levels.split(",")],
                         words=a.words or WORDS)
    elif a.env == TOOL:
        from envs.tool_env import TASKS_FILE
        tasks = [json.loads(line) for line in TASKS_FILE.read_text().splitlines() if line.strip()]
    elif a.env == SWE:
        from envs.task import shipped_tasks
        tasks = list(shipped_tasks())
    try:
        report = write_demonstrations(a.env, tasks, a.out, a.n, env_kwargs=json.loads(a.env_kwargs),
                                      concurrency=a.concurrency, strict=a.strict)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps({k: v for k, v in report.to_json().items() if k != "failed"} | {"failed": len(report.failed)},
                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
