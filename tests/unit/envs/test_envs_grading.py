"""Log parsing and the SWE-bench decision rule."""

from __future__ import annotations

from envs.grading import decide, failure_messages, parse_log, parse_pytest, patch_files
from envs.task import Task

LOG = """\
============================= test session starts ==============================
collected 7 items

tests/test_a.py ..F.sx                                                   [100%]
=========================== short test summary info ============================
PASSED tests/test_a.py::test_one
PASSED tests/test_a.py::test_param[a - b]
PASSED tests/test_a.py::TestK::test_method
FAILED tests/test_a.py::test_two - AssertionError: assert 1 == 2
FAILED tests/test_a.py::test_param[x - y] - ValueError: bad - worse
ERROR tests/test_b.py::test_fixture - RuntimeError: setup failed
ERROR tests/test_broken.py - ImportError: no module named zz
SKIPPED [1] tests/test_a.py:40: no network
XFAIL tests/test_a.py::test_known - reason: flaky
XPASS tests/test_a.py::test_lucky
PASSED tests/test_c.py::test_td
ERROR tests/test_c.py::test_td - OSError: teardown
==== 2 failed, 4 passed, 1 skipped, 1 xfailed, 1 xpassed, 2 errors in 0.12s ====
"""


def test_pytest_summary_lines_are_parsed():
    got = parse_pytest(LOG)
    assert got == {
        "tests/test_a.py::test_one": "PASSED",
        "tests/test_a.py::test_param[a - b]": "PASSED",
        "tests/test_a.py::TestK::test_method": "PASSED",
        "tests/test_a.py::test_two": "FAILED",
        "tests/test_a.py::test_param[x - y]": "FAILED",
        "tests/test_b.py::test_fixture": "ERROR",
        "tests/test_broken.py": "ERROR",
        "tests/test_a.py::test_known": "XFAIL",
        "tests/test_a.py::test_lucky": "XPASS",
        "tests/test_c.py::test_td": "ERROR",  # passed, then its teardown failed
    }
    assert parse_log("pytest", LOG) == got


def test_failure_messages():
    msgs = failure_messages(LOG)
    assert msgs["tests/test_a.py::test_two"] == "AssertionError: assert 1 == 2"
    assert msgs["tests/test_a.py::test_param[x - y]"] == "ValueError: bad - worse"


def _task(f2p, p2p):
    return Task.from_json({"instance_id": "t", "repo": "r", "base_commit": "abcdef1", "image": "i",
                           "patch": "--- a/x\n+++ b/x\n", "problem_statement": "p", "test_command": "pytest",
                           "FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p})


def test_resolved_needs_every_fail_to_pass_and_pass_to_pass_test():
    st = parse_pytest(LOG)
    ok, f2p, p2p = decide(_task(["tests/test_a.py::test_one"], ["tests/test_a.py::test_known"]), st)
    assert ok and f2p == {"tests/test_a.py::test_one": "PASSED"}
    assert not decide(_task(["tests/test_a.py::test_one"], ["tests/test_a.py::test_two"]), st)[0]
    missing = decide(_task(["tests/test_a.py::test_gone"], []), st)
    assert not missing[0] and missing[1] == {"tests/test_a.py::test_gone": "MISSING"}
    assert not decide(_task(["tests/test_a.py::test_lucky"], []), st)[0]  # XPASS is not a pass
    assert not decide(_task(["tests/test_a.py::test_one"], []), {})[0]


def test_patch_files():
    patch = ("diff --git a/src/m.py b/src/m.py\n--- a/src/m.py\n+++ b/src/m.py\n@@ -1 +1 @@\n-a\n+b\n"
             "diff --git a/new.py b/new.py\nnew file mode 100644\n--- /dev/null\n+++ b/new.py\n@@ -0,0 +1 @@\n+c\n")
    assert patch_files(patch) == ["src/m.py", "new.py"]
    assert patch_files("") == []
