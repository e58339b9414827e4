"""Which runner a record gets: ``envs.grading.runners.spec.family`` reads ``task.dataset`` (what ``envs.datasets``
decided from the published fields), and for SWE-bench its ``eval_script``; the runners read the Task's own fields,
under its names. The records are the datasets' own fixtures (tests/unit/envs/data/datasets), loaded as published;
a field that does not fit its dataset's runner is an error naming it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from envs.datasets import DATASETS
from envs.grading.command import parse_test_command
from envs.grading.runners import official, spec
from envs.grading.runners.judge import hardened_report
from envs.task import Task

DATA = Path(__file__).parent / "data" / "datasets"
FAMILY = {"swe-bench-4": "swebench", "swe-bench-5": "swebench", "swe-gym": "swe-gym", "swe-smith": "swe-smith",
          "r2e-gym": "r2e-gym", "swe-rebench": "swe-rebench", "swe-bench-extra": "agentenv"}


def fixture(name: str) -> Task:
    f = json.loads((DATA / f"{name}.json").read_text())
    return Task.from_json(f["record"], dataset=f["dataset"] if name == "swe-gym" else None)


@pytest.fixture
def installed() -> None:
    try:
        official.Harness(official.SWEBENCH_4).check()
    except official.OfficialHarnessError as e:
        pytest.skip(str(e))


def test_every_dataset_has_a_runner_family():
    assert set(spec.FAMILIES) == set(DATASETS)
    with pytest.raises(spec.RunnerError, match="field 'dataset'"):
        spec.family(dataclasses.replace(fixture("swe-gym"), dataset="multi-swe-bench"))


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_each_datasets_record_gets_its_datasets_runner(name):
    assert spec.family(fixture(name)) == FAMILY[name]


def test_the_runners_read_the_tasks_own_fields(installed):
    five = spec.runner_for(fixture("swe-bench-5"))
    assert (five.mode, five.parser, five.official) == ("swebench-5", "parse_log_pytest", "swebench-5")
    assert five.eval_script == fixture("swe-bench-5").eval_script
    rebench = spec.runner_for(fixture("swe-rebench"))
    assert (rebench.parser, rebench.mode) == ("parse_log_pytest", "swebench-4")  # install_config's, on the Task
    assert rebench.test_command.startswith("LANG=C.UTF-8 LC_ALL=C.UTF-8 pytest")
    gym = spec.runner_for(fixture("swe-gym"))
    assert (gym.family, gym.parser, gym.official) == ("swe-gym", "parse_log_pytest", "swebench-4")
    smith = spec.runner_for(fixture("swe-smith"))
    assert smith.test_command.endswith(" toolz/tests/test_itertoolz.py") and smith.mode == "swesmith"
    extra = spec.runner_for(fixture("swe-bench-extra"))
    assert (extra.family, extra.mode, extra.test_command) == ("agentenv", "strict", fixture("swe-bench-extra").test_command)


def test_r2e_gym_is_judged_against_the_tasks_expected_map():
    task = fixture("r2e-gym")
    runner = spec.runner_for(task)
    assert (runner.mode, runner.timeout) == ("r2e-exact", spec.R2E_TIMEOUT)
    assert parse_test_command(runner.test_command).interpreter == ".venv/bin/python"
    assert spec.R2E_LINK in runner.preamble()  # its tests, restored at /r2e_tests, linked where the command looks
    ok = {f"r2e_tests/test_1.py::{k}": "PASSED" for k in task.expected_output}
    assert hardened_report(runner, task, ok).resolved
    assert not hardened_report(runner, task, {**ok, "r2e_tests/test_1.py::test_extra": "PASSED"}).resolved


@pytest.mark.parametrize(("name", "change", "field"), [
    ("swe-bench-4", {"log_parser": "parse_log_pytest"}, "log_parser"),   # 4.x: the parser is the repository's
    ("swe-bench-4", {"eval_type": "fail_only"}, "eval_type"),
    ("swe-bench-4", {}, "repo"),                                         # swebench has no specs for pytoolz/toolz
    ("swe-bench-5", {"log_parser": ""}, "log_parser"),                   # 5.x rows name their parser
    ("swe-smith", {"eval_script": "x"}, "eval_script"),                  # only SWE-bench 5 rows bring a script
    ("swe-bench-extra", {"log_parser": "parse_log_django"}, "log_parser"),
    ("swe-rebench", {"install_config": {"log_parser": "parse_log_pytest"}}, "install_config"),
    ("swe-gym", {"version": ""}, "version"),
])
def test_a_field_that_does_not_fit_its_datasets_runner_is_named(installed, name, change, field):
    with pytest.raises(spec.RunnerError, match=f"field '{field}'"):
        spec.runner_for(dataclasses.replace(fixture(name), **change))


def test_r2e_gyms_hidden_paths_are_out_of_the_patchs_reach():
    """run_tests.sh (inside /testbed) is dropped from a patch like a test file; the restore removes what stands at
    each hidden path before unpacking the image's; the guard refuses the patch's code both paths and the link."""
    from envs.grading import hidden
    from envs.grading.grader import filter_for

    task = fixture("r2e-gym")
    patch = b"diff --git a/run_tests.sh b/run_tests.sh\nnew file mode 100644\n--- /dev/null\n+++ b/run_tests.sh\n" \
            b"@@ -0,0 +1 @@\n+echo PASSED\n"
    assert [(d.path, d.reason) for d in filter_for(task, patch).dropped] == [("run_tests.sh", "test")]
    lines = hidden.restore_lines(task, "/var/lib/agentenv-grade-x", packed=True)
    assert lines[0].startswith("rm -rf -- /r2e_tests /testbed/run_tests.sh ") and "tar -C / -xpf" in lines[1]
    assert hidden.guard_paths(task, spec.runner_for(task).links) == ["/r2e_tests", "/testbed/run_tests.sh",
                                                                     "/testbed/r2e_tests"]
    assert hidden.restore_lines(fixture("swe-smith"), "/x", packed=False) == []
