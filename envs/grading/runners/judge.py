"""Two verdicts per graded record: the official harness's on the run's log, and ours on the hardened channel.

``official_report`` reads the log the way the dataset's harness does: ``swebench``'s own ``get_eval_report``
(4.1.0 or 5.0.2, in its process: ``envs.grading.runners.official``), SWE-rebench's fork's reading on 4.1.0's
parsers, SWE-smith's and R2E-Gym's readings (``envs.grading.runners.parsers``), or for agentenv's own tasks our
pytest ``-rA`` parser. That verdict rests on text the patch's code printed: a patch can forge it.

``hardened_report`` applies the runner's verdict mode to the status map a hardened channel wrote where the
code under test cannot reach it (pytest's JUnit file in the grading folder; see ``envs.grading.grader``).

``envs.grading.grader`` sets the reward from both (``RewardRule``) and records both in ``info["grading"]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from envs.grading.results import parse_pytest
from envs.grading.runners import official
from envs.grading.runners.parsers import clean_r2e, parse_r2e, parse_swesmith, swesmith_test_output
from envs.grading.runners.spec import Runner
from envs.grading.runners.verdicts import Report, not_found, r2e_key, resolution, verdict
from envs.task import Task


def _from_swebench(runner: Runner, task: Task, ans: Mapping[str, Any]) -> Report:
    rep = ans["report"]
    if not ans.get("found") or not rep.get("patch_successfully_applied"):
        return not_found(runner.mode, "the official harness found no test output to grade (no markers, a bad "
                                      "code in the log, or an exit status without a failure)",
                         task.FAIL_TO_PASS, task.PASS_TO_PASS)
    ts = rep.get("tests_status", {})
    fo, fb, po, pb = (tuple(ts.get(k, {}).get(w, [])) for k in ("FAIL_TO_PASS", "PASS_TO_PASS")
                      for w in ("success", "failure"))
    res = resolution(len(fo), len(fb), len(po), len(pb))
    if rep.get("resolved") != (res == "RESOLVED_FULL"):  # cannot happen with either version; kept loud
        raise official.OfficialHarnessError(f"the official report says resolved={rep.get('resolved')} but its "
                                            f"lists say {res}", fix="report this record")
    return Report(runner.mode, res, fo, fb, po, pb, statuses=dict(ans.get("statuses") or {}))


def official_report(runner: Runner, task: Task, log: str) -> Report:
    """The dataset's own harness's verdict on ``log`` (the run's combined output, markers included)."""
    if runner.official in ("swebench-4", "swebench-5", "swe-rebench"):
        req: dict[str, Any] = {"op": "report", "spec": dict(runner.spec or {}), "log": log}
        if runner.official == "swe-rebench":
            req["flavour"] = "rebench"
        ans = official.harness(5 if runner.official == "swebench-5" else 4).call([req])[0]
        return _from_swebench(runner, task, ans)
    if runner.official == "swe-smith":
        body, found = swesmith_test_output(log)
        if not found:
            return not_found("swesmith", "no SWE-smith test output markers in the log", task.FAIL_TO_PASS,
                             task.PASS_TO_PASS)
        files = list((runner.spec or {}).get("test_files", []))
        return verdict("swesmith", parse_swesmith(body), task.FAIL_TO_PASS, task.PASS_TO_PASS, test_files=files)
    if runner.official == "r2e-gym":
        return verdict("r2e-exact", parse_r2e(clean_r2e(log)), task.FAIL_TO_PASS, task.PASS_TO_PASS,
                       expected=task.expected_output)
    return verdict(runner.mode, parse_pytest(log, [*task.FAIL_TO_PASS, *task.PASS_TO_PASS]), task.FAIL_TO_PASS,
                   task.PASS_TO_PASS)


def hardened_report(runner: Runner, task: Task, statuses: Mapping[str, str]) -> Report:
    """The runner's verdict mode on a hardened channel's status map (node ids as the task names its tests)."""
    if runner.mode == "r2e-exact":
        keyed = {r2e_key(k): v for k, v in statuses.items() if v in ("PASSED", "FAILED", "ERROR")}
        return verdict("r2e-exact", keyed, task.FAIL_TO_PASS, task.PASS_TO_PASS, expected=task.expected_output)
    files = list((runner.spec or {}).get("test_files", []))
    return verdict(runner.mode, statuses, task.FAIL_TO_PASS, task.PASS_TO_PASS, test_files=files)


def combine(runner: Runner, ours: Report, official: Report | None, official_error: str = "") -> tuple[bool, str]:
    """(resolved, why not) from both verdicts by the runner's rule (see ``envs.grading.runners``): agentenv's own
    tasks by ours alone; a dataset's record only when the official harness says resolved too."""
    if not ours.resolved:
        return False, ""
    if runner.family == "agentenv":
        return True, ""
    if official is None:
        return False, f"the official harness could not grade the log: {official_error}"
    if not official.resolved:
        return False, f"the official harness does not call it resolved ({official.resolution}{': ' + official.why if official.why else ''})"
    return True, ""
