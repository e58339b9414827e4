"""Result parsing (the -rA text summary and JUnit XML) and the SWE-bench decision rule."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from envs.grading import decide, failure_messages, parse_log, parse_pytest, patch_files, split_message
from envs.grading.results import MAX_RESULT_BYTES, ResultFileError, junit_key, merge_text, parse_junit
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


# --- ids with brackets and dashes (issue 9 §2: the id was the whole line) ----------------------------

def test_a_message_with_a_bracket_does_not_swallow_the_id():
    assert split_message("t.py::test_x[1] - upstream bug [#12]") == ("t.py::test_x[1]", "upstream bug [#12]")
    assert parse_pytest("XFAIL t.py::test_x[1] - upstream bug [#12]\n") == {"t.py::test_x[1]": "XFAIL"}
    assert failure_messages("FAILED t.py::T::test_y[a-b] - KeyError: ['k'] - see [1]\n") == {
        "t.py::T::test_y[a-b]": "KeyError: ['k'] - see [1]"}


@pytest.mark.parametrize(("rest", "want"), [
    ("t.py::test_p[x - y] - ValueError: bad - worse", ("t.py::test_p[x - y]", "ValueError: bad - worse")),
    ("t.py::test_p[a[b]c] - m [1]", ("t.py::test_p[a[b]c]", "m [1]")),
    ("t.py::test_p[a]b] - m", ("t.py::test_p[a]b]", "m")),          # unbalanced: the "]" that can end an id
    ("t.py::test_p[a[b] - m", ("t.py::test_p[a[b]", "m")),
    ("t.py::test_p[]", ("t.py::test_p[]", "")),
    ("t.py - ImportError: x [y]", ("t.py", "ImportError: x [y]")),
    ("t.py::test_q", ("t.py::test_q", "")),
])
def test_split_message(rest, want):
    assert split_message(rest) == want


def test_known_ids_are_matched_whole():
    known = ["t.py::test_p[a] - b]"]  # an id no bracket rule can cut right
    assert split_message("t.py::test_p[a] - b] - boom", known) == ("t.py::test_p[a] - b]", "boom")
    assert parse_pytest("FAILED t.py::test_p[a] - b] - boom\n", known) == {"t.py::test_p[a] - b]": "FAILED"}


def test_xpass_lines_old_and_new():
    assert parse_pytest("XPASS t.py::test_l reason here\nXPASS t.py::test_m[1] - why\n") == {
        "t.py::test_l": "XPASS", "t.py::test_m[1]": "XPASS"}


# --- JUnit XML: what a grade rests on --------------------------------------------------------------

TRICKY = '''
import pytest

@pytest.mark.parametrize("v", ["a - b", "x]y", "p::q", "é", "tab\\there", "[#12]"])
def test_param(v):
    assert v != "x]y"

class TestK:
    def test_method(self):
        pass

    @pytest.mark.parametrize("n", [1, 2])
    def test_m(self, n):
        assert n == 1

@pytest.mark.xfail(reason="upstream bug [#12]")
def test_xfail():
    assert False

@pytest.mark.xfail(reason="lucky")
def test_xpass():
    pass

@pytest.mark.xfail(strict=True, reason="strict")
def test_xpass_strict():
    pass

@pytest.mark.skip(reason="no network")
def test_skip():
    pass

@pytest.fixture
def bad_teardown():
    yield
    raise RuntimeError("teardown")

def test_pass_then_teardown_error(bad_teardown):
    pass

def test_fail_then_teardown_error(bad_teardown):
    assert False

@pytest.fixture
def bad_setup():
    raise RuntimeError("setup")

def test_setup_error(bad_setup):
    pass
'''

WANT = {
    "tests/test_t.py::test_param[a - b]": "PASSED",
    "tests/test_t.py::test_param[x]y]": "FAILED",
    "tests/test_t.py::test_param[p::q]": "PASSED",
    "tests/test_t.py::test_param[\\xe9]": "PASSED",
    "tests/test_t.py::test_param[tab\\there]": "PASSED",
    "tests/test_t.py::test_param[[#12]]": "PASSED",
    "tests/test_t.py::TestK::test_method": "PASSED",
    "tests/test_t.py::TestK::test_m[1]": "PASSED",
    "tests/test_t.py::TestK::test_m[2]": "FAILED",
    "tests/test_t.py::test_xfail": "XFAIL",
    "tests/test_t.py::test_xpass": "XPASS",          # from the text: the XML calls it passed
    "tests/test_t.py::test_skip": "SKIPPED",
    "tests/test_t.py::test_pass_then_teardown_error": "ERROR",
    "tests/test_t.py::test_fail_then_teardown_error": "FAILED",
    "tests/test_t.py::test_setup_error": "ERROR",
}


@pytest.fixture(scope="module")
def junit_run(tmp_path_factory):
    """A real pytest run (this interpreter's pytest) of tricky tests: its JUnit XML and its -rA log."""
    root = tmp_path_factory.mktemp("junit")
    (root / "tests").mkdir()
    (root / "tests" / "test_t.py").write_text(TRICKY)
    (root / "tests" / "test_broken.py").write_text("import no_such_module_zz\n")
    xml = root / "out.xml"
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", "--tb=short", "--color=no",
                        f"--junitxml={xml}", "-o", "junit_family=xunit1", f"--rootdir={root}", "-c", os.devnull,
                        "--continue-on-collection-errors",
                        "tests/test_t.py", "tests/test_broken.py"],
                       cwd=root, capture_output=True, text=True, env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    return xml.read_bytes(), r.stdout + r.stderr


def test_junit_statuses_map_back_to_node_ids(junit_run):
    xml, log = junit_run
    got = merge_text(parse_junit(xml, WANT), parse_pytest(log, WANT))
    assert {t: got.get(t) for t in WANT} == WANT
    assert got["tests/test_broken.py"] == "ERROR"  # a collection error, under the file's path
    # a strict xfail that passes: pytest 8 writes <skipped "passes unexpectedly">, pytest 9 a failure
    assert got["tests/test_t.py::test_xpass_strict"] in ("XPASS", "FAILED")
    # without being told the ids, the file attribute still rebuilds plain ones
    assert parse_junit(xml)["tests/test_t.py::TestK::test_method"] == "PASSED"


def test_junit_key_is_pytests_own(junit_run):
    from _pytest.junitxml import bin_xml_escape, mangle_test_address

    for tid in [*WANT, "a/b.py::C::D::test[x::y]", "t.py::test[\x07\x1b]"]:
        names = mangle_test_address(tid)
        assert junit_key(tid) == (".".join(names[:-1]), bin_xml_escape(names[-1])), tid


def test_text_cannot_make_a_result_better(junit_run):
    xml, _ = junit_run
    lying_log = "\n".join(f"PASSED {t}" for t in WANT)
    got = merge_text(parse_junit(xml, WANT), parse_pytest(lying_log, WANT))
    assert got["tests/test_t.py::test_param[x]y]"] == "FAILED"
    assert merge_text({"a": "PASSED", "b": "FAILED"}, {"a": "XPASS", "b": "PASSED"}) == {"a": "XPASS", "b": "FAILED"}


@pytest.mark.parametrize(("data", "words"), [
    (b'<?xml version="1.0"?><!DOCTYPE x [<!ENTITY a "aaaa">]><testsuites/>', "DTD"),
    (b"<testsuites><testcase", "not XML"),
    (b"<testsuites>" + b" " * (MAX_RESULT_BYTES + 1) + b"</testsuites>", "over the"),
])
def test_junit_files_pytest_never_writes_are_refused(data, words):
    with pytest.raises(ResultFileError, match=words):
        parse_junit(data)


def test_junit_duplicates_keep_the_worst():
    xml = (b'<testsuites><testsuite><testcase classname="t" name="test_a"/>'
           b'<testcase classname="t" name="test_a"><error message="teardown"/></testcase>'
           b'<testcase classname="t" name="test_b"><failure message="x"/></testcase>'
           b'<testcase classname="t" name="test_b"><error message="teardown"/></testcase></testsuite></testsuites>')
    assert parse_junit(xml, ["t.py::test_a", "t.py::test_b"]) == {"t.py::test_a": "ERROR", "t.py::test_b": "FAILED"}
