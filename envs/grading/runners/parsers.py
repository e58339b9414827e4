"""The log parsers ``swebench`` does not cover: SWE-smith's and R2E-Gym's, written once from their harnesses.

- SWE-smith (``swesmith.profiles.python.PythonProfile.log_parser``, the default of its Python repositories):
  a line ``<id><spaces><STATUS>`` (pytest's ``--verbose`` form, ``path::test PASSED [ 50%]``) for each status
  of ``swebench``'s ``TestStatus``, read from the text between the ``+ : '>>>>> Start Test Output'`` and
  ``+ : '>>>>> End Test Output'`` trace lines (``swesmith.harness.grading.read_test_output``: no such
  lines, or a patch-apply failure or timeout in the log, and nothing is read);
- R2E-Gym (``r2egym.repo_analysis.execution_log_parser.parse_log_pytest``): the lines after pytest's ``short
  test summary info``, keyed by the node id's parts after the file joined with dots, the message after
  `` - `` cut (a line is PASSED, FAILED or ERROR when it *contains* that word, in that order), after
  ``run_tests`` stripped ANSI colours and carriage returns from the output.

Their own fixtures are the tests (``tests/unit/envs/test_envs_runners_parsers.py``).
"""

from __future__ import annotations

import re

SWESMITH_START = "+ : '>>>>> Start Test Output'"
SWESMITH_END = "+ : '>>>>> End Test Output'"
APPLY_PATCH_FAIL = ">>>>> Patch Apply Failed"
TESTS_TIMEOUT = ">>>>> Tests Timed Out"
_TEST_STATUS = ("FAILED", "PASSED", "SKIPPED", "ERROR", "XFAIL")  # swebench's TestStatus, in its order
_SWESMITH_LINE = [(s, re.compile(rf"^(\S+)(\s+){s}")) for s in _TEST_STATUS]
_R2E_NOISE = re.compile(r"\x1b\[[0-9;]*m|\r")


def swesmith_test_output(log: str) -> tuple[str, bool]:
    """``read_test_output``: (the text between the trace markers, found)."""
    if APPLY_PATCH_FAIL in log or TESTS_TIMEOUT in log:
        return "", False
    if SWESMITH_START not in log or SWESMITH_END not in log:
        return log, False
    start, end = log.find(SWESMITH_START), log.find(SWESMITH_END)
    if start > end:
        return "", False  # SWE-smith raises "markers are not in correct order": no verdict either way
    return log[start:end][len(SWESMITH_START):], True


def parse_swesmith(log: str) -> dict[str, str]:
    """SWE-smith's Python profile parser on a test output."""
    out: dict[str, str] = {}
    for line in log.split("\n"):
        for status, pattern in _SWESMITH_LINE:
            m = pattern.match(line)
            if m:
                out[m.group(1)] = status
    return out


def clean_r2e(output: str) -> str:
    """What R2E-Gym's ``run_tests`` does to the output before parsing."""
    return _R2E_NOISE.sub("", output)


def parse_r2e(log: str) -> dict[str, str]:
    """R2E-Gym's ``parse_log_pytest``."""
    if "short test summary info" not in log:
        return {}
    out: dict[str, str] = {}
    for line in log.split("short test summary info")[1].strip().split("\n"):
        if "PASSED" in line:
            out[".".join(line.split("::")[1:])] = "PASSED"
        elif "FAILED" in line:
            out[".".join(line.split("::")[1:]).split(" - ")[0]] = "FAILED"
        elif "ERROR" in line:
            out[".".join(line.split("::")[1:]).split(" - ")[0]] = "ERROR"
    return out
