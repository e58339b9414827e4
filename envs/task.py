"""The task record (SWE-bench instance fields plus what running it here needs) and its loaders.

A task file is JSONL (one record a line) or JSON (a list of records, or ``{"tasks": [...]}``) in
the SWE-bench shape, so SWE-bench, SWE-Gym or SWE-smith style files load as they are published:
``FAIL_TO_PASS`` and ``PASS_TO_PASS`` may be lists or JSON-encoded lists (as in the Hugging Face
datasets), fields this module does not know (``created_at``, ...) are kept in ``metadata``, and the
fields such files lack have defaults (or can be given as ``defaults``):

- ``image``: named from the repository and version (``image_name``): ``agentenv/swe-<name>:<version>``,
  where ``pypi/NAME`` gives ``NAME`` and ``OWNER/NAME`` gives ``OWNER__NAME`` (lowercased), e.g.
  ``astropy/astropy`` 4.3 -> ``agentenv/swe-astropy__astropy:4.3``; what ``python -m envs.tasks images``
  builds for a library of that name (or ``"repo"``) and version;
- ``test_command``: ``PYTEST_COMMAND`` (pytest with the ``-rA`` summary the ``pytest`` log parser reads);
- ``base_commit``: ``"HEAD"`` (also when omitted) means the commit /testbed is at once the image is
  started and the setup commands have run; it is resolved at reset (``envs.task_sandbox.start_task``).

Validation errors name the file, the line, the task and the field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

SWE_FIELDS = ("repo", "instance_id", "base_commit", "patch", "test_patch", "problem_statement", "hints_text",
              "FAIL_TO_PASS", "PASS_TO_PASS", "version", "environment_setup_commit")
# "pytest": ours (grading.PARSERS); the others: the official swebench 5 parsers of Python repositories, by the names
# SWE-bench 5 rows and SWE-rebench's install_config carry (run in the official process; a unit test checks the names)
LOG_PARSERS = ("pytest", "parse_log_pytest", "parse_log_pytest_options", "parse_log_pytest_v2", "parse_log_django",
               "parse_log_sympy", "parse_log_matplotlib", "parse_log_seaborn", "parse_log_astroid", "parse_log_flask",
               "parse_log_marshmallow", "parse_log_pvlib", "parse_log_pyvista", "parse_log_sqlfluff",
               "parse_log_xarray", "parse_log_pydicom", "parse_log_requests", "parse_log_pylint", "parse_log_astropy",
               "parse_log_scikit", "parse_log_sphinx")
HEAD = "HEAD"  # a base_commit that means "the commit the image's /testbed is at" (resolved at reset)
PYTEST_COMMAND = ("python3 -m pytest -p no:cacheprovider -o addopts= -rA --tb=short --color=no "
                  "-W ignore::DeprecationWarning {tests}")
_COMMIT = re.compile(r"[0-9a-f]{7,40}")
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:+@/-]*")


class TaskError(ValueError):
    """A task record is invalid; the message names where (file, line), the task and the field."""

    def __init__(self, message: str, *, task: str | None = None, field: str | None = None,
                 where: str | None = None) -> None:
        self.task, self.field, self.where = task, field, where
        parts = [p for p in (where, f"task {task!r}" if task else None, f"field {field!r}" if field else None) if p]
        super().__init__(f"{': '.join(parts)}: {message}" if parts else message)


@dataclass(frozen=True)
class Task:
    """One SWE-style task: a repository at a base commit, a bug, and the tests that judge a fix."""

    instance_id: str
    repo: str
    base_commit: str                # a commit hash, or HEAD: the image's (resolved at reset, see start_task)
    patch: str                      # the gold fix (a unified diff against base_commit)
    test_patch: str                 # applied before grading ("" when the tests are already there)
    problem_statement: str
    FAIL_TO_PASS: tuple[str, ...]
    PASS_TO_PASS: tuple[str, ...]
    image: str                      # environment image: the repository at /testbed, dependencies installed
    test_command: str               # shell command run in /testbed; "{tests}" is replaced by the test files
    hints_text: str = ""
    version: str = ""
    environment_setup_commit: str = ""
    setup_commands: tuple[str, ...] = ()  # run in /testbed at reset; must leave HEAD at base_commit
    log_parser: str = "pytest"
    metadata: Mapping[str, Any] = field(default_factory=dict)

    @property
    def base_is_head(self) -> bool:
        """The base commit is the image's HEAD, not known until a sandbox of the image runs."""
        return self.base_commit == HEAD

    @property
    def gold_files(self) -> list[str]:
        """The files the gold patch touches, in order."""
        return diff_paths(self.patch)

    @property
    def test_files(self) -> list[str]:
        """The files holding the FAIL_TO_PASS and PASS_TO_PASS tests, in first-seen order."""
        seen: dict[str, None] = {}
        for t in (*self.FAIL_TO_PASS, *self.PASS_TO_PASS):
            seen.setdefault(t.split("::", 1)[0], None)
        return list(seen)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["FAIL_TO_PASS"], d["PASS_TO_PASS"] = list(self.FAIL_TO_PASS), list(self.PASS_TO_PASS)
        d["setup_commands"], d["metadata"] = list(self.setup_commands), dict(self.metadata)
        return d

    @classmethod
    def from_json(cls, record: Any, *, defaults: Mapping[str, Any] | None = None, where: str | None = None) -> Task:
        """Validate one record (a dict in the SWE-bench shape) into a Task."""
        if not isinstance(record, Mapping):
            raise TaskError(f"a task record must be a JSON object, got {type(record).__name__}", where=where)
        rec = {**(defaults or {}), **{k: v for k, v in record.items() if v is not None}}
        tid = rec.get("instance_id")
        if not isinstance(tid, str) or not _ID.fullmatch(tid):
            raise TaskError(f"must be a non-empty id of letters, digits and _.:+@/-, got {tid!r}",
                            task=str(tid) if tid is not None else None, field="instance_id", where=where)

        def err(f: str, msg: str) -> TaskError:
            return TaskError(msg, task=tid, field=f, where=where)

        known = {f.name for f in fields(cls)}
        out: dict[str, Any] = {"instance_id": tid}
        if isinstance(rec.get("version"), int | float) and not isinstance(rec.get("version"), bool):
            rec["version"] = str(rec["version"])  # some dumps publish 3.0 as a number
        rec.setdefault("base_commit", HEAD)
        rec.setdefault("test_command", PYTEST_COMMAND)
        if "image" not in rec and isinstance(rec.get("repo"), str) and rec["repo"].strip():
            if not isinstance(rec.get("version"), str) or not rec["version"].strip():
                raise err("image", "required when the record has no 'version' (the image is named from the "
                                   "repository and version: agentenv/swe-<name>:<version>)")
            rec["image"] = image_name(rec["repo"], rec["version"])
        for name in ("repo", "base_commit", "patch", "problem_statement", "image", "test_command"):
            v = rec.get(name)
            if not isinstance(v, str) or not v.strip():
                raise err(name, f"required, a non-empty string; got {v!r}")
            out[name] = v
        if out["base_commit"] != HEAD and not _COMMIT.fullmatch(out["base_commit"]):
            raise err("base_commit", f"must be a git commit hash (7-40 hex digits) or {HEAD!r} (the image's "
                                     f"commit), got {out['base_commit']!r}")
        for name in ("test_patch", "hints_text", "version", "environment_setup_commit", "log_parser"):
            v = rec.get(name, "" if name != "log_parser" else "pytest")
            if not isinstance(v, str):
                raise err(name, f"must be a string, got {type(v).__name__}")
            out[name] = v
        if out["log_parser"] not in LOG_PARSERS:
            raise err("log_parser", f"unknown parser {out['log_parser']!r}; known: {', '.join(LOG_PARSERS)}")
        for name in ("patch", "test_patch"):
            if out[name] and "\n+++ " not in out[name] and not out[name].startswith("+++ "):
                raise err(name, "must be a unified diff (no '+++' header found)")
        for name in ("FAIL_TO_PASS", "PASS_TO_PASS"):
            out[name] = _str_list(rec.get(name, [] if name == "PASS_TO_PASS" else None), err, name)
        if not out["FAIL_TO_PASS"]:
            raise err("FAIL_TO_PASS", "needs at least one test (a task nothing can fail is not a task)")
        both = set(out["FAIL_TO_PASS"]) & set(out["PASS_TO_PASS"])
        if both:
            raise err("PASS_TO_PASS", f"tests listed in FAIL_TO_PASS too: {sorted(both)[:3]}")
        out["setup_commands"] = _str_list(rec.get("setup_commands", []), err, "setup_commands")
        meta = rec.get("metadata", {})
        if not isinstance(meta, Mapping):
            raise err("metadata", f"must be an object, got {type(meta).__name__}")
        out["metadata"] = dict(meta)
        extra = {k: rec[k] for k in rec if k not in known}
        if extra:  # SWE-bench files carry more (created_at, ...): keep them, unvalidated
            out["metadata"] = {**extra, **out["metadata"]}
        return cls(**out)


def image_name(repo: str, version: str) -> str:
    """The image a task of ``repo`` at ``version`` runs in when its record names none (see the module doc)."""
    name = repo.strip()
    name = name[len("pypi/"):] if name.startswith("pypi/") else name.replace("/", "__")
    name = re.sub(r"[^a-z0-9._-]+", "-", name.lower())
    return f"agentenv/swe-{name}:{re.sub(r'[^A-Za-z0-9_.-]+', '-', version.strip())}"


def diff_paths(patch: str) -> list[str]:
    """Paths a unified diff touches (its ``--- a/...`` and ``+++ b/...`` headers), in order."""
    found: dict[str, None] = {}
    for line in patch.splitlines():
        if line.startswith(("+++ ", "--- ")):
            path = line[4:].split("\t", 1)[0].strip()
            if path != "/dev/null":
                found.setdefault(path[2:] if path[:2] in ("a/", "b/") else path, None)
    return list(found)


def _str_list(v: Any, err: Any, name: str) -> tuple[str, ...]:
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError:
            raise err(name, "a string here must be a JSON-encoded list of strings") from None
    if not isinstance(v, list | tuple) or not all(isinstance(x, str) and x for x in v):
        raise err(name, f"must be a list of non-empty strings, got {v!r}"[:300])
    return tuple(v)


def load_tasks(path: str | Path, *, defaults: Mapping[str, Any] | None = None) -> list[Task]:
    """Every task in a JSONL or JSON file, validated; duplicate ids are an error."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise TaskError(f"cannot read the task file: {e}", where=str(p)) from None
    records: list[tuple[str, Any]] = []
    stripped = text.lstrip()
    if p.suffix == ".json" or stripped.startswith("["):
        try:
            data = json.loads(text)
        except ValueError as e:
            raise TaskError(f"not valid JSON: {e}", where=str(p)) from None
        if isinstance(data, Mapping) and "tasks" in data:
            data = data["tasks"]
        if isinstance(data, Mapping):
            data = [data]
        if not isinstance(data, list):
            raise TaskError("a JSON task file holds a list of task records", where=str(p))
        records = [(f"{p}[{i}]", r) for i, r in enumerate(data)]
    else:
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append((f"{p}:{n}", json.loads(line)))
            except ValueError as e:
                raise TaskError(f"not valid JSON: {e}", where=f"{p}:{n}") from None
    return _unique([Task.from_json(r, defaults=defaults, where=w) for w, r in records], str(p))


def _unique(tasks: Iterable[Task], where: str) -> list[Task]:
    seen: set[str] = set()
    out = []
    for t in tasks:
        if t.instance_id in seen:
            raise TaskError("duplicate instance_id", task=t.instance_id, field="instance_id", where=where)
        seen.add(t.instance_id)
        out.append(t)
    return out


def write_tasks(tasks: Iterable[Task], path: str | Path) -> None:
    """Write tasks as JSONL (sorted keys, one record a line)."""
    p = Path(path)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text("".join(json.dumps(t.to_json(), sort_keys=True) + "\n" for t in tasks))
    tmp.replace(p)


SHIPPED = Path(__file__).with_name("tasks") / "swe_tasks.jsonl"


def shipped_tasks() -> list[Task]:
    """The task set built from real libraries that ships with envs (see envs/tasks)."""
    return load_tasks(SHIPPED)


def resolve_task(task: Task | str | Mapping[str, Any]) -> Task:
    """A Task from a Task, a record, a shipped task id, or ``path`` / ``path::instance_id`` of a task file."""
    if isinstance(task, Task):
        return task
    if isinstance(task, Mapping):
        return Task.from_json(task)
    if not isinstance(task, str) or not task:
        raise TaskError(f"a task is a Task, a record, an id or a file path, got {task!r}")
    path, _, tid = task.partition("::")
    if Path(path).is_file():
        tasks = load_tasks(path)
        if not tid:
            if len(tasks) != 1:
                raise TaskError(f"holds {len(tasks)} tasks: name one as '{path}::<instance_id>'", where=path)
            return tasks[0]
    else:
        tasks, tid = shipped_tasks(), task
    for t in tasks:
        if t.instance_id == tid:
            return t
    raise TaskError(f"no task {tid!r} (known: {', '.join(t.instance_id for t in tasks[:5])}, ...)")
