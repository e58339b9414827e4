"""LookupEnv (``agentenv/Lookup-v0``): find a code in small files in a sandbox, then answer it.

The learnable task family: procedurally generated from ``(level, seed)``, short in tokens, solved only by
running commands in the sandbox (the answer is in a file written at reset, never in the prompt), rewarded by
an exact, checkable answer. Made for a small policy (k3-mini) to learn on a CPU: SFT on demonstrations of
the scripted expert (``rollout.experts``) gets it started, GRPO groups forked from one reset improve it.

Tools (two, with short declarations): ``bash`` (a shell command, run in the sandbox in ``/data``) and
``answer`` (ends the episode). The prompt is one short question; the loop renders the tool declarations.
With ``answer_tool=False`` there is one tool, ``bash``, and a reply without a tool call is the answer: about
100 tokens less of declarations in every prompt and a shorter last turn (about 40% fewer tokens an episode).

Levels (graded difficulty):

0. "What code is in the file NAME?" — ``/data`` holds one file, NAME: ``cat *``, then answer what it printed
   (one copy, from the observation just before the answer: what a model this small learns first). The question
   names the file so that a task is its (name, code) pair, which the splits keep apart (below).
1. "What code is in file NAME?" — ``/data/NAME`` holds the code (other files hold other codes):
   ``cat NAME``, then answer what it printed.
2. "What is the code of NAME in the files?" — several files hold lines ``KEY=CODE``; NAME is a key in one of
   them: ``grep NAME *`` prints ``FILE:NAME=CODE``, then answer CODE.
3. Two hops, asked like level 1: ``/data/NAME`` says ``see OTHER``; ``cat OTHER`` gives the code.

Names and codes are single tokens of the k3-mini tokenizer (``NAMES``, ``VALUES``), so a tool call or an
answer is a handful of tokens, and every copy the agent makes is of one token id: a name from the question
(`` NAME``) into a command (``cat NAME``), a code from an observation (at the start of a line, or after ``=``:
the bare word) into the answer (``"CODE"``: the bare word too).

``words`` (default all 40) draws names and codes from the first ``words`` of each list (at least 9): fewer
distinct tokens to learn to copy, and a higher chance of a lucky guess (1 / ``words``), for a first curriculum.

Task ids are ``lookup-LEVEL-SEED`` (``lookup-LEVEL-SEED-wWORDS`` with fewer words); a task is made again from
its id (``make_task``), so a snapshot, a fork or another process resolves it without a task file. Three splits, by
seed: ``[0, 1e6)`` train, ``[1e6, 2e6)`` held out, ``[2e6, 3e6)`` validation (for choosing recipes). They never
share a (question name, code) pair either (``pair_split``: one pair in five is held out, one in five validation),
so no held-out or validation question was ever asked in training with that answer, and no episode of one split
is token for token an episode of another. ``task_key`` says when two tasks are the same to a policy (the
pre-flight of ``agentenv train`` refuses a run whose splits share one).
``task_ids(split, n, levels)`` lists tasks; ``python -m envs.lookup_env --split heldout --n 60`` writes them as
JSONL records for ``agentenv rollout --tasks``.

Reward 1.0 when the answer equals the code (after stripping spaces, quotes and a final period, ignoring
case), else 0.0; ``info`` carries ``expected``, ``answer``, ``correct`` and ``level``. The expected code comes
from the task the env generated on the host, never from the sandbox.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agentenv.api import DEFAULT_IMAGE, Backend, SandboxLike
from envs.base import SandboxEnv
from envs.spaces import UnicodeText
from envs.task import TaskError
from envs.tools import AnswerTool, Box, SandboxTools, Toolbox, ToolOutput, tool
from envs.tools.core import ActionError
from envs.tools.programs import program_output
from policy import chat

DEFAULT_MAX_STEPS = 5  # also the step limit it is registered with (envs/__init__.py); level 3 needs 3
WORKDIR = "/data"
LEVELS = (0, 1, 2, 3)
HELDOUT_SEED = 1_000_000  # seeds [0, HELDOUT_SEED): train; [HELDOUT_SEED, 2 * HELDOUT_SEED): held out
SPLITS = ("train", "heldout", "validation")   # validation: seeds [2 * HELDOUT_SEED, 3 * HELDOUT_SEED)
MAX_OBSERVATION = MAX_ACTION = 4096

# Single tokens of the k3-mini tokenizer both bare and after a space (``tests/unit/envs/test_envs_lookup.py``
# checks); no word is part of another, so ``grep NAME`` matches one line only.
NAMES = ("cache", "kernel", "router", "weather", "token", "layer", "model", "policy", "device", "expert", "block",
         "chunk", "state", "channel", "bias", "beta", "gate", "mask", "norm", "rank", "scale", "shape", "stack",
         "stream", "world", "vocab", "query", "index", "order", "group", "head", "patch", "range", "main", "local",
         "sort", "split", "train", "weight", "config")
VALUES = ("python", "project", "process", "count", "decay", "dense", "cores", "current", "element", "embedding",
          "extra", "eye", "flat", "forward", "grad", "hidden", "input", "lower", "load", "linear", "latent",
          "partial", "single", "softmax", "special", "sum", "top", "total", "valid", "back", "down", "short",
          "solve", "tie", "dim", "dtype", "init", "json", "lib", "bool")
HELDOUT_EVERY = 5  # of five (name, code) pairs: one held out, one validation, three train
WORDS, MIN_WORDS = len(NAMES), 9  # level 2 needs 9 distinct names (3 files, 6 keys)

# What a small policy trained from scratch on a CPU (k3-mini) learns on: gymnasium.make(ID, **SMALL_MODEL_KWARGS).
# After ~200 SFT steps (batch 8) on 300 expert demonstrations of these: level 0 solved (20/20 held out), level 1
# at ~35% (it reads every file with ``cat *`` and answers one of the codes): room for RL to improve.
SMALL_MODEL_KWARGS: dict[str, Any] = {"levels": (0, 1), "words": 12, "answer_tool": False}

QUESTION = {0: "What code is in the file {name}?", 1: "What code is in file {name}?", 2: "What is the code of {name} in the files?",
            3: "What code is in file {name}?"}
_TASK_ID = re.compile(r"lookup-(\d)-(\d+)(?:-w(\d+))?")


def pair_split(name: str, value: str) -> str:
    """The split a (question name, code) pair belongs to: one pair in ``HELDOUT_EVERY`` is held out, the next
    one validation, the rest train."""
    r = (NAMES.index(name) + VALUES.index(value)) % HELDOUT_EVERY
    return "heldout" if r == 0 else "validation" if r == 1 else "train"


def split_base(split: str) -> int:
    """The first seed of a split."""
    if split not in SPLITS:
        raise ValueError(f"split is one of {SPLITS}, got {split!r}")
    return SPLITS.index(split) * HELDOUT_SEED


def seed_split(seed: int) -> str:
    if not 0 <= seed < len(SPLITS) * HELDOUT_SEED:
        raise TaskError(f"a lookup seed is in [0, {len(SPLITS) * HELDOUT_SEED}), got {seed}")
    return SPLITS[seed // HELDOUT_SEED]


@dataclass(frozen=True)
class LookupTask:
    """One generated task: the question, the files written to ``/data`` at reset, and the expected code."""

    id: str
    level: int
    seed: int
    question: str
    files: tuple[tuple[str, str], ...]  # (name under /data, content)
    answer: str
    key: str                            # the name the question asks about (level 0: the one file's name)
    words: int = WORDS                  # names and codes come from the first ``words`` of NAMES and VALUES

    @property
    def split(self) -> str:
        return seed_split(self.seed)

    def score(self, given: str) -> float:
        return 1.0 if _norm(given) == _norm(self.answer) else 0.0

    @property
    def content(self) -> tuple[Any, ...]:
        """What a policy sees and must answer: two tasks with one key are the same task to it."""
        return (self.level, self.question, self.files, self.answer)

    def to_json(self) -> dict[str, Any]:
        """The record a task file holds (``id`` is enough to make the task again; the rest is for people)."""
        return {"id": self.id, "level": self.level, "seed": self.seed, "words": self.words, "split": self.split}


def _norm(s: str) -> str:
    return re.sub(r"\s+", " ", s.strip().strip("'\"`").rstrip(".").strip()).lower()


def task_id(level: int, seed: int, words: int = WORDS) -> str:
    return f"lookup-{level}-{seed}" + ("" if words == WORDS else f"-w{words}")


def make_task(level: int, seed: int, words: int = WORDS) -> LookupTask:
    """The task of ``(level, seed)`` (with ``words`` names and codes); the same on every host and Python version
    (a string-seeded ``random``)."""
    tid = task_id(level, seed, words)
    if level not in LEVELS:
        raise TaskError(f"level must be one of {LEVELS}, got {level!r}", task=tid, field="level")
    if not MIN_WORDS <= words <= WORDS:
        raise TaskError(f"words must be in [{MIN_WORDS}, {WORDS}], got {words!r}", task=tid, field="words")
    split = seed_split(seed)
    salt = "" if words == WORDS else f":w{words}"
    rng = random.Random(f"agentenv/Lookup-v0:{level}:{seed}{salt}")
    while True:
        task = _draw(rng, level, seed, words)
        if pair_split(task.key, task.answer) == split:
            return task


def _draw(rng: random.Random, level: int, seed: int, words: int) -> LookupTask:
    pool_names, pool_values = NAMES[:words], VALUES[:words]
    if level == 0:
        (name,), (value,) = rng.sample(pool_names, 1), rng.sample(pool_values, 1)
        files, key, answer = [(name, f"{value}\n")], name, value
    elif level == 1:
        names, values = rng.sample(pool_names, 3), rng.sample(pool_values, 3)
        files = [(n, f"{v}\n") for n, v in zip(names, values, strict=True)]
        key, answer = names[0], values[0]
    elif level == 2:
        picked = rng.sample(pool_names, 9)
        holders, keys, values = picked[:3], picked[3:], rng.sample(pool_values, 6)
        files = [(h, f"{keys[2 * i]}={values[2 * i]}\n{keys[2 * i + 1]}={values[2 * i + 1]}\n")
                 for i, h in enumerate(holders)]
        at = rng.randrange(6)
        key, answer = keys[at], values[at]
    else:
        names, values = rng.sample(pool_names, 4), rng.sample(pool_values, 3)
        start, target, *others = names
        files = [(start, f"see {target}\n"), (target, f"{values[0]}\n")]
        files += [(n, f"{v}\n") for n, v in zip(others, values[1:], strict=False)]
        key, answer = start, values[0]
    rng.shuffle(files)
    return LookupTask(task_id(level, seed, words), level, seed, QUESTION[level].format(name=key),
                      tuple(sorted(files)), answer, key, words)


def parse_task_id(ref: str) -> tuple[int, int, int]:
    """(level, seed, words) of a task id."""
    m = _TASK_ID.fullmatch(ref.strip())
    if m is None:
        raise TaskError(f"no lookup task {ref!r}: ids are lookup-LEVEL-SEED[-wWORDS] (levels {LEVELS})")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or WORDS)


def resolve(ref: Any) -> LookupTask:
    """A task from an id, a record (``{"id": ...}`` or ``{"level": L, "seed": S}``) or a task."""
    if isinstance(ref, LookupTask):
        return make_task(ref.level, ref.seed, ref.words)  # made again: the env trusts only what it generates
    if isinstance(ref, str):
        return make_task(*parse_task_id(ref))
    if isinstance(ref, Mapping):
        if isinstance(ref.get("id"), str):
            return make_task(*parse_task_id(ref["id"]))
        level, seed, words = ref.get("level"), ref.get("seed"), ref.get("words", WORDS)
        if isinstance(level, int) and isinstance(seed, int) and isinstance(words, int):
            return make_task(level, seed, words)
    raise TaskError(f"a lookup task is an id (lookup-LEVEL-SEED) or a record with one, got {ref!r}")


def task_ids(split: str = "train", n: int = 100, levels: Sequence[int] = LEVELS, start: int = 0,
             words: int = WORDS, distinct: bool = False) -> list[str]:
    """``n`` task ids of ``split``, the levels taking turns: seeds ``base + start``, ``base + start + 1``, ...
    (``base``: ``split_base``); disjoint ``start`` ranges give disjoint seeds. ``distinct``: skip a seed whose task
    is one listed already (same ``content``), so that each task is counted once in an evaluation; then fewer than
    ``n`` come back when the split has fewer distinct tasks (level 0 has one per (name, code) pair)."""
    base = split_base(split)
    if not levels or any(lv not in LEVELS for lv in levels):
        raise ValueError(f"levels are some of {LEVELS}, got {levels!r}")
    if start < 0 or start + n > HELDOUT_SEED:
        raise ValueError(f"start and n must stay within the split's {HELDOUT_SEED} seeds")
    if not MIN_WORDS <= words <= WORDS:
        raise ValueError(f"words must be in [{MIN_WORDS}, {WORDS}], got {words!r}")
    if not distinct:
        return [task_id(levels[i % len(levels)], base + start + i, words) for i in range(n)]
    out: list[str] = []
    seen: set[tuple[Any, ...]] = set()
    for i in range(min(HELDOUT_SEED - start, 200 * n)):   # 200 seeds a task: past that, the split is exhausted
        if len(out) == n:
            break
        task = make_task(levels[len(out) % len(levels)], base + start + i, words)
        if task.content not in seen:
            seen.add(task.content)
            out.append(task.id)
    return out


def task_key(ref: Any) -> tuple[Any, ...]:
    """The identity of a task to a policy (``LookupTask.content``): the pre-flight's check that splits are apart."""
    return resolve(ref).content


def tasks(split: str = "train", n: int = 100, levels: Sequence[int] = LEVELS, start: int = 0,
          words: int = WORDS, distinct: bool = False) -> list[LookupTask]:
    return [resolve(i) for i in task_ids(split, n, levels, start, words, distinct)]


class ShellTool(SandboxTools):
    """``bash``: a shell command in the sandbox, in ``/data``; stdout and stderr together."""

    def __init__(self, box: Box, *, timeout: float = 10.0) -> None:
        super().__init__(box)
        self.timeout = timeout

    @tool(f"Run a shell command in {WORKDIR}.", {"command": {"type": "string"}}, ["command"])
    def bash(self, command: str) -> ToolOutput:
        if not command.strip():
            raise ActionError("bash: command is empty")
        return program_output(self.sandbox.exec(f"{{ {command}\n}} 2>&1", timeout=self.timeout, cwd=WORKDIR),
                              self.timeout)


class LookupEnv(SandboxEnv[LookupTask]):
    """One generated lookup task per episode (see the module docstring)."""

    workdir = WORKDIR

    def __init__(self, task: Any = None, levels: Sequence[int] = LEVELS, split: str = "train",
                 max_steps: int | None = DEFAULT_MAX_STEPS, answer_tool: bool = True, words: int = WORDS,
                 max_output: int = 1000,
                 timeout: float = 10.0, image: str = DEFAULT_IMAGE, render_mode: str | None = None,
                 api: Backend | None = None, **sandbox_kwargs: Any) -> None:
        super().__init__(api=api, max_steps=max_steps, render_mode=render_mode,
                         sandbox_kwargs={"cpus": 0.5, "memory": "256m", **sandbox_kwargs})
        if split not in SPLITS:
            raise ValueError(f"split is one of {SPLITS}, got {split!r}")
        self.levels = tuple(int(lv) for lv in levels)
        if not self.levels or any(lv not in LEVELS for lv in self.levels):
            raise ValueError(f"levels are some of {LEVELS}, got {levels!r}")
        if not MIN_WORDS <= words <= WORDS:
            raise ValueError(f"words must be in [{MIN_WORDS}, {WORDS}], got {words!r}")
        self.split, self.words = split, words
        self.observation_space = UnicodeText(MAX_OBSERVATION)
        self.action_space = UnicodeText(MAX_ACTION, min_length=1)
        self.max_output, self.timeout, self.image = max_output, timeout, image
        self.answer_tool = answer_tool
        self._default = resolve(task) if task is not None else None

    def _resolve_task(self, ref: Any) -> LookupTask:
        if ref is not None:
            return resolve(ref)
        if self._default is not None:
            return self._default
        level = self.levels[int(self.np_random.integers(len(self.levels)))]
        base = split_base(self.split)
        return make_task(level, base + int(self.np_random.integers(HELDOUT_SEED)), self.words)

    def _task_id(self, task: LookupTask) -> str:
        return task.id

    def _start_sandbox(self, task: LookupTask) -> SandboxLike:
        sb = self.api.Sandbox.create(self.image, **self.sandbox_kwargs)
        try:
            for name, content in task.files:
                sb.write_file(f"{WORKDIR}/{name}", content)
        except BaseException:
            sb.close()
            raise
        return sb

    def _make_toolbox(self) -> Toolbox:
        groups = (ShellTool(self.box, timeout=self.timeout),) + ((AnswerTool(),) if self.answer_tool else ())
        return Toolbox(*groups, max_output=self.max_output)

    def _first_observation(self, task: LookupTask) -> str:
        return task.question

    def _info(self) -> dict[str, Any]:
        return {"task": self.task.id if self.task else None, "level": self.task.level if self.task else None}

    def _act(self, action: Any) -> tuple[str, float, bool, dict[str, Any]]:
        assert self.task is not None  # step() checked that the episode started
        reply = None if self.answer_tool else _plain_reply(action)
        if reply is not None:
            text, info = f"Answer recorded: {reply}", {**self._info(), "tool": None, "error": False, "calls": [],
                                                       "steps": self.steps}
        else:
            turn = self.toolbox.run(action)
            text, info = turn.text, {**self._info(), **turn.info(), "steps": self.steps}
            if turn.ending is None:
                return text, 0.0, False, info
            reply = str(turn.ending.arguments["answer"])
        reward = self.task.score(reply)
        info.update(answer=reply, correct=reward == 1.0, expected=self.task.answer)
        return text, reward, True, info

    def grade_submission(self, submission: str) -> tuple[float, dict[str, Any]]:
        """A harness's answer is the last line it submitted, scored as the ``answer`` tool's."""
        if self.task is None:
            raise RuntimeError("grade_submission() before reset()")
        reply = _submitted(submission)
        reward = self.task.score(reply)
        return reward, {**self._info(), "answer": reply, "correct": reward == 1.0, "expected": self.task.answer}


def _submitted(submission: str) -> str:
    """The answer in a harness's submission: its last non-empty line (a harness may print more before it)."""
    lines = [ln for ln in submission.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _plain_reply(action: Any) -> str | None:
    """The text of an action that is a plain reply (no tool call, not JSON), else None."""
    if not isinstance(action, str) or action.lstrip().startswith("{"):
        return None
    msg = chat.parse_assistant(action)
    return None if msg.malformed or msg.tool_calls else msg.content


def main(argv: Iterable[str] | None = None) -> int:
    """Write task records (JSONL) of a split: ``python -m envs.lookup_env --split heldout --n 60 --levels 1,2``."""
    p = argparse.ArgumentParser(prog="python -m envs.lookup_env", description=main.__doc__)
    p.add_argument("--split", choices=SPLITS, default="train")
    p.add_argument("--n", type=int, default=100)
    p.add_argument("--levels", default=",".join(map(str, LEVELS)), help="comma-separated, e.g. 1,2")
    p.add_argument("--start", type=int, default=0, help="first seed offset within the split")
    p.add_argument("--words", type=int, default=WORDS, help=f"names and codes to draw from ({MIN_WORDS}-{WORDS})")
    p.add_argument("--distinct", action="store_true", help="each task once (no two with the same content)")
    a = p.parse_args(list(argv) if argv is not None else None)
    for t in tasks(a.split, a.n, [int(x) for x in a.levels.split(",")], a.start, a.words, a.distinct):
        sys.stdout.write(json.dumps(t.to_json()) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
