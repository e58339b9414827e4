"""``agentenv tasks validate``: each record's gold patch resolves and nothing else does, graded as the
dataset's own runner grades it, records in parallel, with a per-record and a per-runner summary table.

Per record, in a sandbox set up as a reset sets it up (``start_task``: SWE-smith's bug applied, R2E-Gym's tests
hidden), four patches are graded by ``envs.grading.grade`` (the dataset's runner, both verdicts):

- the unchanged repository (the empty patch), which must not resolve;
- a no-op edit of every file the gold patch touches (``noop_edit``), which must not resolve;
- the FAIL_TO_PASS tests' files deleted, which must not resolve (records with FAIL_TO_PASS tests);
- the gold patch, which must resolve.

A record whose sandbox cannot be set up (a missing image, a base commit the image lacks, a field its runner
refuses) fails with its reason; the others still run. The tables say, per record, what each patch graded, and
whether the official harness's verdict agreed with ours on every graded patch; per runner, how many records,
how many golds resolved, how many empty patches resolved (0 is right) and how many agreed.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from agentenv.errors import AgentEnvError
from envs.grading import PASSING, GradeResult, grade
from envs.task import Task
from envs.task_sandbox import start_task

Log = Callable[[str], None]
UNCHANGED = "unchanged repository"
WRONG_NOOP = "wrong patch (a no-op edit of the files the gold patch touches)"
WRONG_TESTS = "wrong patch (the failing tests deleted)"
GOLD = "gold patch"


@dataclass(frozen=True)
class Check:
    """One patch graded: what it should give, what it gave, and whether the official verdict agreed."""

    label: str
    resolved: bool | None           # None: not graded (it could not be applied)
    agree: bool | None = None       # None: no official verdict (it could not read the log) or not graded


@dataclass(frozen=True)
class Verdict:
    instance_id: str
    ok: bool
    detail: str
    dataset: str = ""
    runner: str = ""                # the runner family and verdict mode, e.g. "swebench/swebench-4"
    checks: tuple[Check, ...] = ()
    seconds: float = 0.0

    def check(self, label: str) -> Check | None:
        return next((c for c in self.checks if c.label == label), None)

    @property
    def agree(self) -> bool | None:
        """Every graded patch's official verdict agreed with ours (None: there was none to compare)."""
        seen = [c.agree for c in self.checks if c.agree is not None]
        return all(seen) if seen else None


def noop_edit(task: Task) -> str:
    """A shell command that makes a change fixing nothing to each file the gold patch touches that exists
    (a comment appended to source files, an empty line to others); it fails when git sees no change
    although there was a file to edit."""
    edits = []
    for f in task.gold_files:
        q = shlex.quote(f)
        text = r"\n# agentenv: not a fix\n" if f.endswith((".py", ".pyi", ".sh", ".cfg", ".toml")) else r"\n"
        edits.append(f"if [ -f {q} ]; then printf '{text}' >> {q}; n=1; fi")
    return "; ".join(["n=0", *edits, '[ "$n" = 0 ] || git status --porcelain | grep -q .'])


def validate_task(task: Task) -> Verdict:
    """The four patches of the module doc graded for ``task``; a record that cannot be set up is not valid,
    and its verdict carries the reason instead of raising."""
    t0 = time.monotonic()
    problems: list[str] = []
    checks: list[Check] = []
    runner = ""
    try:
        sb, task = start_task(task, cpus=1.0, memory="2g")
    except Exception as e:  # a FAIL of this record, with its reason; the others still run
        return Verdict(task.instance_id, False, f"setup: {_why(e)}", task.dataset, seconds=time.monotonic() - t0)
    try:
        def check(label: str, prepare: str | None, want: bool) -> None:
            nonlocal runner
            sb.exec("git reset -q --hard && git clean -fdq", cwd="/testbed")
            if prepare:
                r = sb.exec(prepare, cwd="/testbed")
                if r.exit_code != 0:
                    problems.append(f"{label}: could not apply ({(r.stdout + r.stderr).strip()[:200]})")
                    checks.append(Check(label, None))
                    return
            res: GradeResult = grade(sb, task, timeout=600)
            runner = f"{res.runner}/{res.mode}"
            checks.append(Check(label, res.resolved, res.agree))
            if res.resolved != want:
                bad = {t: s for t, s in {**res.fail_to_pass, **res.pass_to_pass}.items() if s not in PASSING}
                problems.append(f"{label}: resolved={res.resolved}, expected {want} "
                                f"(not passing: {dict(list(bad.items())[:3])}; {res.error})")

        check(UNCHANGED, None, False)
        check(WRONG_NOOP, noop_edit(task), False)
        files = " ".join(shlex.quote(f) for f in dict.fromkeys(t.split("::", 1)[0] for t in task.FAIL_TO_PASS))
        if files:
            check(WRONG_TESTS, f"rm -f {files}", False)
        gold_file = "/tmp/.gold.patch"
        sb.write_file(gold_file, task.patch)
        check(GOLD, f"git apply --whitespace=nowarn {gold_file} && rm -f {gold_file}", True)
    except Exception as e:
        problems.append(f"grading: {_why(e)}")
    finally:
        sb.close()
    return Verdict(task.instance_id, not problems, "; ".join(problems) or "ok", task.dataset, runner, tuple(checks),
                   time.monotonic() - t0)


def _why(e: Exception) -> str:
    return str(e) if isinstance(e, AgentEnvError) else f"{type(e).__name__}: {e}"


def validate(tasks: list[Task], *, workers: int = 1, budget: float | None = None, log: Log = print,
             unusable: dict[str, str] | None = None) -> list[Verdict]:
    """Validate ``tasks``, ``workers`` at a time, a line logged as each ends; no record is started once the time
    budget (seconds) is spent. A record whose image is in ``unusable`` (image -> reason, see
    ``envs.tasks.build.prepare_images``) fails with that reason without starting. Verdicts in the tasks' order."""
    t0 = time.monotonic()
    skipped: list[str] = []

    def one(task: Task) -> Verdict | None:
        if budget is not None and time.monotonic() - t0 > budget:
            skipped.append(task.instance_id)
            return None
        why = (unusable or {}).get(task.image)
        v = Verdict(task.instance_id, False, why, task.dataset) if why else validate_task(task)
        log(f"[validate] {'ok  ' if v.ok else 'FAIL'} {v.instance_id}" + ("" if v.ok else f": {v.detail}"))
        return v

    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="agentenv-validate") as pool:
        done = list(pool.map(one, tasks))
    if skipped:
        log(f"[validate] time budget of {budget:g} s spent: {len(skipped)} record(s) not started")
    return [v for v in done if v is not None]


def _mark(c: Check | None) -> str:
    if c is None:
        return "-"
    return "n/a" if c.resolved is None else ("yes" if c.resolved else "no")


def table(verdicts: list[Verdict]) -> list[str]:
    """The per-record table (resolved, per patch; official agreement; seconds), then the per-runner one."""
    agree = {True: "agrees", False: "DIFFERS", None: "-"}
    width = max([len("record"), *(len(v.instance_id) for v in verdicts)])
    rows = [f"{'record':<{width}}  {'dataset':<15} {'runner/mode':<24} {'gold':<5} {'empty':<5} {'no-op':<5} "
            f"{'tests-rm':<8} {'official':<8} {'s':>6}  verdict"]
    for v in verdicts:
        marks = [_mark(v.check(label)) for label in (GOLD, UNCHANGED, WRONG_NOOP, WRONG_TESTS)]
        rows.append(f"{v.instance_id:<{width}}  {v.dataset:<15} {v.runner or '-':<24} {marks[0]:<5} {marks[1]:<5} "
                    f"{marks[2]:<5} {marks[3]:<8} {agree[v.agree]:<8} {v.seconds:>6.1f}  {'ok' if v.ok else 'FAIL'}")
    rows += ["", f"{'runner/mode':<24} {'records':>7} {'gold resolved':>13} {'empty resolved':>14} "
                 f"{'agree with official':>19}"]
    by_runner: dict[str, list[Verdict]] = {}
    for v in verdicts:
        by_runner.setdefault(v.runner or "(not graded)", []).append(v)
    for name, vs in sorted(by_runner.items()):
        gold = sum(1 for v in vs if (c := v.check(GOLD)) is not None and c.resolved)
        empty = sum(1 for v in vs if (c := v.check(UNCHANGED)) is not None and c.resolved)
        compared = [v.agree for v in vs if v.agree is not None]
        agreed = f"{sum(compared)}/{len(compared)}" if compared else "-"
        rows.append(f"{name:<24} {len(vs):>7} {gold:>13} {empty:>14} {agreed:>19}")
    return rows
