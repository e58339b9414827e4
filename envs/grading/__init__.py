"""SWE-bench grading that the agent cannot tamper with.

A policy under RL finds any way to make the grader say "resolved", so grading never trusts the sandbox
the agent controlled (it was root there: conftest files, pytest's configuration and plugins, the
interpreter and its site-packages, startup hooks and the commands on PATH were all its to change):

- ``patch``: the agent's change is taken out of its sandbox as a patch of /testbed — data, nothing
  more — and filtered by one documented rule (test files, test-runner configuration, interpreter
  startup hooks, bytecode, package metadata, ... are dropped and reported; ``filter_patch``);
- ``diff``: the git diff read as data (its sections, the paths and lines each adds), for ``patch``'s rule;
- ``grader``: the kept patch is applied to a fresh sandbox restored from the task's pristine state
  (a snapshot taken at reset, before the agent acted), where the tests run with plugin auto-loading
  off, the image's interpreter by absolute path and a canary test that must fail; results come from a
  JUnit XML file the grader asked for, outside /testbed (``grade``);
- ``results``: the JUnit and ``-rA`` text parsers, and SWE-bench's decision rule.

What remains possible. The code under test runs in the same process as pytest. A patch to the library
that, at run time, reaches into the runner by means the text rule does not name (``exec`` of a string
built at run time, a computed ``importlib`` name, ``gc`` walks under another name) and rewrites the
outcome of the task's own tests *by name* — leaving the canary failing — is not stopped by
construction; it is a change to the library's source that a reviewer of ``info["patch"]`` sees. The
canary catches every blanket manipulation (all outcomes passed, the result file rewritten without
knowing the canary, early exits). Processes the tests leave behind are killed before the result file
is read.
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
from envs.task import Task, diff_paths


def decide(task: Task, statuses: dict[str, str]) -> tuple[bool, dict[str, str], dict[str, str]]:
    """(resolved, FAIL_TO_PASS results, PASS_TO_PASS results); absent tests are 'MISSING'."""
    f2p = {t: statuses.get(t, "MISSING") for t in task.FAIL_TO_PASS}
    p2p = {t: statuses.get(t, "MISSING") for t in task.PASS_TO_PASS}
    resolved = all(s in PASSING for s in f2p.values()) and all(s in PASSING for s in p2p.values())
    return resolved, f2p, p2p


def patch_files(patch: str) -> list[str]:
    """Paths a unified diff touches (its ``+++ b/...`` and ``--- a/...`` headers)."""
    return diff_paths(patch)


__all__ = ["MAX_PATCH_BYTES", "PARSERS", "PASSING", "REASONS", "STATUSES", "Dropped", "FilteredPatch", "GradeResult",
           "PatchError", "decide", "declared_plugins", "drop_reason", "extract_patch", "failure_messages",
           "filter_for", "filter_patch", "grade", "junit_key", "parse_junit", "parse_log", "parse_pytest",
           "parse_test_command", "patch_files", "protected_files", "split_message"]
