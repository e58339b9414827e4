"""SWE-smith's and R2E-Gym's log readings and verdicts, on their own repositories' fixtures.

The SWE-smith log is the one its ``tests/harness/test_grading.py::test_read_test_output`` reads (a pandas
instance, 11 tests); the R2E-Gym log is the one ``r2egym/repo_analysis/execution_log_parser.py`` parses in
its ``__main__`` (a sympy instance, 21 passed and 1 failed).
"""

from __future__ import annotations

import json

from envs.grading.runners.judge import hardened_report, official_report
from envs.grading.runners.parsers import clean_r2e, parse_r2e, parse_swesmith, swesmith_test_output
from envs.grading.runners.spec import runner_for
from envs.grading.runners.verdicts import r2e_key, verdict
from envs.task import Task

P = "pandas/tests/indexing/test_datetime.py::TestDatetimeIndex::"
SMITH_IDS = ["test_get_loc_naive_dti_aware_str_deprecated", "test_indexing_with_datetime_tz", "test_indexing_fast_xs",
             "test_consistency_with_tz_aware_scalar", "test_indexing_with_datetimeindex_tz[setitem]",
             "test_indexing_with_datetimeindex_tz[loc]", "test_nanosecond_getitem_setitem_with_tz",
             "test_getitem_str_slice_millisecond_resolution[DataFrame]",
             "test_getitem_str_slice_millisecond_resolution[Series]", "test_getitem_pyarrow_index[DataFrame]",
             "test_getitem_pyarrow_index[Series]"]
SMITH_LOG = ("+ source /opt/miniconda3/bin/activate\n+ : '>>>>> Start Test Output'\n"
             "+ pytest --disable-warnings --color=no --tb=no --verbose pandas/tests/indexing/test_datetime.py\n"
             "collecting ... collected 11 items\n\n"
             + "".join(f"{P}{t} PASSED\n" for t in SMITH_IDS)
             + "\n============================== 11 passed in 0.10s ==============================\n"
             "+ : '>>>>> End Test Output'\n")

R2E_PASSED = ["test_Idx_construction", "test_Idx_properties", "test_Idx_bounds", "test_Idx_fixed_bounds",
              "test_Idx_inequalities", "test_Idx_func_args", "test_Idx_subs", "test_IndexedBase_sugar",
              "test_IndexedBase_subs", "test_IndexedBase_shape", "test_Indexed_constructor", "test_Indexed_func_args",
              "test_Indexed_subs", "test_Indexed_properties", "test_Indexed_shape_precedence", "test_complex_indices",
              "test_not_interable", "test_Indexed_coeff", "test_differentiation", "test_indexed_series",
              "test_indexed_is_constant"]
R2E_LOG = ("collected 22 items\n\nr2e_tests/test_1.py .....F................   [100%]\n"
           "=========================== short test summary info ============================\n"
           + "".join(f"PASSED r2e_tests/test_1.py::{t}\n" for t in R2E_PASSED)
           + "FAILED r2e_tests/test_1.py::test_Idx_inequalities_current_fails - sympy.utilities.pytest.XFail: "
             "test_Idx_inequalities_current_fails\n==== 1 failed, 21 passed, 2 warnings in 0.57s ====\n")


def _task(**fields) -> Task:
    rec = {"instance_id": "pandas-dev__pandas.95280573.pr_53652", "repo": "swesmith/pandas-dev__pandas.95280573",
           "base_commit": "0123456789abcdef0123456789abcdef01234567", "patch": "diff --git a/a b/a\n--- a/a\n+++ b/a\n",
           "problem_statement": "p", "FAIL_TO_PASS": [P + SMITH_IDS[0]], "PASS_TO_PASS": [P + SMITH_IDS[1]],
           "image_name": "jyangballin/swesmith.x86_64.pandas-dev_1776_pandas.95280573", "image": "i", **fields}
    return Task.from_json(rec)


def test_swe_smith_reads_its_fixture_log():
    body, found = swesmith_test_output(SMITH_LOG)
    assert found and body.startswith("\n+ pytest --disable-warnings")
    assert parse_swesmith(body) == {P + t: "PASSED" for t in SMITH_IDS}
    assert swesmith_test_output(SMITH_LOG.replace("+ : '>>>>> End Test Output'\n", "")) == (
        SMITH_LOG.replace("+ : '>>>>> End Test Output'\n", ""), False)


def test_swe_smith_counts_an_absent_test_as_passed_and_only_failures_fail():
    runner = runner_for(_task())
    assert runner.family == "swe-smith"
    task = _task(PASS_TO_PASS=[P + SMITH_IDS[1], "pandas/tests/indexing/test_datetime.py::test_not_run"])
    assert official_report(runner, task, SMITH_LOG).resolved  # the absent test passes, as SWE-smith says
    failing = SMITH_LOG.replace(f"{P}{SMITH_IDS[0]} PASSED", f"{P}{SMITH_IDS[0]} FAILED")
    assert not official_report(runner, task, failing).resolved
    skipped = {P + SMITH_IDS[0]: "SKIPPED", P + SMITH_IDS[1]: "PASSED"}
    assert hardened_report(runner, task, skipped).resolved  # skipped: in neither list, as in its report
    # tests outside the files its command ran are not graded (filter_irrelevant_tests)
    other = verdict("swesmith", {}, ["other/test_x.py::t"], [], test_files=["pandas/tests/indexing/test_datetime.py"])
    assert other.f2p_failure == () and other.resolved


def test_r2e_gym_reads_its_fixture_log_and_needs_the_exact_map():
    parsed = parse_r2e(clean_r2e(R2E_LOG))
    assert parsed == {**{t: "PASSED" for t in R2E_PASSED}, "test_Idx_inequalities_current_fails": "FAILED"}
    expected = json.dumps(parsed)
    task = _task(instance_id="sympy_003029fe", expected_output_json=expected, FAIL_TO_PASS=["r2e_tests/test_1.py::"
                 "test_Idx_construction"], PASS_TO_PASS=[])
    runner = runner_for(task)
    assert runner.family == "r2e-gym"
    coloured = R2E_LOG.replace("PASSED r2e_tests/test_1.py::test_Idx_bounds", "\x1b[32mPASSED\x1b[0m r2e_tests/"
                               "test_1.py::test_Idx_bounds\r")
    assert official_report(runner, task, coloured).resolved
    # one more test than expected, one fewer, one status changed: each is not resolved
    more = R2E_LOG + "PASSED r2e_tests/test_1.py::test_extra\n"
    fewer = R2E_LOG.replace("PASSED r2e_tests/test_1.py::test_Idx_bounds\n", "")
    changed = R2E_LOG.replace("FAILED r2e_tests/test_1.py::test_Idx_inequalities_current_fails",
                              "PASSED r2e_tests/test_1.py::test_Idx_inequalities_current_fails")
    for log in (more, fewer, changed):
        report = official_report(runner, task, log)
        assert not report.resolved and report.why
    # the hardened map (pytest node ids from JUnit) is keyed as R2E-Gym keys its parser's
    junit = {f"r2e_tests/test_1.py::{k}": v for k, v in parsed.items()}
    assert hardened_report(runner, task, {**junit, "r2e_tests/test_1.py::test_x[1]": "XFAIL"}).resolved
    assert r2e_key("r2e_tests/test_1.py::TestX::test_y[1]") == "TestX.test_y[1]"
