"""SWE-bench grading in a sandbox: apply the test patch, run the tests, parse the log, decide.

A task is resolved when every FAIL_TO_PASS test passes and every PASS_TO_PASS test still passes
(a test missing from the log counts as failed). Before the tests run, the test files the task names
(and those the test patch touches) are put back as they are at the base commit, so an edit to the
tests cannot pass them.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentenv.api import SandboxLike
from envs.task import Task

WORKDIR = "/testbed"
PASSING = frozenset({"PASSED", "XFAIL"})
STATUSES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")
_SUMMARY = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS) (.+)$")
_TEST_PATCH_PATH = "/tmp/.agentenv_test.patch"


def _split_message(rest: str) -> tuple[str, str]:
    """'path::test[param - x] - message' -> (test id, message); the id may hold ' - ' inside brackets."""
    start = rest.rfind("]") if "[" in rest.split(" - ", 1)[0] else 0
    cut = rest.find(" - ", max(start, 0))
    return (rest, "") if cut < 0 else (rest[:cut], rest[cut + 3:])


def parse_pytest(log: str) -> dict[str, str]:
    """Test id -> status from pytest's ``-rA`` short summary (PASSED/FAILED/ERROR/XFAIL/XPASS lines).

    A file-level ERROR (a collection error) is kept under the file's path.
    """
    out: dict[str, str] = {}
    for line in log.splitlines():
        m = _SUMMARY.match(line.rstrip())
        if not m:
            continue
        status, rest = m.groups()
        test_id = rest if status == "PASSED" else _split_message(rest)[0]
        if status == "XPASS" and " " in test_id and "[" not in test_id:
            test_id = test_id.split(" ", 1)[0]
        if out.get(test_id) in ("FAILED", "ERROR") and status == "ERROR":
            continue  # a teardown error after a failure: keep the failure
        if out.get(test_id) == "PASSED" and status == "ERROR":
            out[test_id] = "ERROR"  # passed, then its teardown failed
            continue
        out.setdefault(test_id, status)
    return out


def failure_messages(log: str) -> dict[str, str]:
    """Test id -> the one-line message of each FAILED/ERROR line in pytest's ``-rA`` summary."""
    out: dict[str, str] = {}
    for line in log.splitlines():
        m = _SUMMARY.match(line.rstrip())
        if m and m.group(1) in ("FAILED", "ERROR"):
            tid, msg = _split_message(m.group(2))
            out.setdefault(tid, msg)
    return out


PARSERS: dict[str, Callable[[str], dict[str, str]]] = {"pytest": parse_pytest}


def parse_log(parser: str, log: str) -> dict[str, str]:
    try:
        return PARSERS[parser](log)
    except KeyError:
        raise ValueError(f"unknown log parser {parser!r}; known: {', '.join(PARSERS)}") from None


def decide(task: Task, statuses: dict[str, str]) -> tuple[bool, dict[str, str], dict[str, str]]:
    """(resolved, FAIL_TO_PASS results, PASS_TO_PASS results); absent tests are 'MISSING'."""
    f2p = {t: statuses.get(t, "MISSING") for t in task.FAIL_TO_PASS}
    p2p = {t: statuses.get(t, "MISSING") for t in task.PASS_TO_PASS}
    resolved = all(s in PASSING for s in f2p.values()) and all(s in PASSING for s in p2p.values())
    return resolved, f2p, p2p


def patch_files(patch: str) -> list[str]:
    """Paths a unified diff touches (its ``+++ b/...`` and ``--- a/...`` headers)."""
    found: dict[str, None] = {}
    for line in patch.splitlines():
        if line.startswith(("+++ ", "--- ")):
            path = line[4:].split("\t", 1)[0].strip()
            if path != "/dev/null":
                found.setdefault(path[2:] if path[:2] in ("a/", "b/") else path, None)
    return list(found)


@dataclass(frozen=True)
class GradeResult:
    resolved: bool
    fail_to_pass: dict[str, str]
    pass_to_pass: dict[str, str]
    patch: str                      # the model's changes: `git diff` against the base commit
    exit_code: int = 0
    timed_out: bool = False
    error: str = ""                 # why grading could not run the tests (e.g. the test patch did not apply)
    log_tail: str = field(default="", repr=False)

    @property
    def reward(self) -> float:
        return 1.0 if self.resolved else 0.0

    def to_info(self) -> dict[str, Any]:
        return {"resolved": self.resolved, "FAIL_TO_PASS": dict(self.fail_to_pass),
                "PASS_TO_PASS": dict(self.pass_to_pass), "patch": self.patch, "grade_error": self.error,
                "tests_timed_out": self.timed_out}


def model_patch(sandbox: SandboxLike, task: Task) -> str:
    """Every change in /testbed since the base commit, new files included (binary-safe git diff)."""
    r = sandbox.exec(f"git add -A && git diff --cached --binary {shlex.quote(task.base_commit)}",
                     timeout=120, cwd=WORKDIR)
    return str(r.stdout) if r.exit_code == 0 else ""


def grade(sandbox: SandboxLike, task: Task, *, timeout: float = 900.0) -> GradeResult:
    """Grade the sandbox's /testbed as SWE-bench does; leaves the test files at base + test patch."""
    patch = model_patch(sandbox, task)
    files = list(dict.fromkeys([*task.test_files, *patch_files(task.test_patch)]))
    base = shlex.quote(task.base_commit)
    restore = " ; ".join(
        f"if git cat-file -e {base}:{shlex.quote(f)} 2>/dev/null; then git checkout -q {base} -- {shlex.quote(f)};"
        f" else rm -f -- {shlex.quote(f)}; fi" for f in files) or "true"
    r = sandbox.exec(restore, timeout=120, cwd=WORKDIR)
    if r.exit_code != 0:
        return _failed(task, patch, f"could not restore the test files: {(r.stdout + r.stderr)[-500:]}")
    if task.test_patch:
        sandbox.write_file(_TEST_PATCH_PATH, task.test_patch)
        r = sandbox.exec(f"git apply --whitespace=nowarn {_TEST_PATCH_PATH}; rc=$?; rm -f {_TEST_PATCH_PATH};"
                         " exit $rc", timeout=120, cwd=WORKDIR)
        if r.exit_code != 0:
            return _failed(task, patch, f"the test patch does not apply: {(r.stdout + r.stderr)[-500:]}")
    command = task.test_command.replace("{tests}", " ".join(shlex.quote(f) for f in task.test_files))
    r = sandbox.exec(command, timeout=timeout, cwd=WORKDIR)
    log = r.stdout + r.stderr
    statuses = parse_log(task.log_parser, log)
    resolved, f2p, p2p = decide(task, statuses)
    return GradeResult(resolved=resolved and not r.timed_out, fail_to_pass=f2p, pass_to_pass=p2p, patch=patch,
                       exit_code=r.exit_code, timed_out=r.timed_out,
                       error=f"the tests timed out after {timeout:g} s" if r.timed_out else "",
                       log_tail=log[-4000:])


def _failed(task: Task, patch: str, why: str) -> GradeResult:
    return GradeResult(resolved=False, fail_to_pass={t: "MISSING" for t in task.FAIL_TO_PASS},
                       pass_to_pass={t: "MISSING" for t in task.PASS_TO_PASS}, patch=patch, exit_code=-1,
                       error=why)
