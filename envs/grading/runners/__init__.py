"""Each dataset's test runner, log parser and verdict mode, in one typed place; and what sets the reward.

- ``spec``: ``runner_for(task)`` -> ``Runner``: the dataset family of a record (``family``: from ``task.dataset``,
  and for SWE-bench its ``eval_script``: 5.x or 4.x; SWE-Gym, SWE-rebench, SWE-smith, R2E-Gym, agentenv's own and
  SWE-bench-extra's), its eval script as its harness builds it, the test command between its markers, its
  patch-apply fallbacks, its timeout, its official parser and verdict mode;
- ``official`` (+ ``official_worker.py``): the pinned ``swebench`` 4.1.0 and 5.0.2, each in its own folder and
  process, offline: eval scripts, log parsers, ``get_eval_report``;
- ``parsers``: SWE-smith's and R2E-Gym's parsers (not in ``swebench``), written once from their harnesses;
- ``verdicts``: the verdict modes (``swebench-4``, ``swebench-5``, ``fail-only``, ``swesmith``, ``r2e-exact``,
  ``strict``) and the official report's shape (``Report``);
- ``judge``: the official verdict on the run's log, and the mode's verdict on a hardened channel's statuses.

The runners read a record's fields from the Task only, under the Task's names (``dataset``, ``eval_script``,
``eval_type``, ``log_parser``, "" for a 4.x row, ``install_config``, ``expected_output``, ``hidden_paths``):
``envs.datasets`` is the one place that says what a published field means. (Changed in the integration of
issue 41: ``spec.field``, which read published fields from ``task.metadata`` too, is gone; read ``task.eval_script``
and the like. ``envs.grading.hidden`` puts a task's hidden paths back in the grading sandbox.)

What sets the reward, per runner (``envs.grading.grader``; ``GradeResult.reward_source``):

| runner's test command | reward | when the two disagree |
|---|---|---|
| a pytest invocation (SWE-bench's pytest-family parsers, SWE-smith, SWE-rebench, R2E-Gym, agentenv) | ``hardened``: the mode's verdict on pytest's JUnit file in the grading folder, under the guard, with the isolated re-run and the canaries — **and**, for a dataset's record, the official verdict on the same run's log | 0, with both verdicts and the reason in ``info["grading"]["verdict"]`` (a forged log cannot raise a reward; a hardened pass the official harness does not confirm is not a pass by the dataset's rules) |
| Django's ``runtests.py``, SymPy's ``bin/test`` | ``hardened`` likewise, through their channels (``envs.grading.channels``) | as for pytest |
| any other command | ``official-log``: the official parser's verdict on the run's output (``forgeable``: a patch can print result lines), recorded; the reward is 0 unless ``grade(..., trust_official_log=True)`` | there is no second verdict |

Interface for the hardened channels of other runners (Django, SymPy: a guard, an isolated re-run, canaries):
``envs.grading.command.parse_test_command`` recognises a test command as an ``Invocation`` the grader's guard
can start; for pytest it is the guard's ``pytest`` mode writing ``junit.xml`` into the grading folder, read by
``envs.grading.results``. A channel for another runner extends the same three places: the guard's mode word
in ``Invocation`` (``interpreter``, ``args``), the result file it writes in the grading folder, and its reader
returning test id (as the dataset names it: Django's ``test_x (app.tests.Class)``) -> PASSED / FAILED / ERROR /
SKIPPED; the grader then applies the runner's verdict mode to that map (``judge.hardened_report``) and records
the official one beside it, unchanged.
"""

from envs.grading.runners.official import SWEBENCH_4, SWEBENCH_5, Harness, OfficialHarnessError
from envs.grading.runners.spec import FAMILIES, Family, Runner, RunnerError, family, runner_for
from envs.grading.runners.verdicts import MODES, Mode, Report, verdict

__all__ = ["FAMILIES", "MODES", "SWEBENCH_4", "SWEBENCH_5", "Family", "Harness", "Mode", "OfficialHarnessError", "Report",
           "Runner", "RunnerError", "family", "runner_for", "verdict"]
