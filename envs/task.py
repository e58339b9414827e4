"""The task record (SWE-bench instance fields plus what running it here needs) and its loaders.

One task type for every dataset's records, loaded as they are published (``envs.datasets`` says, per dataset,
what its fields become: SWE-bench 4.x and 5.x, SWE-Gym, SWE-smith, R2E-Gym, SWE-rebench, SWE-bench-extra, and
agentenv's own). A task file is JSONL (one record a line), JSON (a list of records, or ``{"tasks": [...]}``) or
Parquet (a file, or a folder of them as the Hugging Face hub lays them out); a ``datasets.Dataset`` loads too.
``FAIL_TO_PASS`` and ``PASS_TO_PASS`` may be lists or JSON-encoded lists, ``version`` a string or a number, fields
this module does not know (``created_at``, ...) are kept in ``metadata``, and the dataset a record comes from is
detected from its fields or named by the caller (``dataset=``) and kept in ``Task.dataset``. The fields such
files lack have defaults (or can be given as ``defaults``):

- ``image``: the one the record names (``image``, or its dataset's own field), else its dataset's naming rule
  (``envs.datasets.rules``); agentenv's own rule (``image_name``) is ``agentenv/swe-<name>:<version>``, where
  ``pypi/NAME`` gives ``NAME`` and ``OWNER/NAME`` gives ``OWNER__NAME`` (lowercased), e.g. ``astropy/astropy`` 4.3
  -> ``agentenv/swe-astropy__astropy:4.3``: what ``agentenv tasks images`` builds;
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

from agentenv.config import write_atomic
from envs.datasets import DATASETS, RecordError, SourceError, adapt, agentenv_image, read_records

SWE_FIELDS = ("repo", "instance_id", "base_commit", "patch", "test_patch", "problem_statement", "hints_text",
              "FAIL_TO_PASS", "PASS_TO_PASS", "version", "environment_setup_commit")
# "pytest": ours (grading.PARSERS); the others: the official swebench 5 parsers of Python repositories, by the names
# SWE-bench 5 rows and SWE-rebench's install_config carry (run in the official process; a unit test checks the names)
LOG_PARSERS = ("pytest", "parse_log_pytest", "parse_log_pytest_options", "parse_log_pytest_v2", "parse_log_django",
               "parse_log_sympy", "parse_log_matplotlib", "parse_log_seaborn", "parse_log_astroid", "parse_log_flask",
               "parse_log_marshmallow", "parse_log_pvlib", "parse_log_pyvista", "parse_log_sqlfluff",
               "parse_log_xarray", "parse_log_pydicom", "parse_log_requests", "parse_log_pylint", "parse_log_astropy",
               "parse_log_scikit", "parse_log_sphinx")
EVAL_TYPES = ("", "pass_and_fail", "fail_only")  # SWE-bench 5's eval_type ("" where the record has none)
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
    log_parser: str = "pytest"      # ours ("pytest"), a dataset harness's (parse_log_django, ...), or "" (by repo)
    metadata: Mapping[str, Any] = field(default_factory=dict)
    # what the datasets add (envs.datasets: which published field each comes from)
    dataset: str = "agentenv"       # the dataset the record came from (envs.datasets.DATASETS)
    bug_patch: str = ""             # applied at reset, before the agent (SWE-smith's published patch); then
                                    # `patch`, the gold fix, is its reverse
    eval_script: str = ""           # SWE-bench 5: the eval script as published
    eval_type: str = ""             # SWE-bench 5: "pass_and_fail" or "fail_only"
    install_config: Mapping[str, Any] = field(default_factory=dict)  # SWE-rebench: test_cmd, log_parser, ...
    expected_output_json: str = ""  # R2E-Gym: the exact map test -> status the tests must give, as published
    hidden_paths: tuple[str, ...] = ()  # absolute paths removed from the agent's sandbox at reset (R2E-Gym's
                                        # /r2e_tests): grading puts them back from the image

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

    @property
    def expected_output(self) -> dict[str, str]:
        """R2E-Gym's expected map (test -> status); empty for the other datasets."""
        return dict(json.loads(self.expected_output_json)) if self.expected_output_json else {}

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["FAIL_TO_PASS"], d["PASS_TO_PASS"] = list(self.FAIL_TO_PASS), list(self.PASS_TO_PASS)
        d["setup_commands"], d["metadata"] = list(self.setup_commands), dict(self.metadata)
        d["hidden_paths"], d["install_config"] = list(self.hidden_paths), dict(self.install_config)
        return d

    @classmethod
    def from_json(cls, record: Any, *, defaults: Mapping[str, Any] | None = None, where: str | None = None,
                  dataset: str | None = None) -> Task:
        """Validate one record, as its dataset publishes it (``dataset``: detected from its fields when None;
        see ``envs.datasets``), into a Task."""
        if not isinstance(record, Mapping):
            raise TaskError(f"a task record must be a JSON object, got {type(record).__name__}", where=where)
        rec = {**(defaults or {}), **{k: v for k, v in record.items() if v is not None}}
        raw_id = rec.get("instance_id")
        try:
            rec = adapt(rec, dataset)
        except RecordError as e:
            raise TaskError(str(e), task=raw_id if isinstance(raw_id, str) else None, field=e.field,
                            where=where) from None
        tid = rec.get("instance_id")
        if not isinstance(tid, str) or not _ID.fullmatch(tid):
            raise TaskError(f"must be a non-empty id of letters, digits and _.:+@/-, got {tid!r}",
                            task=str(tid) if tid is not None else None, field="instance_id", where=where)

        def err(f: str, msg: str) -> TaskError:
            return TaskError(msg, task=tid, field=f, where=where)

        known = {f.name for f in fields(cls)}
        out: dict[str, Any] = {"instance_id": tid}
        rec.setdefault("base_commit", HEAD)
        rec.setdefault("test_command", PYTEST_COMMAND)
        for name in ("repo", "base_commit", "patch", "problem_statement", "image", "test_command"):
            v = rec.get(name)
            if not isinstance(v, str) or not v.strip():
                raise err(name, f"required, a non-empty string; got {v!r}")
            out[name] = v
        if out["base_commit"] != HEAD and not _COMMIT.fullmatch(out["base_commit"]):
            raise err("base_commit", f"must be a git commit hash (7-40 hex digits) or {HEAD!r} (the image's "
                                     f"commit), got {out['base_commit']!r}")
        for name in ("test_patch", "hints_text", "version", "environment_setup_commit", "log_parser", "dataset",
                     "bug_patch", "eval_script", "eval_type", "expected_output_json"):
            v = rec.get(name, "" if name != "log_parser" else "pytest")
            if not isinstance(v, str):
                raise err(name, f"must be a string, got {type(v).__name__}")
            out[name] = v
        _check_dataset_fields(out, rec, err)
        for name in ("patch", "test_patch", "bug_patch"):
            if out[name] and "\n+++ " not in out[name] and not out[name].startswith("+++ "):
                raise err(name, "must be a unified diff (no '+++' header found)")
        for name in ("FAIL_TO_PASS", "PASS_TO_PASS"):
            out[name] = _str_list(rec.get(name, [] if name == "PASS_TO_PASS" else None), err, name)
        if not out["FAIL_TO_PASS"] and not out["expected_output_json"]:
            raise err("FAIL_TO_PASS", "needs at least one test (a task nothing can fail is not a task)")
        both = set(out["FAIL_TO_PASS"]) & set(out["PASS_TO_PASS"])
        if both:
            raise err("PASS_TO_PASS", f"tests listed in FAIL_TO_PASS too: {sorted(both)[:3]}")
        out["setup_commands"] = _str_list(rec.get("setup_commands", []), err, "setup_commands")
        out["hidden_paths"] = _str_list(rec.get("hidden_paths", []), err, "hidden_paths")
        for p in out["hidden_paths"]:
            if not p.startswith("/") or "/../" in p + "/" or p.rstrip("/") in ("", "/testbed"):
                raise err("hidden_paths", f"an absolute path inside the sandbox (not / or /testbed itself), got {p!r}")
        meta = rec.get("metadata", {})
        if not isinstance(meta, Mapping):
            raise err("metadata", f"must be an object, got {type(meta).__name__}")
        out["metadata"] = dict(meta)
        extra = {k: rec[k] for k in rec if k not in known}
        if extra:  # SWE-bench files carry more (created_at, ...): keep them, unvalidated
            out["metadata"] = {**extra, **out["metadata"]}
        return cls(**out)


def image_name(repo: str, version: str) -> str:
    """agentenv's own image rule: what a task of ``repo`` at ``version`` runs in when its record names none (see
    the module doc; the other datasets' rules are in ``envs.datasets.rules``)."""
    return agentenv_image(repo, version)


def _check_dataset_fields(out: dict[str, Any], rec: Mapping[str, Any], err: Any) -> None:
    """The fields the datasets add: their types and values (``envs.datasets``)."""
    if out["dataset"] not in DATASETS:
        raise err("dataset", f"unknown dataset {out['dataset']!r}; known: {', '.join(DATASETS)}")
    parser = out["log_parser"]
    if (parser or out["dataset"] == "agentenv") and parser not in LOG_PARSERS:
        raise err("log_parser", f"unknown parser {parser!r}; known: {', '.join(LOG_PARSERS)}"
                                + ("" if out["dataset"] == "agentenv" else ", or \"\" (SWE-bench 4: by repository)"))
    if out["eval_type"] not in EVAL_TYPES:
        raise err("eval_type", f"must be one of {EVAL_TYPES[1:]}, got {out['eval_type']!r}")
    config = rec.get("install_config", {})
    if not isinstance(config, Mapping):
        raise err("install_config", f"must be an object, got {type(config).__name__}")
    out["install_config"] = dict(config)
    if out["expected_output_json"]:
        try:
            expected = json.loads(out["expected_output_json"])
        except ValueError as e:
            raise err("expected_output_json", f"not valid JSON: {e}") from None
        if not isinstance(expected, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                     for k, v in expected.items()):
            raise err("expected_output_json", "must be a JSON object of test -> status (strings)")
        if not expected:
            raise err("expected_output_json", "names no test (a task nothing can fail is not a task)")


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


def load_records(source: Any) -> list[tuple[str, Any]]:
    """The raw records of a task file (JSONL, JSON, Parquet) or a ``datasets.Dataset``, with where each was read,
    as plain JSON values (what ``reset(options={"task": ...})`` and Ray workers are given)."""
    try:
        return read_records(source)
    except SourceError as e:
        raise TaskError(str(e).removeprefix(f"{e.where}: ") if e.where else str(e), where=e.where) from None


def load_tasks(source: str | Path | Any, *, defaults: Mapping[str, Any] | None = None,
               dataset: str | None = None) -> list[Task]:
    """Every task of a JSONL / JSON / Parquet file or a ``datasets.Dataset``, validated (``dataset``: the dataset
    the records come from, detected per record when None); duplicate ids are an error."""
    where = str(source) if isinstance(source, str | Path) else type(source).__name__
    return _unique([Task.from_json(r, defaults=defaults, where=w, dataset=dataset)
                    for w, r in load_records(source)], where)


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
    write_atomic(path, "".join(json.dumps(t.to_json(), sort_keys=True) + "\n" for t in tasks))


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
