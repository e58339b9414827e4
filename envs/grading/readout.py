"""Step 3d of ``grade`` (``grader.py``'s module doc): what the grading sandbox's files say once the tests ended.

The statuses come from the JUnit file (another runner's: its recorder's file, ``channels``), the text log only
adds XPASS and the failure messages; the guard's log, the canaries and the isolated run say whether the run was
tampered with; our verdict and the official harness's are combined (``runners.judge``). A runner no hardened
channel runs is read from its output alone (``official_only``). ``Run`` is what a grading has found so far, from
the patch on; each step that fails turns it into a result that scores 0. Apart from ``grader.py``, which prepares
the sandbox and runs the tests, because this only reads what they left.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from agentenv.api import SandboxLike
from envs.grading import audit, channels, isolation, prepare
from envs.grading.outcome import GradeResult, failed
from envs.grading.patch import FilteredPatch
from envs.grading.results import (
    MAX_RESULT_BYTES,
    ResultFileError,
    junit_cases,
    merge_text,
    parse_pytest,
    statuses_from_junit,
)
from envs.grading.runners.judge import combine, hardened_report, official_report
from envs.grading.runners.official import OfficialHarnessError
from envs.grading.runners.spec import Runner
from envs.grading.runners.verdicts import Report
from envs.grading.workers import Timer
from envs.task import Task

CANARY_OK = frozenset({"FAILED", "ERROR"})


@dataclass
class Run:
    """What one grading has found so far; ``fail`` turns it into a result that scores 0."""

    task: Task
    runner: Runner
    patch: str
    filtered: FilteredPatch
    tampering: bool = False
    exit_code: int = -1
    timed_out: bool = False
    log: str = ""
    reasons: list[str] = field(default_factory=list)     # signs of tampering the run showed (the guard's log)
    audit_events: tuple[Mapping[str, str], ...] = ()

    def fail(self, why: str, *, tampering: bool = False) -> GradeResult:
        if self.reasons:
            why = f"the test run was tampered with: {self.reasons[0]} ({why})"
        r = failed(self.task, self.patch, why, dropped=self.filtered.dropped, reasons=tuple(self.reasons),
                   tampering=self.tampering or tampering or bool(self.reasons),
                   graded_patch=self.filtered.kept.decode("utf-8", "replace"), exit_code=self.exit_code,
                   timed_out=self.timed_out, log_tail=self.log[-4000:])
        return dataclasses.replace(r, audit_events=self.audit_events, runner=self.runner.family,
                                   mode=self.runner.mode)


def _official(run: Run) -> tuple[Report | None, str]:
    try:
        return official_report(run.runner, run.task, run.log), ""
    except OfficialHarnessError as e:
        return None, str(e)


def official_only(run: Run, timer: Timer) -> GradeResult:
    report, err = _official(run)
    timer.lap("results")
    if report is None:
        return run.fail(f"the official harness could not grade the log: {err}")
    sm = report.statuses
    return GradeResult(resolved=report.resolved, fail_to_pass={t: sm.get(t, "MISSING") for t in run.task.FAIL_TO_PASS},
                       pass_to_pass={t: sm.get(t, "MISSING") for t in run.task.PASS_TO_PASS}, patch=run.patch,
                       exit_code=run.exit_code, error="" if report.resolved else report.why,
                       log_tail=run.log[-4000:], dropped=run.filtered.dropped, tampering=run.tampering,
                       graded_patch=run.filtered.kept.decode("utf-8", "replace"), runner=run.runner.family,
                       mode=run.runner.mode, reward_source="official-log", official=report)


def hardened(sb: SandboxLike, run: Run, folder: str, secret: str, canary_ids: list[str], solo_ids: list[str],
             timer: Timer, *, guarded: bool, channel: channels.Channel | None = None) -> GradeResult:
    """Step 3d: statuses from the JUnit file (another runner's: its recorder's file), the guard's log, the canaries
    and the isolated run; both verdicts."""
    task, r_code = run.task, run.exit_code
    result_file = channels.RESULTS_FILE if channel is not None else "junit.xml"
    st = sb.exec(f"stat -L -c '%s %F' {folder}/{result_file}; for f in {audit.LOG_FILE} {isolation.RESULT_FILE}; do "
                 f"echo \"$f=$(head -c 1000000 {folder}/$f 2>/dev/null | base64 -w0)\"; done", timeout=60)
    size, _, kind = st.stdout.split("\n", 1)[0].strip().partition(" ")
    outputs = prepare.fields_raw(st.stdout)
    guard_log = audit.read_log(prepare.b64(outputs.get(audit.LOG_FILE, "")))
    reasons = run.reasons = guard_log.reasons()
    run.audit_events = guard_log.events
    if guarded and r_code == audit.GUARD_EXIT:
        reasons.append("the test process closed or replaced the audit hook's log")
    if guarded and guard_log.starts == 0 and not reasons:
        return run.fail("the grader's guard did not start in the grading sandbox")
    if st.exit_code != 0 or kind != "regular file" or not size.isdigit():
        return run.fail(f"the test run wrote no result file (pytest exit code {r_code})")
    if int(size) > MAX_RESULT_BYTES:
        return run.fail(f"the result file is {size} bytes, over the {MAX_RESULT_BYTES} byte limit", tampering=True)
    if channel is not None:
        got = channels.read_results(sb.read_file(f"{folder}/{result_file}"))
        if got.problem or not got.recorded:
            return run.fail(got.problem or "the runner's outcomes were not recorded (its reporter never loaded)")
        reasons += [f"the test run replaced the runner's {b}" for b in got.blunted]
        statuses = got.statuses
        canaries = {c: got.ids.get(c, statuses.get(c, "MISSING")) for c in canary_ids}
    else:
        try:
            cases = junit_cases(sb.read_file(f"{folder}/junit.xml"))
        except ResultFileError as e:
            return run.fail(str(e), tampering=True)
        expected = [*task.FAIL_TO_PASS, *task.PASS_TO_PASS]
        statuses = merge_text(statuses_from_junit(cases, expected), parse_pytest(run.log, expected))
        if run.runner.family != "agentenv":  # named as the dataset's parser names them (cut at a space, ...)
            statuses = channels.dataset_statuses(run.runner.parser, statuses)
        canaries = dict(statuses_from_junit(cases, canary_ids)) if canary_ids else {}
        canaries = {c: canaries.get(c, "MISSING") for c in canary_ids}
    timer.lap("results")
    ours = hardened_report(run.runner, task, statuses)
    # a missing canary with failing tests is no sign (e.g. -x stopped the run before it); with passing ones it is
    for c, status in canaries.items():
        if status not in CANARY_OK and (status != "MISSING" or ours.resolved):
            reasons.append(f"the canary test {c}, which must fail, was reported {status}")
    solo = isolation.read_solo(prepare.b64(outputs.get(isolation.RESULT_FILE, "")), secret) if solo_ids \
        else isolation.SoloRun({})
    if solo_ids:
        reasons += isolation.disagreements(solo, solo_ids, statuses, canary_ids)
    bad = [s for s in canaries.values() if s not in CANARY_OK]
    official, official_error = _official(run)
    timer.lap("official")
    resolved, why = combine(run.runner, ours, official, official_error)
    error = f"the test run was tampered with: {reasons[0]}" if reasons else why
    return GradeResult(resolved=resolved and not error, patch=run.patch, exit_code=r_code, timed_out=False,
                       fail_to_pass={t: statuses.get(t, "MISSING") for t in task.FAIL_TO_PASS},
                       pass_to_pass={t: statuses.get(t, "MISSING") for t in task.PASS_TO_PASS},
                       error=error, log_tail=run.log[-4000:],
                       dropped=run.filtered.dropped, tampering=run.tampering or bool(reasons),
                       graded_patch=run.filtered.kept.decode("utf-8", "replace"),
                       canary=(bad[0] if bad else ("FAILED" if "FAILED" in canaries.values() else "ERROR"))
                       if canaries else "", canaries=canaries, tampering_reasons=tuple(reasons),
                       solo=dict(solo.results), audit_events=guard_log.events, runner=run.runner.family,
                       mode=run.runner.mode, ours=ours, official=official, official_error=official_error)
