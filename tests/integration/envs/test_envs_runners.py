"""A SWE-bench 5-shaped record (its own ``eval_script``, ``log_parser``, ``eval_type``) graded end to end on a
shipped library's image: the test command between its markers runs under the grader's guard, the JUnit file
decides ours, ``swebench`` 5.0.2 reads the same run's log, and the result records both, the mode and what set
the reward. Gold resolves with both verdicts agreeing; an empty patch does not."""

from __future__ import annotations

import dataclasses
import shlex

import pytest

from envs.grading.runners.official import SWEBENCH_5, Harness, OfficialHarnessError
from envs.swe_env import SWEEnv
from envs.task import Task

from .swe_cases import reset_env, run

pytestmark = pytest.mark.integration


def _as_swebench_5(task: Task) -> Task:
    cmd = task.test_command.replace("{tests}", " ".join(shlex.quote(f) for f in task.test_files))
    script = "\n".join(["#!/bin/bash", "set -uxo pipefail", "cd /testbed", "git status",
                        ": '>>>>> Start Test Output'", cmd, ": '>>>>> End Test Output'",
                        f"git checkout {task.base_commit} {' '.join(task.test_files)}"]) + "\n"
    return dataclasses.replace(task, dataset="swe-bench", eval_script=script, log_parser="parse_log_pytest",
                               eval_type="pass_and_fail")


def test_a_swebench_5_record_is_graded_by_its_script_with_both_verdicts():
    try:
        Harness(SWEBENCH_5).check()
    except OfficialHarnessError as e:
        pytest.skip(str(e))
    with reset_env("toolz") as (shipped, _):
        pass
    task = _as_swebench_5(shipped)
    env = SWEEnv(task=task)
    try:
        env.reset()
        sb = env.sandbox
        assert sb is not None
        empty = env.grade()
        assert not empty.resolved and empty.runner == "swebench" and empty.mode == "swebench-5"
        assert empty.official is not None and not empty.official.resolved and empty.agree is True
        sb.write_file("/tmp/gold.patch", task.patch.encode())
        run(sb, "git apply /tmp/gold.patch")
        gold = env.grade()
        assert gold.resolved, (gold.error, gold.log_tail[-2000:])
        info = gold.to_info()["grading"]["verdict"]
        assert info["reward_source"] == "hardened" and not info["forgeable"] and info["agree"] is True
        assert info["official"]["resolution"] == "RESOLVED_FULL"
        assert set(info["official"]["tests_status"]["FAIL_TO_PASS"]["success"]) == set(task.FAIL_TO_PASS)
        assert ">>>>> Test Exit Code: " in gold.log_tail  # recorded after the end marker, as swebench 5 does
    finally:
        env.close()
