"""Our result parsers against the official SWE-bench package's pytest log parser, on the logs of every shipped
task (issue 9 §2): each library's suite run once as shipped (the gold state) and once per task with that
task's bug, in the library's image, with the -rA text log and the JUnit XML of the same run.

For every FAIL_TO_PASS and PASS_TO_PASS id, whether it passes must be the same for our JUnit reader (what
grading uses), our text parser and ``swebench.harness.log_parsers.python.parse_log_pytest`` (ids with a
space excepted: swebench cuts them at the space); and over whole logs our text parser and swebench's must
agree (see ``disagreements``). The package is a test-only dependency (``pip install --no-deps swebench``);
the test is skipped without it.
"""

from __future__ import annotations

import shlex

import pytest

import agentenv
from envs.grading import PASSING, parse_junit, parse_pytest
from envs.images import build_image
from envs.task import Task, shipped_tasks
from envs.tasks.libraries import load_libraries

from ...unit.envs.swebench_official import SWEBENCH_PASSING, load_swebench_parser

pytestmark = pytest.mark.integration
def run_tests(sb: agentenv.Sandbox, task: Task) -> tuple[str, bytes]:
    tests = " ".join(shlex.quote(f) for f in task.test_files)
    cmd = (task.test_command.replace("{tests}", tests) + " --junitxml=/tmp/junit.xml -o junit_family=xunit1 "
           "-p no:cacheprovider --rootdir=/testbed")
    r = sb.exec(f"rm -f /tmp/junit.xml; PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 {cmd}", timeout=600, cwd="/testbed")
    return r.stdout + r.stderr, sb.read_file("/tmp/junit.xml")


def compare(task: Task, log: str, xml: bytes, swebench: dict[str, str], gold: bool) -> list[str]:
    expected = [*task.FAIL_TO_PASS, *task.PASS_TO_PASS]
    junit, text = parse_junit(xml, expected), parse_pytest(log, expected)
    problems = []
    for tid in expected:
        want = gold or tid in task.PASS_TO_PASS
        got = {"junit": junit.get(tid, "MISSING"), "text": text.get(tid, "MISSING")}
        if not any(c.isspace() for c in tid):
            got["swebench"] = swebench.get(tid, "MISSING")
        verdicts = {k: v in (SWEBENCH_PASSING if k == "swebench" else PASSING) for k, v in got.items()}
        if set(verdicts.values()) != {want}:
            problems.append(f"{task.instance_id} ({'gold' if gold else 'bug'}) {tid}: {got}")
    for tid, status in swebench.items():  # the whole log: ids outside the task's lists too
        mine = text.get(tid)
        if mine is not None and (status in SWEBENCH_PASSING) != (mine in PASSING):
            problems.append(f"{task.instance_id} {tid}: text {mine}, swebench {status}")
    return problems


def test_every_shipped_tasks_logs_read_the_same_as_swebench_reads_them():
    parse, version = load_swebench_parser()
    tasks = shipped_tasks()
    problems: list[str] = []
    logs = 0
    for lib in load_libraries():
        mine = [t for t in tasks if t.metadata["library"] == lib.name]
        if not mine:
            continue
        build_image(lib.recipe)
        with agentenv.Sandbox.create(lib.image, cpus=1.0, memory="2g") as sb:
            gold_runs: dict[tuple[str, ...], tuple[str, bytes]] = {}
            for task in mine:  # the gold state is the library as shipped: one run per set of test files
                key = tuple(task.test_files)
                if key not in gold_runs:
                    gold_runs[key] = run_tests(sb, task)
                    logs += 1
                log, xml = gold_runs[key]
                problems += compare(task, log, xml, parse(log, None), gold=True)
            for task in mine:
                sb.write_file("/tmp/gold.patch", task.patch)
                r = sb.exec("git apply -R /tmp/gold.patch", cwd="/testbed")
                assert r.exit_code == 0, r.stderr
                log, xml = run_tests(sb, task)
                problems += compare(task, log, xml, parse(log, None), gold=False)
                logs += 1
                sb.exec("git checkout -q -- . && git clean -fdq", cwd="/testbed")
    print(f"swebench {version}: {logs} logs of {len(tasks)} tasks compared, {len(problems)} disagreements")
    assert logs > len(tasks)
    assert not problems, problems[:20]
