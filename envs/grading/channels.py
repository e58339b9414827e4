"""Hardened channels for test runners other than pytest: Django's ``tests/runtests.py`` and SymPy's ``bin/test``.

pytest's hardened channel is its JUnit file in the grading folder (``envs.grading.results``). These runners write no
such file, and their text log is what a patch can forge (Django's `` ... ok`` lines, SymPy's ``test_x ok``): every
defence the pytest channel has is extended to them here, on the host's side; the guard's side is
``sandbox_runners.py`` (modes ``unittest`` and ``sympy``) and ``sandbox_solo.py`` (the isolated run).

- **the runner, started by the guard**: ``channel_for(command)`` reads a test command as one of these runners
  (``./tests/runtests.py ARGS`` / ``python tests/runtests.py ARGS``: Django's; ``[VAR=value ...] bin/test ARGS``:
  SymPy's) and says how the guard runs it (``mode``, ``script``, ``args``): the same program, under the audit hook
  and the sealed signals, with a recorder of its outcomes;
- **results where the code under test cannot reach**: the recorder writes ``results.json`` into the grading folder
  once the runner returns (``read_results``): statuses keyed as the dataset keys its tests (Django's ``test_x
  (module.Class.test_x)`` or docstring line; SymPy's function names), read from the runner's own result objects, not
  from its text; the official parser's verdict on the text is recorded beside it by the grader;
- **the runner's files and the tests restored**: ``protected(task)`` lists, per runner, the files a patch may not
  change (``test-config``: the runner, its settings and its test machinery — ``tests/runtests.py``,
  ``tests/test_sqlite.py``, ``django/test/``; ``bin/``, ``sympy/testing/``) and the test suite (``test``: Django's
  ``tests/``, SymPy's ``*/tests/``), on top of the rules every runner has (``conftest.py``, ``sitecustomize.py``,
  ``*.pth``: ``envs.grading.patch``); files the gold patch itself changes stay exempt;
- **the isolated run**: ``solo_config`` tells the second guarded interpreter which runner's ids it resolves and
  how to set the runner up (Django's test modules and settings; SymPy's test files and ``SYMPY_USE_CACHE``);
  each FAIL_TO_PASS test is called alone (Django's: as ``debug()`` runs it, nothing caught), its verdict signed
  with the grading's secret (``envs.grading.isolation``);
- **canaries**: ``canaries`` derives them from the tests of the first FAIL_TO_PASS test's file — copies of a test
  method of its ``TestCase`` class with the first assertion's opposite before it (Django; ``canary.derive_methods``)
  or of a module-level test function (SymPy; ``canary.derive``) — named, for the recorder, by ``test.id()``
  (``module.Class.name``) or by function name.

What does not carry over, and why (text for docs/security.md): Django's recorder sees outcomes through
``unittest.TestResult``'s methods, in the process where the patch's code runs; a patch that reaches the recorder's
table there (its functions are class attributes of ``TestResult``) can rewrite PASS_TO_PASS statuses that the
isolated run does not call — what the canaries and the audit hook are for, as with pytest's reports. The isolated
run calls only plain test methods (no decorator: ``@override_settings``, ``@skipUnless...``, ``@isolate_apps``
tests and classes rest on the canaries and the hook) of the test modules the command names.
"""

from __future__ import annotations

import json
import posixpath
import random
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from envs.grading import canary
from envs.task import Task

RESULTS_FILE = "results.json"
Kind = Literal["django", "sympy"]
# what a patch may not change, per runner: fnmatch patterns (``*`` matches across folders)
RUNNER_FILES: dict[str, tuple[str, ...]] = {
    "django": ("tests/runtests.py", "tests/test_sqlite.py", "tests/urls.py", "django/test/*"),
    "sympy": ("bin/*", "sympy/testing/*", "sympy/utilities/runtests.py", "sympy/utilities/pytest.py"),
}
TEST_FILES: dict[str, tuple[str, ...]] = {"django": ("tests/*",), "sympy": ("sympy/*/tests/*",)}
# the runner's modules the patch's code may not import (the audit hook refuses and reports it)
RUNNER_MODULES: dict[str, tuple[str, ...]] = {"django": ("runtests", "django.test.runner"),
                                              "sympy": ("sympy.testing.runtests", "sympy.utilities.runtests")}
_REPOS: dict[str, Kind] = {"django/django": "django", "sympy/sympy": "sympy"}


@dataclass(frozen=True)
class Channel:
    """One runner's command as the guard runs it."""

    kind: Kind
    script: str                             # the runner's program, relative to /testbed
    args: tuple[str, ...]                   # its arguments, as the command gives them
    assignments: tuple[str, ...] = ()       # VAR=value words before it
    settings: str = field(default="")       # Django: --settings

    @property
    def mode(self) -> str:
        """The guard's mode word (``sandbox_runners.py``)."""
        return "unittest" if self.kind == "django" else "sympy"

    @property
    def labels(self) -> list[str]:
        """The test modules (Django) or files (SymPy) the command names."""
        if self.kind == "django":
            skip = False
            out = []
            for a in self.args:
                if skip:
                    skip = False
                elif a.startswith("-"):
                    skip = a in ("--settings", "--parallel", "--verbosity", "-v", "--tag", "--exclude-tag", "-k",
                                 "--start-at", "--start-after", "--bisect", "--pair", "--shuffle", "--durations")
                else:
                    out.append(a)
            return out
        return [a for a in self.args if not a.startswith("-") and a.endswith(".py")]

    @property
    def test_files(self) -> list[str]:
        if self.kind == "django":
            return ["tests/" + label.replace(".", "/") + ".py" for label in self.labels]
        return self.labels

    def canary_file(self, task: Task) -> str:
        """The test file the canaries go in: the first FAIL_TO_PASS test's (Django: its module, when its id names
        it), else the command's first."""
        files = self.test_files
        first = task.FAIL_TO_PASS[0] if task.FAIL_TO_PASS else ""
        if self.kind == "django" and first.endswith(")") and " (" in first:
            dotted = first.rsplit(" (", 1)[1][:-1]
            for label in self.labels:
                if dotted.startswith(label + "."):
                    return "tests/" + label.replace(".", "/") + ".py"
        return files[0] if files else ""

    def canaries(self, source: str, task: Task, test_file: str,
                 rng: random.Random | None = None) -> tuple[str, list[str]]:
        """The test file with canaries in it, and their ids as the recorder keys them ([] when none fit)."""
        if self.kind == "sympy":
            derived = canary.derive(source, rng=rng)
            if derived is None:
                name = f"test_{secrets.token_hex(8)}"
                return source + canary.plain(name), [name]
            return derived.source, list(derived.names)
        first = task.FAIL_TO_PASS[0] if task.FAIL_TO_PASS else ""
        prefer = ""
        if first.endswith(")") and " (" in first:  # test_x (module.Class.test_x), or (module.Class) before 3.11
            name, dotted = first[:-1].rsplit(" (", 1)
            parts = dotted.split(".")
            prefer = parts[-2] if parts[-1] == name.strip() and len(parts) > 1 else parts[-1]
        methods = canary.derive_methods(source, prefer_class=prefer, rng=rng) or canary.plain_method(
            source, prefer, f"test_{secrets.token_hex(8)}")
        if methods is None:
            return source, []
        module = test_file.removeprefix("tests/").removesuffix(".py").replace("/", ".")
        return methods.source, [f"{module}.{cls}.{name}" for cls, name in methods.methods]

    def solo_config(self) -> dict[str, Any]:
        """What the isolated run needs to resolve this runner's ids and set it up (``sandbox_solo.solo``)."""
        if self.kind == "django":
            return {"runner": "django", "labels": self.labels, "settings": self.settings or "test_sqlite",
                    "runner_modules": list(RUNNER_MODULES["django"])}
        env = {"SYMPY_USE_CACHE": "no"} if "-C" in self.args or "--no-cache" in self.args else {}
        return {"runner": "sympy", "test_files": self.test_files, "env": env,
                "runner_modules": list(RUNNER_MODULES["sympy"])}


def channel_for(words: Sequence[str], assignments: Sequence[str] = ()) -> Channel | None:
    """The channel of a test command already split into words (its ``VAR=value`` words apart), or None."""
    words = list(words)
    if words and posixpath.basename(words[0]).startswith("python") and len(words) > 1:
        words = words[1:]
    if not words:
        return None
    script = posixpath.normpath(words[0])
    if script == "tests/runtests.py":
        settings = next((w.split("=", 1)[1] for w in words if w.startswith("--settings=")), "")
        if not settings and "--settings" in words[:-1]:
            settings = words[words.index("--settings") + 1]
        return Channel("django", script, tuple(words[1:]), tuple(assignments), settings)
    if script == "bin/test":
        return Channel("sympy", script, tuple(words[1:]), tuple(assignments))
    return None


def kind_of(task: Task, command: str = "") -> Kind | None:
    """The runner a task's tests run with, read from its test command when there is one, else its repository."""
    if "tests/runtests.py" in command:
        return "django"
    if "bin/test" in command:
        return "sympy"
    return _REPOS.get(task.repo)


def protected(task: Task, command: str = "") -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(test-suite patterns, runner patterns) a patch of ``task`` may not change (see the module doc)."""
    kind = kind_of(task, command)
    if kind is None:
        return (), ()
    return TEST_FILES[kind], RUNNER_FILES[kind]


@dataclass(frozen=True)
class Results:
    """What the recorder wrote: statuses by the dataset's ids, by test id, and what it saw."""

    statuses: dict[str, str]
    ids: dict[str, str]
    recorded: bool
    blunted: tuple[str, ...]
    exit: int
    problem: str = ""               # why the file cannot be read ("" when it can)


def read_results(data: bytes) -> Results:
    """The recorder's ``results.json`` (``sandbox_runners.run_runner``)."""
    if not data:
        return Results({}, {}, False, (), -1, "the test run wrote no result file")
    try:
        doc = json.loads(data)
    except ValueError:
        return Results({}, {}, False, (), -1, "the result file is not JSON")
    if not isinstance(doc, dict) or not isinstance(doc.get("results"), dict) or not isinstance(doc.get("ids"), dict):
        return Results({}, {}, False, (), -1, "the result file has no results")
    statuses = {str(k): str(v) for k, v in doc["results"].items()}
    ids = {str(k): str(v) for k, v in doc["ids"].items()}
    blunted = tuple(str(b) for b in doc.get("blunted", []) if isinstance(doc.get("blunted"), list))
    code = doc.get("exit")
    return Results(statuses, ids, doc.get("recorded") is True, blunted, code if isinstance(code, int) else -1)


# SWE-bench's pytest parsers, by how they name a test: the first word of the node id (parse_log_pytest and those
# it stands for), that word with a path parameter cut to its last component (parse_log_pytest_options, ...)
_FIRST_WORD = frozenset({"parse_log_pytest", "parse_log_astroid", "parse_log_flask", "parse_log_marshmallow",
                         "parse_log_pvlib", "parse_log_pyvista", "parse_log_sqlfluff", "parse_log_xarray",
                         "parse_log_matplotlib"})
_OPTIONS = frozenset({"parse_log_pytest_options", "parse_log_pydicom", "parse_log_requests", "parse_log_pylint"})


def dataset_key(parser: str, nodeid: str) -> str:
    """The id SWE-bench's ``parser`` gives the pytest test ``nodeid`` (a record's FAIL_TO_PASS / PASS_TO_PASS name
    tests so): the id up to its first space (``test_x[a b]`` -> ``test_x[a``); for ``parse_log_pytest_options`` and
    those it stands for, a parameter that is an absolute path cut to its last component (``[/a/b.py]`` ->
    ``[/b.py]``); matplotlib's names its mouse buttons by number. Other parsers keep the node id."""
    if parser not in _FIRST_WORD and parser not in _OPTIONS:
        return nodeid
    if parser == "parse_log_matplotlib":
        nodeid = nodeid.replace("MouseButton.LEFT", "1").replace("MouseButton.RIGHT", "3")
    words = nodeid.split()
    key = words[0] if words else nodeid
    if parser in _OPTIONS and "[" in key and key.endswith("]"):
        main, _, option = key[:-1].partition("[")
        if option.startswith("/") and not option.startswith("//") and "*" not in option:
            key = f"{main}[/{option.rsplit('/', 1)[-1]}]"
    return key


def dataset_statuses(parser: str, statuses: dict[str, str]) -> dict[str, str]:
    """``statuses`` keyed as the dataset's parser keys them (``dataset_key``), each id's own status kept too; where
    two tests share a key, the worse status."""
    rank = {"PASSED": 0, "XFAIL": 1, "SKIPPED": 2, "XPASS": 3, "ERROR": 4, "FAILED": 5}
    out = dict(statuses)
    for tid, status in statuses.items():
        key = dataset_key(parser, tid)
        if key != tid and (key not in out or rank.get(status, 5) > rank.get(out[key], 5)):
            out[key] = status
    return out
