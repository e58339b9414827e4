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


def _shipped_toolz() -> Task:
    """The shipped toolz task; swebench 5.0.2's pinned folder must be there: the bootstrap installs it, so its
    absence is a missing install step, a failure rather than a skip."""
    try:
        Harness(SWEBENCH_5).check()
    except OfficialHarnessError as e:
        pytest.fail(f"{e} (scripts/bootstrap.sh installs it)")
    with reset_env("toolz") as (shipped, _):
        return shipped


def test_a_swebench_5_record_is_graded_by_its_script_with_both_verdicts():
    task = _as_swebench_5(_shipped_toolz())
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


def test_a_runner_no_hardened_channel_runs_scores_0_unless_its_log_is_trusted():
    """A test command that is not a plain pytest invocation runs without the guard, so only the official parser's
    reading of the output decides, which the code under test writes: a patch that prints pytest's result lines at
    exit makes that reading say resolved without a fix. Such a reading scores 0 (the official verdict recorded, the
    reason given); ``trust_official_log=True`` lets it set the reward, for tasks whose code is trusted."""
    shipped = _shipped_toolz()
    task = _as_swebench_5(shipped)
    cmd = shipped.test_command.replace("{tests}", " ".join(shlex.quote(f) for f in shipped.test_files))
    task = dataclasses.replace(task, eval_script=task.eval_script.replace(cmd, f"bash -c {shlex.quote(cmd)}"))
    # the F2P tests passed, and one failure of a test that is not the task's, so that the exit status has its failure
    forged = "".join(f"PASSED {t}\n" for t in task.FAIL_TO_PASS) + f"FAILED {shipped.test_files[0]}::test_decoy\n"
    package = shipped.gold_files[0].split("/", 1)[0]
    for trust in (False, True):
        env = SWEEnv(task=task, trust_official_log=trust)
        try:
            env.reset()
            sb = env.sandbox
            assert sb is not None
            init = f"/testbed/{package}/__init__.py"  # at exit, after pytest's capture, the lines a parser reads
            sb.write_file(init, sb.read_file(init) + b"\nimport os as _o\nclass _Late:\n"
                          + b"    def __del__(self, write=_o.write):\n"
                          + f"        write(1, {forged.encode()!r})\n_late = _Late()\n".encode())
            lie = env.grade()
            assert lie.forgeable and lie.official is not None and lie.official.resolved  # the reading is fooled
            assert lie.resolved is trust
            if not trust:
                assert "no hardened channel" in lie.error
        finally:
            env.close()
