"""SWE-bench grading that the agent cannot tamper with.

A policy under RL finds any way to make the grader say "resolved", so grading never trusts the sandbox
the agent controlled (it was root there: conftest files, pytest's configuration and plugins, the
interpreter and its site-packages, startup hooks and the commands on PATH were all its to change):

- ``patch``: the agent's change is taken out of its sandbox as a patch of /testbed — data, nothing
  more — and filtered by one documented rule (test files, test-runner configuration, interpreter
  startup hooks, bytecode, package metadata, ... are dropped and reported; ``filter_patch``);
- ``grader``: the kept patch is applied to a fresh sandbox restored from the task's pristine state
  (a snapshot taken at reset, before the agent acted), where the tests run with plugin auto-loading
  off and the image's interpreter by absolute path; results come from a JUnit XML file the grader asked
  for, outside /testbed (``grade``); ``command``: the task's test command read as a pytest invocation,
  and the script that runs it;
- run-time tampering, closed by construction rather than by reading the patch: ``audit`` (with
  ``sandbox_guard.py``, the program written into the grading folder) runs pytest under a PEP 578 audit
  hook installed before any repository code, which refuses and logs frames, ``gc`` walks, ``ctypes``,
  tracing hooks, string-compiled code, runner imports, new processes and the grading folder to the code
  the patch added; ``isolation`` calls the FAIL_TO_PASS tests and the canaries again in a second guarded
  interpreter, without pytest's runner, its verdicts signed with a secret, and compares; ``canary``
  derives the canaries from the task's own tests (copies under names like theirs, made to fail). Any
  sign sets ``info["grading"]["tampering"]`` with ``tampering_reasons`` (reward 0);
- ``diff``: the git diff read as data (its sections, the paths and lines each adds), for ``patch``'s rule;
- ``results``: the JUnit and ``-rA`` text parsers;
- ``runners``: each dataset's runner (eval script, patch-apply fallbacks, timeout), its official log parser and
  verdict mode (SWE-bench 4 / 5, fail-only, SWE-smith, R2E-Gym's exact map, agentenv's strict rule), the pinned
  official ``swebench`` harness in its own process, and what sets the reward per runner (``runners``'s doc).

What it takes to rewrite outcomes now, and what remains possible. Rewriting pytest's reports at run time
(a class attribute of the report, a module attribute of the runner, pluggy's hook calls, a registered
plugin, ``xfail``) is not refused by the audit hook — Python audits neither module, instance nor
(ordinary) class attribute writes, nor ``sys.modules`` lookups — but it no longer decides the grade: the
isolated run calls each FAIL_TO_PASS test without pytest's reports, and a test pytest reports passing that
fails there is tampering. To get past all of it a patch must (1) rewrite pytest's outcome by means the
hook does not see, and (2) either make the isolated run see the test pass — in which case the library
returned the right answers while the test ran, i.e. special-cased the tests' inputs, which no grader
of outcomes can tell from a fix — or forge its verdicts, which needs the run's secret or its results,
held only in the runner's local variables. Those are out of reach by construction: frames, ``gc`` and
``ctypes`` are refused to the patch's code; no signal handler set from Python ever runs (a seccomp filter
on ``rt_sigaction``, so no handler receives a frame); and the hook and the isolated run use builtins and
functions bound before the repository's code ran, so rebinding ``builtins.getattr`` or ``json.dumps``
changes nothing they call. Of the shipped tasks' 344 FAIL_TO_PASS tests the isolated run calls 336,
parametrized ones included (with the parameter set their id names, derived as pytest derives ids), and
every task has some. The 8 it cannot call (fixtures, other decorators) rest on the canaries and the
hook only, and a patch that carries the pristine test names can spare every canary (they cannot be
indistinguishable from tests missing from the file the agent had). Neither check sees a patch that
weakens a helper the tests import from the library itself (e.g. an ``assert raises(...)`` helper that
always says yes), or returns objects that compare equal to anything: that is a change to what the tests
test, for a reviewer of ``info["patch"]``. Under the guard no test can catch a signal (a handler set is
a no-op; none of the shipped tasks needs one). Django's ``tests/runtests.py`` and SymPy's ``bin/test`` have hardened
channels of their own (``channels``: the guard runs them with a recorder of their outcomes, the isolated run and the
canaries extended to their tests). Any other command that is not a plain pytest invocation runs without the guard,
the isolated run and the canaries: for a dataset's record its reward is then the official parser's reading of the
log, which a patch can forge (``GradeResult.reward_source == "official-log"``). Processes the tests leave behind are
killed before each result file is read.
"""

from envs.grading.grader import (
    GradeResult,
    declared_plugins,
    filter_for,
    grade,
    parse_test_command,
    protected_files,
)
from envs.grading.patch import (
    MAX_PATCH_BYTES,
    REASONS,
    Dropped,
    FilteredPatch,
    PatchError,
    drop_reason,
    extract_patch,
    filter_patch,
)
from envs.grading.results import (
    PARSERS,
    PASSING,
    STATUSES,
    failure_messages,
    junit_key,
    parse_junit,
    parse_log,
    parse_pytest,
    split_message,
)
from envs.grading.runners import verdict
from envs.task import Task, diff_paths


def decide(task: Task, statuses: dict[str, str]) -> tuple[bool, dict[str, str], dict[str, str]]:
    """(resolved, FAIL_TO_PASS results, PASS_TO_PASS results) by agentenv's strict rule; absent tests are
    'MISSING'."""
    f2p = {t: statuses.get(t, "MISSING") for t in task.FAIL_TO_PASS}
    p2p = {t: statuses.get(t, "MISSING") for t in task.PASS_TO_PASS}
    return verdict("strict", statuses, task.FAIL_TO_PASS, task.PASS_TO_PASS).resolved, f2p, p2p


def patch_files(patch: str) -> list[str]:
    """Paths a unified diff touches (its ``+++ b/...`` and ``--- a/...`` headers)."""
    return diff_paths(patch)


__all__ = ["MAX_PATCH_BYTES", "PARSERS", "PASSING", "REASONS", "STATUSES", "Dropped", "FilteredPatch", "GradeResult",
           "PatchError", "decide", "declared_plugins", "drop_reason", "extract_patch", "failure_messages",
           "filter_for", "filter_patch", "grade", "junit_key", "parse_junit", "parse_log", "parse_pytest",
           "parse_test_command", "patch_files", "protected_files", "split_message"]
