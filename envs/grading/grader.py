"""``grade``: the agent's patch, filtered, applied to a fresh sandbox at the task's pristine state, tested there.

What runs where:

1. the agent's sandbox: ``extract_patch`` only (a ``git diff`` read out as data; see ``envs.grading.patch``);
2. the host: ``filter_patch`` (the documented rule) decides what is graded and what is dropped;
3. a new sandbox restored from ``pristine`` — a filesystem snapshot the env took at reset, before the
   agent acted (``SWEEnv`` keeps it; without one, a sandbox is set up from the task's image) — into
   which nothing of the agent's sandbox carries over but the kept patch:

   a. the kept patch and the task's test patch are written to a folder of its own
      (``/var/lib/agentenv-grade-<random>``, mode 700, outside /testbed); the image's git lists the
      files it will touch (``git apply --numstat``), which must be exactly the kept files in order
      (else the patch does not mean the same to the grader and to git: nothing runs, reward 0), then
      applies both; links the patch made must stay inside /testbed;
   b. a canary test that must fail, under a name drawn for this grading, is appended to the file of
      the first FAIL_TO_PASS test (so nothing on pytest's command line points to it);
   c. the tests run with the image's interpreter by absolute path (resolved before the patch was
      applied), ``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1`` and only the plugins the task declares (``-p``;
      the record's ``pytest_plugins``, kept in ``task.metadata``), ``PYTHON*`` and ``PYTEST_*``
      variables cleared (``PYTHONPATH`` as the image sets it), no cache provider, and pytest asked
      for a JUnit XML file in the grading folder; when they end, every other process in the sandbox
      is killed before the file is read;
   d. statuses come from that file (``envs.grading.results``), the text log only adds XPASS and the
      failure messages; the canary must be reported FAILED (or ERROR), else the run was tampered with;
4. the grading sandbox is closed (by ``SWEEnv`` on a worker thread; ``env.close()`` waits for it).

The canary is not used when the command selects tests (``-k``, ``-m``, ``--deselect``, ``--lf``, ...) or
names no ``{tests}``. A repository whose pristine configuration does not collect ``test_*`` functions
(``python_functions``) or marks whole test modules xfail would trip it with every patch, the gold one
too: ``python -m envs.tasks validate`` shows such a task.

The task's ``test_command`` is kept when it is a plain pytest invocation (``[VAR=value ...] python3 -m
pytest ARGS``, ``pytest ARGS``): its ARGS stay (they are the task's, e.g. ``-o addopts= -W ...``) and
the grader's options are added. Any other command runs as the task gives it, with the grader's
options passed through ``PYTEST_ADDOPTS`` and without a canary. The pristine repository's own
pytest configuration is used (the patch cannot change it: ``test-config`` drops).

A task is resolved when every FAIL_TO_PASS test passes and every PASS_TO_PASS test still passes (a test
missing from the results counts as failed), as SWE-bench decides, and nothing else went wrong: the
patch was extracted within its size limit and applied, the tests did not time out, the result file
was there and well formed, and the canary held.
"""

from __future__ import annotations

import dataclasses
import posixpath
import re
import secrets
import shlex
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import agentenv
from agentenv.api import Backend, SandboxLike, SnapshotLike
from envs.grading.diff import parse_numstat
from envs.grading.patch import (
    WORKDIR,
    Dropped,
    FilteredPatch,
    PatchError,
    check_numstat,
    extract_patch,
    filter_patch,
    gold_exemptions,
    link_stays_inside,
)
from envs.grading.results import (
    MAX_RESULT_BYTES,
    PASSING,
    ResultFileError,
    junit_cases,
    merge_text,
    parse_pytest,
    statuses_from_junit,
)
from envs.task import Task

_T = TypeVar("_T")
GRADE_ROOT = "/var/lib/agentenv-grade-"
CANARY_OK = frozenset({"FAILED", "ERROR"})
_PYTHON = re.compile(r"(?:.*/)?python[0-9.]*")
_ASSIGN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*")
_SHELL_OPS = frozenset("();<>|&")
# -k / -m / --deselect select tests: the canary could be deselected, so it is not used with them
_SELECTING = ("-k", "-m", "--deselect", "--lf", "--last-failed", "--ff", "--sw", "--stepwise")


@dataclass(frozen=True)
class GradeResult:
    resolved: bool
    fail_to_pass: dict[str, str]
    pass_to_pass: dict[str, str]
    patch: str                      # the agent's change, as extracted: `git diff` against the base commit
    exit_code: int = 0
    timed_out: bool = False
    error: str = ""                 # why the grade is 0 besides the tests (the patch, the run, tampering)
    log_tail: str = field(default="", repr=False)
    dropped: tuple[Dropped, ...] = ()   # files of the patch that were not graded, and why
    tampering: bool = False         # a drop for a reason but `test`, a mismatched patch, or a tripped canary
    graded_patch: str = field(default="", repr=False)  # what was applied (the patch less `dropped`)
    canary: str = ""                # the canary test's status; "" when the run had none
    timings: Mapping[str, float] = field(default_factory=dict)  # seconds per phase

    @property
    def reward(self) -> float:
        return 1.0 if self.resolved else 0.0

    def grading_info(self) -> dict[str, Any]:
        """``info["grading"]``: what was dropped from the patch and why, tampering, the canary, timings."""
        out: dict[str, Any] = {"dropped": [d.to_info() for d in self.dropped], "tampering": self.tampering,
                               "canary": self.canary, "timings_ms": {k: round(v * 1000, 1) for k, v in
                                                                     self.timings.items()}}
        if self.dropped:
            out["graded_patch"] = self.graded_patch
        return out

    def to_info(self) -> dict[str, Any]:
        return {"resolved": self.resolved, "FAIL_TO_PASS": dict(self.fail_to_pass),
                "PASS_TO_PASS": dict(self.pass_to_pass), "patch": self.patch, "grade_error": self.error,
                "tests_timed_out": self.timed_out, "grading": self.grading_info()}

    def summary(self) -> str:
        """One line for the observation: the verdict, and what was dropped from the patch."""
        verdict = "resolved" if self.resolved else "not resolved"
        notes = []
        if self.dropped:
            notes.append("not graded: " + ", ".join(f"{d.path} ({d.reason})" for d in self.dropped[:5])
                         + (f" and {len(self.dropped) - 5} more" if len(self.dropped) > 5 else ""))
        return f"Graded: {verdict}." + (f" [{'; '.join(notes)}]" if notes else "")


def declared_plugins(task: Task) -> list[str]:
    """The pytest plugins a task declares (``"pytest_plugins": [...]`` in its record; default none)."""
    v = task.metadata.get("pytest_plugins", [])
    if isinstance(v, str):
        v = [v]
    return [p for p in v if isinstance(p, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", p)]


def protected_files(task: Task) -> list[str]:
    """The task's test files and the files its test patch touches: never taken from the agent's patch."""
    from envs.grading.diff import parse_section, split_sections

    files = list(task.test_files)
    if task.test_patch:
        for raw in split_sections(task.test_patch.encode("utf-8", "surrogateescape"))[1]:
            files += parse_section(raw).paths
    return list(dict.fromkeys(files))


def filter_for(task: Task, patch: bytes) -> FilteredPatch:
    """``filter_patch`` with the task's test files, plugins and gold-patch exemptions."""
    paths, reasons = gold_exemptions(task.patch)
    return filter_patch(patch, tests=protected_files(task), runner_modules=declared_plugins(task),
                        exempt_paths=paths, exempt_reasons=reasons)


@dataclass(frozen=True)
class Invocation:
    """How the tests are run: the pytest arguments (None: the task's own command, options via PYTEST_ADDOPTS)."""

    assignments: tuple[str, ...] = ()
    interpreter: str = ""            # the word naming python, or "pytest" for the console script
    python_flags: tuple[str, ...] = ()
    args: tuple[str, ...] | None = None

    @property
    def canary_allowed(self) -> bool:
        return self.args is not None and "{tests}" in self.args and not any(
            a == s or a.startswith(s + "=") or (s in ("-k", "-m") and a.startswith(s) and len(a) > 2)
            for a in self.args for s in _SELECTING)


def parse_test_command(command: str) -> Invocation:
    """The task's ``test_command`` as a pytest invocation the grader can run itself, when it is one."""
    try:
        lex = shlex.shlex(command, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        words = list(lex)
    except ValueError:
        return Invocation()
    if not words or any(w and set(w) <= _SHELL_OPS for w in words):
        return Invocation()
    assignments = []
    while words and _ASSIGN.fullmatch(words[0]):
        assignments.append(words.pop(0))
    if not words:
        return Invocation()
    head = words[0]
    if posixpath.basename(head) in ("pytest", "py.test"):
        return Invocation(tuple(assignments), "pytest", (), tuple(words[1:]))
    if _PYTHON.fullmatch(head):
        i = 1
        while i < len(words):
            w = words[i]
            if w == "-m":
                if i + 1 < len(words) and words[i + 1] in ("pytest", "py.test"):
                    return Invocation(tuple(assignments), head, tuple(words[1:i]), tuple(words[i + 2:]))
                break
            if w in ("-X", "-W"):  # flags that take a value
                i += 2
            elif w.startswith("-") and w != "-c" and w != "-":
                i += 1
            else:
                break
    return Invocation()


def _grader_options(task: Task, inv: Invocation, junit: str) -> list[str]:
    args = list(inv.args or ())
    opts = ["-p", "no:cacheprovider", f"--junitxml={junit}", "-o", "junit_family=xunit1", "-o", "junit_logging=no"]
    for plugin in declared_plugins(task):
        opts += ["-p", plugin]
    if not any(a == "--rootdir" or a.startswith("--rootdir=") for a in args):
        opts.append(f"--rootdir={WORKDIR}")
    return opts


def run_script(task: Task, inv: Invocation, python: str, folder: str) -> str:
    """The POSIX sh script that runs the tests in the grading sandbox (see the module doc, step 3c)."""
    junit = f"{folder}/junit.xml"
    tests = task.test_files
    opts = _grader_options(task, inv, junit)
    clean = ('for v in $(env | sed -n -E \'s/^((PYTHON|PYTEST_)[A-Za-z0-9_]*)=.*/\\1/p\'); do '
             '[ "$v" = PYTHONPATH ] || unset "$v"; done')
    exports = "export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 PYTHONDONTWRITEBYTECODE=1 PYTHONNOUSERSITE=1"
    if inv.args is not None:
        args: list[str] = []
        for a in inv.args:
            args += tests if a == "{tests}" else [a.replace("{tests}", " ".join(tests))]
        cmd = shlex.join([*inv.assignments, python, *inv.python_flags, "-m", "pytest", *args, *opts])
        if inv.assignments:
            cmd = "env " + cmd
    else:
        cmd = task.test_command.replace("{tests}", " ".join(shlex.quote(f) for f in task.test_files))
        exports += f" PYTEST_ADDOPTS={shlex.quote(shlex.join(opts))}"
    return "\n".join([clean, exports, f"cd {WORKDIR}", cmd, "rc=$?", "kill -s KILL -- -1 2>/dev/null", "exit $rc"])


def canary_source(name: str) -> str:
    return (f"\n\n\ndef {name}():  # added by the grader: it must fail\n"
            f"    raise AssertionError('{name} must fail')\n")


def _prepare_script(folder: str, interpreter: str, has_patch: bool, has_test_patch: bool,
                    canary: tuple[str, str] | None = None) -> str:
    """Step 3a: resolve the interpreter, list and apply the patch, apply the test patch, add the canary
    (``(test file, function name)``) to the end of that file, list the links."""
    q = shlex.quote
    lines = ["set -u", f"chmod 700 {folder}", f"cd {WORKDIR}", "g=/usr/bin/git; [ -x \"$g\" ] || g=git",
             f"echo \"python=$(command -v {q(interpreter)} || true)\"",
             "p=$(command -v pytest || true); [ -n \"$p\" ] && echo \"pytest_shebang=$(head -n1 \"$p\")\""]
    if has_patch:
        lines += [f"\"$g\" apply --numstat -z {folder}/model.patch > {folder}/numstat 2> {folder}/err "
                  f"|| {{ echo \"fail=numstat $(base64 -w0 {folder}/err)\"; exit 0; }}",
                  f"echo \"numstat=$(base64 -w0 {folder}/numstat)\"",
                  f"\"$g\" apply --whitespace=nowarn {folder}/model.patch 2> {folder}/err "
                  f"|| {{ echo \"fail=apply $(base64 -w0 {folder}/err)\"; exit 0; }}"]
    if has_test_patch:
        lines += [f"\"$g\" apply --whitespace=nowarn {folder}/test.patch 2> {folder}/err "
                  f"|| {{ echo \"fail=test_patch $(base64 -w0 {folder}/err)\"; exit 0; }}"]
    if canary is not None:
        path = q(f"{WORKDIR}/{canary[0]}")
        lines += [f"if [ -f {path} ] && [ ! -L {path} ]; then printf %s {q(canary_source(canary[1]))} >> {path}; "
                  "echo canary=1; fi"]
    lines += [f"echo \"links=$(find {WORKDIR} -path {WORKDIR}/.git -prune -o -type l -printf '%P\\0%l\\0' "
              "| base64 -w0)\"", "echo ok=1"]
    return "\n".join(lines)


def _fields(stdout: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in stdout.splitlines():
        k, sep, v = line.partition("=")
        if sep and k.isidentifier():
            out.setdefault(k, v)
    return out


def _b64(s: str) -> bytes:
    import base64

    try:
        return base64.b64decode(s.strip() or b"", validate=True)
    except ValueError:
        return b""


def _python(inv: Invocation, fields: dict[str, str]) -> str:
    """The interpreter's absolute path, as the pristine sandbox resolves it (before the patch is applied)."""
    if inv.interpreter.startswith("/"):
        return inv.interpreter
    if inv.interpreter == "pytest":
        shebang = fields.get("pytest_shebang", "").removeprefix("#!").split()
        if shebang and shebang[0].startswith("/") and posixpath.basename(shebang[0]) != "env":
            return shebang[0]  # else (`#!/usr/bin/env python3`) python3 as PATH resolves it
    return fields.get("python", "")


class _Timer:
    def __init__(self) -> None:
        self.t = time.monotonic()
        self.phases: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.phases[name] = self.phases.get(name, 0.0) + now - self.t
        self.t = now


_POOL = ThreadPoolExecutor(max_workers=16, thread_name_prefix="agentenv-grade")


def run_in_background(fn: Callable[..., _T], *args: Any) -> Future[_T]:
    """``fn(*args)`` on the grading worker threads."""
    return _POOL.submit(fn, *args)


def close_later(sandbox: SandboxLike) -> Future[None]:
    """Close ``sandbox`` on a worker thread (the caller waits for the future when it must, e.g. at env close)."""
    return _POOL.submit(sandbox.close)


def _close_started(f: Future[tuple[SandboxLike, Task]]) -> None:
    if f.exception() is None:  # waits for it
        f.result()[0].close()


def grade(sandbox: SandboxLike, task: Task, *, pristine: SnapshotLike | str | None = None,
          api: Backend | None = None, timeout: float = 900.0,
          closing: list[Future[None]] | None = None) -> GradeResult:
    """Grade the agent's /testbed in ``sandbox`` against ``task`` (see the module doc).

    ``pristine``: a filesystem snapshot of the task's sandbox taken before the agent acted (on ``api``,
    default this host); without one a fresh sandbox of the task is set up, which costs a reset. The
    grading sandbox is restored while the patch is being extracted. ``closing``: close the grading
    sandbox on a worker thread and append its future here (the caller waits for it later); by default
    it is closed before ``grade`` returns. The agent's sandbox is left as it was.
    """
    from envs import task_sandbox

    backend: Backend = agentenv if api is None else api
    timer = _Timer()
    if pristine is None:
        starting: Future[tuple[SandboxLike, Task]] = _POOL.submit(task_sandbox.start_task, task, backend)
    else:
        labels = {"agentenv.kind": "grading", "agentenv.task": task.instance_id}
        starting = _POOL.submit(lambda: (backend.Sandbox.restore(pristine, labels=labels), task))
    grader: SandboxLike | None = None
    try:
        if task.base_commit == "HEAD":  # the base commit is known once the task's sandbox is set up
            grader, task = starting.result()
            timer.lap("sandbox")
        try:
            raw = extract_patch(sandbox, task.base_commit)
        except PatchError as e:
            timer.lap("extract")
            return dataclasses.replace(_failed(task, "", str(e)), timings=dict(timer.phases))
        timer.lap("extract")
        filtered = filter_for(task, raw)
        timer.lap("filter")
        if grader is None:
            grader, task = starting.result()
            timer.lap("sandbox")
        result = _grade_in(grader, task, raw, filtered, timeout, timer)
    finally:
        if grader is None:  # extraction failed (or the start did): close the grading sandbox once it is up
            if closing is not None:
                closing.append(_POOL.submit(_close_started, starting))
            else:
                _close_started(starting)
        elif closing is not None:
            closing.append(close_later(grader))
        else:
            grader.close()
            timer.lap("close")
    return dataclasses.replace(result, timings=dict(timer.phases))


@dataclass
class _Run:
    """What one grading has found so far; ``fail`` turns it into a result that scores 0."""

    task: Task
    patch: str
    filtered: FilteredPatch
    tampering: bool = False
    exit_code: int = -1
    timed_out: bool = False
    log: str = ""

    def fail(self, why: str, *, tampering: bool = False) -> GradeResult:
        return _failed(self.task, self.patch, why, dropped=self.filtered.dropped,
                       tampering=self.tampering or tampering, graded_patch=self.filtered.kept.decode("utf-8", "replace"),
                       exit_code=self.exit_code, timed_out=self.timed_out, log_tail=self.log[-4000:])


def _grade_in(sb: SandboxLike, task: Task, raw: bytes, filtered: FilteredPatch, timeout: float,
              timer: _Timer) -> GradeResult:
    run = _Run(task, raw.decode("utf-8", "replace"), filtered, tampering=filtered.tampering)
    folder = GRADE_ROOT + secrets.token_hex(8)
    inv = parse_test_command(task.test_command)
    if filtered.kept:
        sb.write_file(f"{folder}/model.patch", filtered.kept, mode=0o600)
    if task.test_patch:
        sb.write_file(f"{folder}/test.patch", task.test_patch, mode=0o600)
    if not filtered.kept and not task.test_patch:
        sb.exec(f"mkdir -p -m 700 {folder}", timeout=60)
    interp = inv.interpreter if inv.args is not None and inv.interpreter != "pytest" else "python3"
    canary_name = f"test_{secrets.token_hex(8)}"
    canary_file = task.FAIL_TO_PASS[0].split("::", 1)[0] if task.FAIL_TO_PASS else ""
    canary = (canary_file, canary_name) if inv.canary_allowed and canary_file.endswith(".py") else None
    r = sb.exec(_prepare_script(folder, interp, bool(filtered.kept), bool(task.test_patch), canary), timeout=300,
                cwd=WORKDIR)
    fields = _fields(r.stdout)
    timer.lap("apply")
    if "fail" in fields:
        what, _, err = fields["fail"].partition(" ")
        why = {"numstat": "git cannot read the patch", "apply": "the patch does not apply to the base commit",
               "test_patch": "the task's test patch does not apply"}.get(what, what)
        return run.fail(f"{why}: {_b64(err).decode('utf-8', 'replace').strip()[-400:]}")
    if fields.get("ok") != "1":
        return run.fail(f"could not prepare the grading sandbox ({r.exit_code}): {(r.stdout + r.stderr).strip()[-400:]}")
    if filtered.kept:
        mismatch = check_numstat(filtered, parse_numstat(_b64(fields.get("numstat", ""))))
        if mismatch:
            return run.fail(f"the patch does not mean the same to the grader and to git: {mismatch}", tampering=True)
    links = _b64(fields.get("links", "")).split(b"\0")
    touched = filtered.paths
    for path_b, target_b in zip(links[0::2], links[1::2], strict=False):
        path, target = path_b.decode("utf-8", "surrogateescape"), target_b.decode("utf-8", "surrogateescape")
        if path in touched and not link_stays_inside(path, target):
            return run.fail(f"the patch made {path!r} a link to {target!r}, outside the repository", tampering=True)
    python = _python(inv, fields) if inv.args is not None else ""
    if inv.args is not None and not python.startswith("/"):
        return run.fail(f"the image has no interpreter for {inv.interpreter!r} on its PATH")
    if canary is not None and fields.get("canary") != "1":
        canary = None  # the test file is not a plain file: no canary (a missing test fails the task anyway)
    timer.lap("apply")
    r = sb.exec(run_script(task, inv, python, folder), timeout=timeout, cwd=WORKDIR)
    run.exit_code, run.timed_out, run.log = r.exit_code, r.timed_out, r.stdout + r.stderr
    timer.lap("tests")
    if r.timed_out:
        return run.fail(f"the tests timed out after {timeout:g} s")
    st = sb.exec(f"stat -L -c '%s %F' {folder}/junit.xml", timeout=60)
    size, _, kind = st.stdout.strip().partition(" ")
    if st.exit_code != 0 or kind != "regular file" or not size.isdigit():
        return run.fail(f"the test run wrote no result file (pytest exit code {r.exit_code})")
    if int(size) > MAX_RESULT_BYTES:
        return run.fail(f"the result file is {size} bytes, over the {MAX_RESULT_BYTES} byte limit", tampering=True)
    try:
        cases = junit_cases(sb.read_file(f"{folder}/junit.xml"))
    except ResultFileError as e:
        return run.fail(str(e), tampering=True)
    timer.lap("results")
    expected = [*task.FAIL_TO_PASS, *task.PASS_TO_PASS]
    statuses = merge_text(statuses_from_junit(cases, expected), parse_pytest(run.log, expected))
    canary_status = ""
    if canary is not None:
        found = statuses_from_junit(cases, [f"{canary[0]}::{canary[1]}"])
        canary_status = found.get(f"{canary[0]}::{canary[1]}", "MISSING")
    f2p = {t: statuses.get(t, "MISSING") for t in task.FAIL_TO_PASS}
    p2p = {t: statuses.get(t, "MISSING") for t in task.PASS_TO_PASS}
    tests_pass = all(s in PASSING for s in (*f2p.values(), *p2p.values()))
    error, tampering = "", run.tampering
    # a missing canary with failing tests is no sign (e.g. -x stopped the run before it); with passing ones it is
    if canary is not None and canary_status not in CANARY_OK and (canary_status != "MISSING" or tests_pass):
        tampering = True
        error = f"the canary test, which must fail, was reported {canary_status}: the test run was tampered with"
    return GradeResult(resolved=tests_pass and not error, fail_to_pass=f2p, pass_to_pass=p2p, patch=run.patch,
                       exit_code=r.exit_code, timed_out=False, error=error, log_tail=run.log[-4000:],
                       dropped=filtered.dropped, tampering=tampering,
                       graded_patch=filtered.kept.decode("utf-8", "replace"), canary=canary_status)


def _failed(task: Task, patch: str = "", why: str = "", *, dropped: Sequence[Dropped] = (), tampering: bool = False,
            graded_patch: str = "", exit_code: int = -1, timed_out: bool = False, log_tail: str = "",
            timings: Mapping[str, float] | None = None) -> GradeResult:
    return GradeResult(resolved=False, fail_to_pass={t: "MISSING" for t in task.FAIL_TO_PASS},
                       pass_to_pass={t: "MISSING" for t in task.PASS_TO_PASS}, patch=patch, exit_code=exit_code,
                       timed_out=timed_out, error=why, log_tail=log_tail, dropped=tuple(dropped),
                       tampering=tampering, graded_patch=graded_patch, timings=dict(timings or {}))
