"""How a dataset's harness runs a record's tests: its eval script, its patch-apply fallbacks, its deadline.

``runner_for(task)`` builds the ``Runner`` of the dataset the record comes from: ``family`` reads it from
``task.dataset`` (which ``envs.datasets`` decided from the record's fields, or the caller named), and for
SWE-bench the row's ``eval_script`` tells 5.x (its own script, parser and type) from 4.x (none: its script is
built, its parser picked by repository, ``log_parser`` ""). The record's fields are read from the Task only,
under the Task's names (``envs.datasets`` is the one place that says what a published field means):

| ``task.dataset`` | family | eval script | log parser | verdict | timeout |
|---|---|---|---|---|---|
| ``swe-bench``, no ``eval_script`` (4.x) | ``swebench`` | ``swebench`` 4.1.0's ``make_eval_script_list`` (no GitHub fetch) | by repository (``MAP_REPO_TO_PARSER``) | ``swebench-4`` | 1800 s |
| ``swe-bench`` with ``eval_script`` (5.x) | ``swebench`` | the row's own | the row's ``log_parser`` | ``swebench-5`` (``fail-only`` for ``eval_type`` ``fail_only``) | 1800 s |
| ``swe-rebench`` | ``swe-rebench`` | 4.1.0's builder with ``install_config`` as its specs, as SWE-rebench's fork cleans it | ``log_parser`` (its ``install_config``'s) | ``swebench-4`` | 1800 s |
| ``swe-gym`` | ``swe-gym`` | 4.1.0's builder, specs ``pytest -rA`` | ``parse_log_pytest`` | ``swebench-4`` | 1800 s |
| ``swe-smith`` | ``swe-smith`` | ``run_patch_in_container``'s: conda ``testbed``, the markers, the profile's command and the FAIL_TO_PASS files | SWE-smith's | ``swesmith`` | 1800 s |
| ``r2e-gym`` | ``r2e-gym`` | ``run_tests.sh``'s command (``.venv/bin/python -W ignore -m pytest -rA r2e_tests``) in /testbed, ``r2e_tests`` linked to the restored ``/r2e_tests`` as R2E-Gym's runtime links it | R2E-Gym's | ``r2e-exact`` (``task.expected_output``) | 300 s |
| ``agentenv``, ``swe-bench-extra`` (no harness specs published) | ``agentenv`` | the task's ``test_command`` | ``pytest`` | ``strict`` | the grader's |

A field that does not fit its dataset's runner is an error naming it (``RunnerError``): a 4.x row naming a
parser, a 5.x row without one, an ``eval_script`` on another dataset's record, a 4.x row of a repository
``swebench`` has no specs for.

A runner's ``preamble`` is its eval script up to the start marker, less what the grader does itself (the test
files reset and the test patch applied: ``envs.grading.grader`` applies and checks them) and less its reinstall
step (``install``: ``pip install -e .`` runs the patch's ``setup.py`` as root before the tests, where it could
rewrite the interpreter; the hardened run never reinstalls, see ``docs/security.md``). ``test_command`` is the
line between its markers. ``apply`` are the harness's patch-apply commands, tried in order.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from envs.datasets.rules import SWE_BENCH_REPOS
from envs.grading.command import END, START
from envs.grading.runners import official
from envs.grading.runners.verdicts import Mode
from envs.task import Task

Family = Literal["swebench", "swe-gym", "swe-rebench", "swe-smith", "r2e-gym", "agentenv"]
# the patch-apply commands of each harness (swebench 4.1.0's and SWE-rebench's GIT_APPLY_CMDS, 5.0.2's, SWE-smith's)
APPLY_4 = ("git apply --verbose", "git apply --verbose --reject", "patch --batch --fuzz=5 -p1 -i")
APPLY_5 = ("git apply --verbose", "git apply --verbose --3way", "git apply --verbose --reject",
           "patch --batch --forward --fuzz=5 -p1 -i")
APPLY_R2E = ("git apply --whitespace=fix",)
APPLY_AGENTENV = ("git apply --whitespace=nowarn",)
SWEBENCH_TIMEOUT = 1800.0
R2E_TIMEOUT = 300.0
SWESMITH_TEST_CMD = "pytest --disable-warnings --color=no --tb=no --verbose"
R2E_TEST_CMD = ("PYTHONWARNINGS='ignore::UserWarning,ignore::SyntaxWarning' .venv/bin/python -W ignore -m pytest "
                "-rA r2e_tests")
R2E_TESTS = "r2e_tests"  # R2E-Gym's runtime links its hidden /r2e_tests here, in /testbed, to run them
R2E_LINK = f"rm -rf {R2E_TESTS} && ln -s /{R2E_TESTS} {R2E_TESTS}"
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
    links: tuple[str, ...] = ()         # paths under /testbed its script links to the task's hidden paths

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
            if line.startswith(("#!", "set -")) or re.match(r"^git checkout [0-9a-f]{7,40}( |$)", line):
                continue
            if (self.install and line.strip() == self.install.strip()) or _INSTALLERS.match(line):
                continue
            out.append(line)
        return out


# the runner family of each dataset (``envs.datasets.DATASETS``; a unit test checks every one has its family):
# SWE-bench-extra publishes no harness specs and no images (its records run on agentenv's images), so its records
# run as agentenv's own do: the task's test command, ``strict``
FAMILIES: dict[str, Family] = {"agentenv": "agentenv", "swe-bench": "swebench", "swe-gym": "swe-gym",
                               "swe-smith": "swe-smith", "r2e-gym": "r2e-gym", "swe-rebench": "swe-rebench",
                               "swe-bench-extra": "agentenv"}


def family(task: Task) -> Family:
    """Which harness grades ``task``: its dataset's (``task.dataset``, read from the record by ``envs.datasets``)."""
    try:
        return FAMILIES[task.dataset]
    except KeyError:
        raise RunnerError(f"task {task.instance_id!r}: field 'dataset': no runner for {task.dataset!r} "
                          f"(known: {', '.join(FAMILIES)})") from None


def _between(script: str) -> str:
    lines = script.split("\n")
    if START not in lines or END not in lines[lines.index(START):]:
        raise RunnerError(f"field 'eval_script': no {START!r} ... {END!r} markers around a test command")
    cmd = [x for x in lines[lines.index(START) + 1:lines.index(END)] if x.strip() and not x.startswith("SWEBENCH_")]
    if len(cmd) != 1:
        raise RunnerError(f"field 'eval_script': expected one test command between the markers, found {len(cmd)}")
    return cmd[0]


def _rebench_specs(task: Task) -> dict[str, Any]:
    """SWE-rebench's fork's ``_clean_install_config`` of the record's ``install_config``."""
    ic = task.install_config
    if not isinstance(ic.get("test_cmd"), str) or not task.log_parser:
        raise RunnerError(f"task {task.instance_id!r}: field 'install_config': SWE-rebench's runner needs its "
                          "'test_cmd' and 'log_parser' strings")
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


def _agentenv(task: Task) -> Runner:
    if task.log_parser not in ("pytest", ""):  # "": a dataset's record graded as ours (SWE-bench-extra)
        raise RunnerError(f"task {task.instance_id!r}: field 'log_parser': a {task.dataset} record is graded by "
                          f"its test_command's pytest report, not {task.log_parser!r} (a SWE-bench 5 row brings "
                          "its eval_script: name its dataset swe-bench)")
    return Runner("agentenv", "strict", test_command=task.test_command)


def _r2e(task: Task) -> Runner:
    script = "\n".join(["#!/bin/bash", "set -uxo pipefail", "cd /testbed", R2E_LINK, START, R2E_TEST_CMD, END])
    return Runner("r2e-gym", "r2e-exact", script + "\n", R2E_TEST_CMD, "r2e", "r2e-gym", R2E_TIMEOUT, APPLY_R2E,
                  links=(R2E_TESTS,))


def _swe_smith(task: Task) -> Runner:
    files = sorted({t.split("::", 1)[0] for t in task.FAIL_TO_PASS})
    cmd = " ".join([SWESMITH_TEST_CMD, *files])
    script = "\n".join(["#!/bin/bash", "set -uxo pipefail", "source /opt/miniconda3/bin/activate",
                        "conda activate testbed", "cd /testbed", START, cmd, END]) + "\n"
    return Runner("swe-smith", "swesmith", script, cmd, "swesmith", "swe-smith", SWEBENCH_TIMEOUT, APPLY_4,
                  spec={"test_files": files})


def _swe_rebench(task: Task) -> Runner:
    specs = _rebench_specs(task)
    script, install = _built(task, specs, "rebench")
    return Runner("swe-rebench", "swebench-4", script, _between(script), task.log_parser, "swe-rebench",
                  SWEBENCH_TIMEOUT, APPLY_4, install, _spec(task, log_parser=task.log_parser))


def _swe_gym(task: Task) -> Runner:
    script, install = _built(task, SWEGYM_SPECS)
    return Runner("swe-gym", "swebench-4", script, _between(script), "parse_log_pytest", "swebench-4",
                  SWEBENCH_TIMEOUT, APPLY_4, install, _spec(task, parser="parse_log_pytest"))


def _swe_bench(task: Task) -> Runner:
    """A 5.x row brings its eval script, parser and evaluation type; a 4.x row has its script built by 4.1.0 and
    its parser picked by repository (``log_parser`` "")."""
    if task.eval_script:
        if not task.log_parser or task.log_parser == "pytest":
            raise RunnerError(f"task {task.instance_id!r}: field 'log_parser': a SWE-bench 5 row (with its "
                              f"eval_script) names one of swebench 5's parsers, got {task.log_parser!r}")
        eval_type = task.eval_type or "pass_and_fail"
        mode: Mode = "fail-only" if eval_type == "fail_only" else "swebench-5"
        return Runner("swebench", mode, task.eval_script, _between(task.eval_script), task.log_parser, "swebench-5",
                      SWEBENCH_TIMEOUT, APPLY_5,
                      spec=_spec(task, image=task.image, log_parser=task.log_parser, eval_type=eval_type))
    if task.log_parser or task.eval_type:
        name = "log_parser" if task.log_parser else "eval_type"
        raise RunnerError(f"task {task.instance_id!r}: field {name!r}: a SWE-bench 4.x row (no eval_script) is "
                          "graded by its repository's parser; a row naming its own is a 5.x row: give its eval_script")
    if task.repo not in SWE_BENCH_REPOS:
        raise RunnerError(f"task {task.instance_id!r}: field 'repo': swebench {official.SWEBENCH_4} has no test "
                          f"specs for {task.repo!r} (SWE-bench's repositories: {', '.join(sorted(SWE_BENCH_REPOS))}); "
                          "a record of another dataset names it (--dataset swe-gym, swe-rebench, ...)")
    script, install = _built(task, None)
    return Runner("swebench", "swebench-4", script, _between(script), "by-repository", "swebench-4",
                  SWEBENCH_TIMEOUT, APPLY_4, install, _spec(task))


_BUILDERS: dict[Family, Callable[[Task], Runner]] = {
    "agentenv": _agentenv, "r2e-gym": _r2e, "swe-smith": _swe_smith, "swe-rebench": _swe_rebench,
    "swe-gym": _swe_gym, "swebench": _swe_bench}
_BUILT_BY_4 = frozenset({"swe-rebench", "swe-gym", "swebench"})  # the eval scripts 4.1.0's builder makes


def runner_for(task: Task) -> Runner:
    """The runner of ``task``'s dataset (see the module doc): ``family`` picks it from ``task.dataset``, and for
    SWE-bench its ``eval_script`` (5.x) or none (4.x); 4.x eval scripts are built by the official process."""
    fam = family(task)
    if task.eval_script and fam != "swebench":
        raise RunnerError(f"task {task.instance_id!r}: field 'eval_script': only SWE-bench 5 rows bring their eval "
                          f"script; a {task.dataset} record's runner builds its own (name its dataset swe-bench)")
    if fam in _BUILT_BY_4 and not task.eval_script and not task.version:
        raise RunnerError(f"task {task.instance_id!r}: field 'version' is required to build its eval script")
    return _BUILDERS[fam](task)
