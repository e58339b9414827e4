"""How a dataset's harness runs a record's tests: its eval script, its patch-apply fallbacks, its deadline.

``runner_for(task)`` reads which dataset a record comes from (``family``) and builds its ``Runner``:

| family | eval script | log parser | verdict | timeout |
|---|---|---|---|---|
| ``swebench`` 4.x record | ``swebench`` 4.1.0's ``make_eval_script_list`` (no GitHub fetch) | by repository (``MAP_REPO_TO_PARSER``) | ``swebench-4`` (``fail-only`` for its FAIL_ONLY repositories) | 1800 s |
| ``swebench`` 5.x record (``eval_script`` field) | the record's own | the record's ``log_parser`` | ``swebench-5`` (``eval_type``) | 1800 s |
| ``swe-rebench`` (``install_config``) | 4.1.0's builder with the record's ``install_config`` as its specs, as SWE-rebench's fork cleans it | ``install_config.log_parser`` | ``swebench-4`` | 1800 s |
| ``swe-gym`` (repositories ``swebench`` has no specs for) | 4.1.0's builder, specs ``pytest -rA`` | ``parse_log_pytest`` | ``swebench-4`` | 1800 s |
| ``swe-smith`` | ``run_patch_in_container``'s: conda ``testbed``, the markers, the profile's command and the FAIL_TO_PASS files | SWE-smith's | ``swesmith`` | 1800 s |
| ``r2e-gym`` (``expected_output_json``) | ``run_tests.sh`` (``.venv/bin/python -W ignore -m pytest -rA r2e_tests``) in /testbed | R2E-Gym's | ``r2e-exact`` | 300 s |
| ``agentenv`` (our own and bring-your-own records) | the task's ``test_command`` | ``pytest`` | ``strict`` | the grader's |

A runner's ``preamble`` is its eval script up to the start marker, less what the grader does itself (the test
files reset and the test patch applied: ``envs.grading.grader`` applies and checks them) and less its reinstall
step (``install``: ``pip install -e .`` runs the patch's ``setup.py`` as root before the tests, where it could
rewrite the interpreter; the hardened run never reinstalls, see ``docs/security.md``). ``test_command`` is the
line between its markers. ``apply`` are the harness's patch-apply commands, tried in order.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from envs.grading.command import END, START
from envs.grading.runners import official
from envs.grading.runners.verdicts import Mode
from envs.task import PYTEST_COMMAND, Task

Family = Literal["swebench", "swe-gym", "swe-rebench", "swe-smith", "r2e-gym", "agentenv"]
# the patch-apply commands of each harness (swebench 4.1.0's and SWE-rebench's GIT_APPLY_CMDS, 5.0.2's, SWE-smith's)
APPLY_4 = ("git apply --verbose", "git apply --verbose --reject", "patch --batch --fuzz=5 -p1 -i")
APPLY_5 = ("git apply --verbose", "git apply --verbose --3way", "git apply --verbose --reject",
           "patch --batch --forward --fuzz=5 -p1 -i")
APPLY_R2E = ("git apply --whitespace=fix",)
APPLY_AGENTENV = ("git apply --whitespace=nowarn",)
SWEBENCH_TIMEOUT = 1800.0
R2E_TIMEOUT = 300.0
# the Python repositories swebench 4.1.0 has specs and parsers for (a unit test checks the package agrees)
SWEBENCH_REPOS = frozenset({
    "astropy/astropy", "django/django", "marshmallow-code/marshmallow", "matplotlib/matplotlib", "mwaskom/seaborn",
    "pallets/flask", "psf/requests", "pvlib/pvlib-python", "pydata/xarray", "pydicom/pydicom", "pylint-dev/astroid",
    "pylint-dev/pylint", "pytest-dev/pytest", "pyvista/pyvista", "scikit-learn/scikit-learn", "sqlfluff/sqlfluff",
    "sphinx-doc/sphinx", "sympy/sympy"})
SWESMITH_TEST_CMD = "pytest --disable-warnings --color=no --tb=no --verbose"
R2E_TEST_CMD = ("PYTHONWARNINGS='ignore::UserWarning,ignore::SyntaxWarning' .venv/bin/python -W ignore -m pytest "
                "-rA r2e_tests")
SWEGYM_SPECS = {"test_cmd": "pytest --no-header -rA --tb=no -p no:cacheprovider"}
_INSTALLERS = re.compile(r"^\s*(?:\S+=\S*\s+)*(?:python[0-9.]*\s+-m\s+pip|pip[0-9.]*|python[0-9.]*\s+setup\.py)\s")
_HEREDOC = re.compile(r"^git apply\b.*<<\s*'?([A-Za-z0-9_]+)'?\s*$")


class RunnerError(ValueError):
    """A record's grading fields do not make a runner (the message names the field)."""


@dataclass(frozen=True)
class Runner:
    family: Family
    mode: Mode
    eval_script: str = ""               # the script as the harness builds it ("": the task's test_command alone)
    test_command: str = ""              # the command between the markers
    parser: str = "pytest"              # the official log parser
    official: str = "agentenv"          # who grades the log: swebench-4, swebench-5, swe-rebench, swe-smith, r2e-gym
    timeout: float | None = None        # the harness's deadline for the tests (None: the grader's)
    apply: tuple[str, ...] = APPLY_AGENTENV
    install: str = ""                   # the eval script's reinstall step
    spec: Mapping[str, Any] | None = None   # what the official report needs of the record

    def preamble(self) -> list[str]:
        """The eval script's lines before the start marker that the hardened run keeps (see the module doc)."""
        lines = self.eval_script.split("\n")
        if START not in lines:
            return []
        out: list[str] = []
        heredoc = ""
        for line in lines[:lines.index(START)]:
            if heredoc:
                heredoc = "" if line == heredoc else heredoc
                continue
            m = _HEREDOC.match(line)
            if m:
                heredoc = m.group(1)
                continue
            if line.startswith(("#!", "set -")) or re.match(r"^git checkout [0-9a-f]{7,40} ", line):
                continue
            if (self.install and line.strip() == self.install.strip()) or _INSTALLERS.match(line):
                continue
            out.append(line)
        return out


def field(task: Task, name: str) -> Any:
    """A record field: the task's attribute when it has one, else the published field kept in its metadata."""
    v = getattr(task, name, None)
    return v if v not in (None, "") else task.metadata.get(name)


def family(task: Task) -> Family:
    """Which dataset's harness grades ``task`` (an explicit ``dataset`` field wins)."""
    named = str(field(task, "dataset") or "").lower().replace("_", "-")
    for fam in ("swe-rebench", "swe-smith", "r2e-gym", "swe-gym", "agentenv"):
        if fam in named:
            return fam
    if "swe-bench" in named or "swebench" in named:
        return "swebench"
    if field(task, "expected_output_json") is not None:
        return "r2e-gym"
    if field(task, "install_config"):
        return "swe-rebench"
    if field(task, "eval_script"):
        return "swebench"
    if field(task, "image_name") and re.fullmatch(r"[^/]+__[^/]+\.[0-9a-f]{8}\..+", task.instance_id):
        return "swe-smith"
    if task.test_command == PYTEST_COMMAND and task.repo in SWEBENCH_REPOS:
        return "swebench"
    if task.test_command == PYTEST_COMMAND and "xingyaoww/sweb.eval" in task.image:
        return "swe-gym"
    return "agentenv"


def _between(script: str) -> str:
    lines = script.split("\n")
    if START not in lines or END not in lines[lines.index(START):]:
        raise RunnerError(f"field 'eval_script': no {START!r} ... {END!r} markers around a test command")
    cmd = [x for x in lines[lines.index(START) + 1:lines.index(END)] if x.strip() and not x.startswith("SWEBENCH_")]
    if len(cmd) != 1:
        raise RunnerError(f"field 'eval_script': expected one test command between the markers, found {len(cmd)}")
    return cmd[0]


def _rebench_specs(task: Task) -> dict[str, Any]:
    """SWE-rebench's fork's ``_clean_install_config``."""
    raw = field(task, "install_config")
    ic = json.loads(raw) if isinstance(raw, str) else raw
    if not isinstance(ic, Mapping) or not isinstance(ic.get("test_cmd"), str) or not isinstance(ic.get("log_parser"), str):
        raise RunnerError("field 'install_config': an object with 'test_cmd' and 'log_parser' strings is required")
    specs = {k: v for k, v in ic.items() if v is not None}
    if not specs.get("pre_install"):
        specs["pre_install"] = []
    if "install" in specs:
        specs["install"] = "LANG=C.UTF-8 LC_ALL=C.UTF-8 " + specs["install"]
    specs["test_cmd"] = "LANG=C.UTF-8 LC_ALL=C.UTF-8 " + specs["test_cmd"]
    return specs


def _spec(task: Task, **more: Any) -> dict[str, Any]:
    return {"instance_id": task.instance_id, "repo": task.repo, "version": task.version,
            "FAIL_TO_PASS": list(task.FAIL_TO_PASS), "PASS_TO_PASS": list(task.PASS_TO_PASS), **more}


def _built(task: Task, specs: Mapping[str, Any] | None, directives: str = "") -> tuple[str, str]:
    """(eval script, install step) from swebench 4.1.0's builder, in its own process."""
    inst = {"instance_id": task.instance_id, "repo": task.repo, "version": task.version,
            "base_commit": task.base_commit, "test_patch": task.test_patch}
    req: dict[str, Any] = {"op": "eval_script", "instance": inst, "specs": specs}
    if directives:
        req["directives"] = directives
    ans = official.harness(4).call([req])[0]
    return str(ans["script"]), str(ans["install"])


def runner_for(task: Task) -> Runner:
    """The runner of ``task``'s dataset (see the module doc); 4.x eval scripts are built by the official process."""
    fam = family(task)
    if fam == "agentenv":
        return Runner("agentenv", "strict", test_command=task.test_command)
    if fam == "r2e-gym":
        cmd = str(field(task, "run_tests") or R2E_TEST_CMD)
        script = "\n".join(["#!/bin/bash", "set -uxo pipefail", "cd /testbed", START, cmd, END]) + "\n"
        return Runner("r2e-gym", "r2e-exact", script, cmd, "r2e", "r2e-gym", R2E_TIMEOUT, APPLY_R2E)
    if fam == "swe-smith":
        files = sorted({t.split("::", 1)[0] for t in task.FAIL_TO_PASS})
        cmd = " ".join([str(field(task, "test_cmd") or SWESMITH_TEST_CMD), *files])
        script = "\n".join(["#!/bin/bash", "set -uxo pipefail", "source /opt/miniconda3/bin/activate",
                            "conda activate testbed", "cd /testbed", START, cmd, END]) + "\n"
        return Runner("swe-smith", "swesmith", script, cmd, "swesmith", "swe-smith", SWEBENCH_TIMEOUT, APPLY_4,
                      spec={"test_files": files if "pytest" in cmd else []})
    if not task.version:
        raise RunnerError(f"task {task.instance_id!r}: field 'version' is required to build its eval script")
    if fam == "swe-rebench":
        specs = _rebench_specs(task)
        script, install = _built(task, specs, "rebench")
        return Runner("swe-rebench", "swebench-4", script, _between(script), str(specs["log_parser"]),
                      "swe-rebench", SWEBENCH_TIMEOUT, APPLY_4, install,
                      _spec(task, log_parser=specs["log_parser"]))
    script = str(field(task, "eval_script") or "")
    if script:  # a SWE-bench 5 row carries its own script, parser and evaluation type
        eval_type = str(field(task, "eval_type") or "pass_and_fail")
        parser = str(field(task, "log_parser") or "parse_log_pytest")
        if parser == "pytest":
            parser = "parse_log_pytest"
        mode: Mode = "fail-only" if eval_type == "fail_only" else "swebench-5"
        return Runner("swebench", mode, script, _between(script), parser, "swebench-5", SWEBENCH_TIMEOUT, APPLY_5,
                      spec=_spec(task, image=task.image, log_parser=parser, eval_type=eval_type))
    if fam == "swe-gym":
        script, install = _built(task, SWEGYM_SPECS)
        return Runner("swe-gym", "swebench-4", script, _between(script), "parse_log_pytest", "swebench-4",
                      SWEBENCH_TIMEOUT, APPLY_4, install, _spec(task, parser="parse_log_pytest"))
    script, install = _built(task, None)
    return Runner("swebench", "swebench-4", script, _between(script), "by-repository", "swebench-4",
                  SWEBENCH_TIMEOUT, APPLY_4, install, _spec(task))
