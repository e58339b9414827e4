"""The runners as each dataset's harness builds them, and the official verdicts on their logs (no Docker needed).

The eval scripts come from the pinned ``swebench`` 4.1.0 in its own process, which must work with no network
at all: one test runs it in a network namespace of its own (``unshare -n``, root only). The log cases are the
ones the issue names — a skipped FAIL_TO_PASS test, a truncated id, a missing end marker, a non-zero exit with
no failure, forged result lines — graded by 4.1.0 and 5.0.2 as their ``get_eval_report`` does.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from envs.datasets.rules import SWE_BENCH_REPOS
from envs.grading.command import END, START, parse_test_command, run_script
from envs.grading.runners import official, spec
from envs.grading.runners.judge import official_report
from envs.task import LOG_PARSERS, Task

BASE = "0123456789abcdef0123456789abcdef01234567"
TEST_PATCH = """diff --git a/tests/queries/tests.py b/tests/queries/tests.py
--- a/tests/queries/tests.py
+++ b/tests/queries/tests.py
@@ -1,1 +1,2 @@
 x
+y
diff --git a/tests/queries/old.py b/tests/queries/old.py
deleted file mode 100644
--- a/tests/queries/old.py
+++ /dev/null
@@ -1 +0,0 @@
-z
"""
PATCH = "diff --git a/django/q.py b/django/q.py\n--- a/django/q.py\n+++ b/django/q.py\n@@ -1 +1 @@\n-a\n+b\n"
F2P = "test_ticket (queries.tests.Queries1Tests)"


def _task(**fields) -> Task:
    rec = {"instance_id": "django__django-11099", "repo": "django/django", "version": "3.0", "base_commit": BASE,
           "patch": PATCH, "test_patch": TEST_PATCH, "problem_statement": "p", "FAIL_TO_PASS": [F2P],
           "PASS_TO_PASS": ["test_other (queries.tests.Queries1Tests)"], **fields}
    return Task.from_json(rec)


@pytest.fixture(autouse=True)
def _installed():
    for v in (official.SWEBENCH_4, official.SWEBENCH_5):
        try:
            official.Harness(v).check()
        except official.OfficialHarnessError as e:
            pytest.skip(str(e))


def test_a_swebench_4_record_runs_the_eval_script_its_harness_builds():
    r = spec.runner_for(_task())
    assert (r.family, r.mode, r.official, r.timeout) == ("swebench", "swebench-4", "swebench-4", 1800.0)
    lines = r.eval_script.split("\n")
    assert lines[:5] == ["#!/bin/bash", "set -uxo pipefail", "source /opt/miniconda3/bin/activate",
                         "conda activate testbed", "cd /testbed"]
    assert f"git checkout {BASE} tests/queries/tests.py tests/queries/old.py" in lines
    assert lines.index(START) + 2 == lines.index(END)
    assert r.test_command == "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1 queries.tests queries.old"
    assert r.install == "python -m pip install -e ." and r.install in lines
    assert r.apply == ("git apply --verbose", "git apply --verbose --reject", "patch --batch --fuzz=5 -p1 -i")
    pre = r.preamble()  # what the hardened run keeps: no reinstall, no test reset, no test patch (the grader's)
    assert "conda activate testbed" in pre and "export LANG=en_US.UTF-8" in pre
    assert not any(x.startswith(("git checkout", "git apply", "python -m pip", "+y", "EOF_")) for x in pre)


def test_a_swebench_5_record_brings_its_script_parser_and_type():
    script = "\n".join(["#!/bin/bash", "set -uxo pipefail", "source /opt/miniconda3/bin/activate",
                        "conda activate testbed", "cd /testbed", START,
                        "pytest -rA --tb=no -p no:cacheprovider tests/test_q.py", END, "git checkout x tests/test_q.py"])
    r = spec.runner_for(_task(repo="acme/q", eval_script=script, log_parser="parse_log_pytest", eval_type="pass_and_fail",
                              image="swebench/sweb.eval.x86_64.acme_1776_q-1:latest"))
    assert (r.family, r.mode, r.parser, r.official) == ("swebench", "swebench-5", "parse_log_pytest", "swebench-5")
    assert r.test_command == "pytest -rA --tb=no -p no:cacheprovider tests/test_q.py"
    assert parse_test_command(r.test_command).canary_allowed("tests/test_q.py")
    fail_only = spec.runner_for(_task(repo="acme/q", eval_script=script, log_parser="parse_log_pytest",
                                      eval_type="fail_only"))
    assert fail_only.mode == "fail-only"
    with pytest.raises(spec.RunnerError, match="eval_script"):
        spec.runner_for(_task(repo="acme/q", eval_script="#!/bin/bash\npytest\n"))


def test_a_swe_rebench_record_is_built_from_its_install_config_as_its_fork_does():
    ic = {"test_cmd": "pytest -rA", "log_parser": "parse_log_pytest", "install": "pip install -e .",
          "python": "3.11", "pre_install": None}
    r = spec.runner_for(_task(instance_id="acme__lib-7", repo="acme/lib", version="1.0", install_config=ic))
    assert (r.family, r.mode, r.parser, r.official) == ("swe-rebench", "swebench-4", "parse_log_pytest", "swe-rebench")
    # its fork prefixes the locale and takes the test patch's files less the deleted ones as directives
    assert r.test_command == "LANG=C.UTF-8 LC_ALL=C.UTF-8 pytest -rA tests/queries/tests.py"
    assert r.install == "LANG=C.UTF-8 LC_ALL=C.UTF-8 pip install -e ." and r.install not in r.preamble()


def test_swe_smith_and_r2e_gym_records_get_their_harnesses_commands():
    smith = spec.runner_for(_task(instance_id="pallets__click.fde47b4b.lm_rewrite__abc", repo="swesmith/x",
                                  image_name="jyangballin/swesmith.x86_64.pallets_1776_click.fde47b4b",
                                  FAIL_TO_PASS=["tests/test_b.py::t", "tests/test_a.py::u"], PASS_TO_PASS=[]))
    assert smith.family == "swe-smith" and smith.mode == "swesmith"
    assert smith.test_command == ("pytest --disable-warnings --color=no --tb=no --verbose tests/test_a.py "
                                  "tests/test_b.py")
    r2e = spec.runner_for(_task(expected_output_json=json.dumps({"test_a": "PASSED"}),
                                docker_image="namanjain12/x_final:1"))
    assert (r2e.family, r2e.mode, r2e.timeout) == ("r2e-gym", "r2e-exact", 300.0)
    assert parse_test_command(r2e.test_command).interpreter == ".venv/bin/python"


def test_the_pins_match_the_packages_own_tables():
    """Repositories, apply commands: what spec.py states is what 4.1.0 and 5.0.2 define."""
    def assigned(version: str, rel: str, name: str):
        tree = ast.parse((official.Harness(version).folder / "swebench" / rel).read_text())
        node = next(n for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == name)
        return node.value

    parsers = assigned(official.SWEBENCH_4, "harness/log_parsers/python.py", "MAP_REPO_TO_PARSER_PY")
    assert isinstance(parsers, ast.Dict)
    assert {ast.literal_eval(k) for k in parsers.keys if k is not None} == SWE_BENCH_REPOS
    assert tuple(ast.literal_eval(assigned(official.SWEBENCH_4, "harness/run_evaluation.py", "GIT_APPLY_CMDS"))) \
        == spec.APPLY_4
    assert tuple(ast.literal_eval(assigned(official.SWEBENCH_5, "harness/run_evaluation.py", "GIT_APPLY_CMDS"))) \
        == spec.APPLY_5


def test_the_record_parser_names_are_swebench_5s_python_parsers():
    init = ast.parse((official.Harness(official.SWEBENCH_5).folder / "swebench/harness/log_parsers/__init__.py")
                     .read_text())
    names = {a.name for n in init.body if isinstance(n, ast.ImportFrom) and n.module and n.module.endswith(".python")
             for a in n.names}
    assert {p for p in LOG_PARSERS if p != "pytest"} == names


def test_a_missing_pinned_folder_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTENV_SWEBENCH_HOME", str(tmp_path))
    with pytest.raises(official.OfficialHarnessError, match=r"not installed .*pip install --no-deps --target"):
        spec.runner_for(_task())


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root for unshare -n")
def test_the_official_process_needs_no_network():
    """4.x's make_test_spec fetches requirements from GitHub; the eval script and the report need none: the
    worker answers from a network namespace with no interface but a down loopback, and ``requests`` is refused."""
    inst = {"instance_id": "django__django-11099", "repo": "django/django", "version": "3.0", "base_commit": BASE,
            "test_patch": TEST_PATCH}
    reqs = [{"op": "eval_script", "instance": inst, "specs": None},
            {"op": "report", "spec": {"instance_id": "x", "repo": "django/django", "version": "3.0",
                                      "FAIL_TO_PASS": [F2P], "PASS_TO_PASS": []},
             "log": f"+ {START}\n{F2P} ... ok\n+ {END}\n"}]
    worker = Path(official.__file__).with_name("official_worker.py")
    r = subprocess.run(["unshare", "-n", sys.executable, "-I", "-S", str(worker),
                        str(official.Harness(official.SWEBENCH_4).folder)], input=json.dumps(reqs).encode(),
                       capture_output=True, timeout=60, check=True)
    script, report = json.loads(r.stdout)
    assert script["ok"] and "./tests/runtests.py" in script["script"]
    assert report["ok"] and report["report"]["resolved"] is True
    probe = [{"op": "eval_script", "instance": {**inst, "repo": "acme/none"}, "specs": None}]
    r = subprocess.run(["unshare", "-n", sys.executable, "-I", "-S", str(worker),
                        str(official.Harness(official.SWEBENCH_4).folder)], input=json.dumps(probe).encode(),
                       capture_output=True, timeout=60, check=True)
    assert not json.loads(r.stdout)[0]["ok"]  # an unknown repository is a KeyError, not a download


def _log(body: str, exit_code: int | None = None, end: bool = True) -> str:
    parts = ["+ git status", f"+ {START}", body]
    if end:
        parts.append(f"+ {END}")
    if exit_code is not None:
        parts.append(f">>>>> Test Exit Code: {exit_code}")
    return "\n".join(parts) + "\n"


def _both(task_fields: dict, log: str) -> tuple[bool, bool]:
    four = spec.runner_for(_task(**task_fields))
    script = four.eval_script
    five = spec.runner_for(_task(**task_fields, eval_script=script, log_parser="parse_log_django",
                                 eval_type="pass_and_fail"))
    a, b = official_report(four, _task(**task_fields), log), official_report(five, _task(**task_fields), log)
    assert a.mode == "swebench-4" and b.mode == "swebench-5"
    return a.resolved, b.resolved


def test_official_verdicts_on_the_issues_log_cases():
    other = "test_other (queries.tests.Queries1Tests) ... ok"
    # a skipped FAIL_TO_PASS test: 4.1 ignores it (resolved), 5.0 fails it
    assert _both({}, _log(f"{F2P} ... skipped 'no db'\n{other}")) == (True, False)
    # a missing end marker: neither grades the log
    assert _both({}, _log(f"{F2P} ... ok\n{other}", end=False)) == (False, False)
    # a non-zero exit with no failure logged: 5.0 refuses the log, 4.1 never reads the exit status
    assert _both({}, _log(f"{F2P} ... ok\n{other}", exit_code=1)) == (True, False)
    # forged lines: the patch printed Django's " ... ok" for a test that failed — the official reading believes
    # them (the hardened channel decides; see the grader's tests)
    forged = f"{F2P} ... FAIL\n{other}\n{F2P} ... ok"
    assert _both({}, _log(forged, exit_code=0)) == (True, True)


def test_a_truncated_id_resolves_under_5_only():
    truncated = "tests/test_f.py::test_grammar[log(phot"  # (4.x's parser cuts at spaces: cut mid-word here)
    log = _log(f"PASSED {truncated}on)]\nPASSED tests/test_f.py::test_ok")
    fields = {"instance_id": "astropy__astropy-1", "repo": "astropy/astropy", "version": "5.0",
              "FAIL_TO_PASS": [truncated], "PASS_TO_PASS": ["tests/test_f.py::test_ok"],
              "test_patch": TEST_PATCH.replace("tests/queries/tests.py", "tests/test_f.py")}
    four = spec.runner_for(_task(**fields))
    five = spec.runner_for(_task(**fields, eval_script=four.eval_script, log_parser="parse_log_pytest",
                                 eval_type="pass_and_fail"))
    assert official_report(four, _task(**fields), log).resolved is False
    assert official_report(five, _task(**fields), log).resolved is True


def test_the_run_script_is_the_harness_shape_with_the_grader_in_the_middle():
    r = spec.runner_for(_task(repo="acme/q", eval_script="\n".join(
        ["#!/bin/bash", "set -uxo pipefail", "source /opt/miniconda3/bin/activate", "conda activate testbed",
         "python -m pip install -e .", START, "pytest -rA tests/test_q.py", END]), log_parser="parse_log_pytest"))
    inv = parse_test_command(r.test_command)
    text = run_script(_task(), inv, "/opt/miniconda3/envs/testbed/bin/python", "/var/lib/agentenv-grade-x",
                      preamble=r.preamble(), command=r.test_command, solo=True)
    lines = text.split("\n")
    assert lines[:4] == ["exec 2>&1", "set -uxo pipefail", "source /opt/miniconda3/bin/activate",
                         "conda activate testbed"]
    assert "python -m pip install -e ." not in lines  # the hardened run never reinstalls
    run = lines[lines.index(START) + 1]
    assert "/var/lib/agentenv-grade-x/guard.py" in run and "tests/test_q.py" in run and "--junitxml=" in run
    assert lines[lines.index(START) + 2:lines.index(START) + 5] == ["rc=$?", END, 'echo ">>>>> Test Exit Code: $rc"']
