"""How the grader runs a task's tests: its test command read as a pytest invocation, and the script that runs it.

The test command (the task's ``test_command``, or for a dataset's record the command between its eval
script's markers: ``envs.grading.runners.spec``) is kept when it is a plain pytest invocation (``[VAR=value
...] python3 -m pytest ARGS``, ``pytest ARGS``): its ARGS stay (they are the task's, e.g. ``-o addopts= -W
...``) and the grader's options are added, and pytest is started by the grader's guard (``python guard.py
CONFIG pytest ARGS``, see ``envs.grading.audit``) instead of ``-m pytest``, then the isolated run follows
(``solo``, see ``envs.grading.isolation``). Django's ``tests/runtests.py`` and SymPy's ``bin/test`` are started
by the guard too, in their own modes (``python guard.py CONFIG unittest|sympy PROGRAM ARGS``: ``Invocation.channel``,
see ``envs.grading.channels``), with their own arguments. Any other command runs as given, without the guard, the
isolated run or a canary (for agentenv's own tasks with the grader's options in ``PYTEST_ADDOPTS``).

A dataset's record runs as its harness runs it (``run_script``'s ``preamble``): bash with ``set -uxo
pipefail`` and stderr joined to stdout, the eval script's lines up to its start marker (conda ``testbed``
activated, its ``eval_commands``), the ``>>>>> Start Test Output`` / ``>>>>> End Test Output`` markers around
the test command, and the command's exit status printed after the end marker (``>>>>> Test Exit Code: N``,
as ``swebench`` 5 records it), so the combined output is the log the official harness reads.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from envs.grading.audit import CONFIG_FILE, GUARD_FILE
from envs.grading.channels import Channel, channel_for
from envs.grading.patch import WORKDIR
from envs.task import Task

_PYTHON = re.compile(r"(?:.*/)?python[0-9.]*")
_ASSIGN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*")
_SHELL_OPS = frozenset("();<>|&")
# -k / -m / --deselect select tests: the canary could be deselected, so it is not used with them
START = ": '>>>>> Start Test Output'"    # swebench's markers, as its eval scripts write them
END = ": '>>>>> End Test Output'"
EXIT_CODE = ">>>>> Test Exit Code"          # swebench 5's record of the test command's exit status
_SELECTING = ("-k", "-m", "--deselect", "--lf", "--last-failed", "--ff", "--sw", "--stepwise")


def declared_plugins(task: Task) -> list[str]:
    """The pytest plugins a task declares (``"pytest_plugins": [...]`` in its record; default none)."""
    v = task.metadata.get("pytest_plugins", [])
    if isinstance(v, str):
        v = [v]
    return [p for p in v if isinstance(p, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", p)]


@dataclass(frozen=True)
class Invocation:
    """How the tests are run: the pytest arguments (None: the task's own command, options via PYTEST_ADDOPTS)."""

    assignments: tuple[str, ...] = ()
    interpreter: str = ""            # the word naming python, or "pytest" for the console script
    python_flags: tuple[str, ...] = ()
    args: tuple[str, ...] | None = None
    channel: Channel | None = None   # another runner's (Django's, SymPy's): ``args`` are its program and arguments

    def canary_allowed(self, test_file: str = "") -> bool:
        """Canaries can go in ``test_file``: the command runs it (``{tests}`` or the path itself) and selects
        no tests by name or mark."""
        runs = self.args is not None and ("{tests}" in self.args or bool(test_file) and test_file in self.args)
        return runs and not any(
            a == s or a.startswith(s + "=") or (s in ("-k", "-m") and a.startswith(s) and len(a) > 2)
            for a in self.args or () for s in _SELECTING)


def parse_test_command(command: str) -> Invocation:
    """The task's ``test_command`` as a pytest invocation the grader can run itself, when it is one."""
    try:
        lex = shlex.shlex(command, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        words = list(lex)
    except ValueError:
        return Invocation()
    if not words or any(w and set(w) <= _SHELL_OPS for w in words):
        return Invocation()
    assignments = []
    while words and _ASSIGN.fullmatch(words[0]):
        assignments.append(words.pop(0))
    if not words:
        return Invocation()
    head = words[0]
    channel = channel_for(words, assignments)
    if channel is not None:  # Django's tests/runtests.py, SymPy's bin/test: run by the guard's mode for them
        python = head if _PYTHON.fullmatch(head) else "python"   # the program's `#!/usr/bin/env python`
        return Invocation(tuple(assignments), python, (), (channel.script, *channel.args), channel)
    if posixpath.basename(head) in ("pytest", "py.test"):
        return Invocation(tuple(assignments), "pytest", (), tuple(words[1:]))
    if _PYTHON.fullmatch(head):
        i = 1
        while i < len(words):
            w = words[i]
            if w == "-m":
                if i + 1 < len(words) and words[i + 1] in ("pytest", "py.test"):
                    return Invocation(tuple(assignments), head, tuple(words[1:i]), tuple(words[i + 2:]))
                break
            if w in ("-X", "-W"):  # flags that take a value
                i += 2
            elif w.startswith("-") and w != "-c" and w != "-":
                i += 1
            else:
                break
    return Invocation()


def _grader_options(task: Task, inv: Invocation, junit: str) -> list[str]:
    args = list(inv.args or ())
    opts = ["-p", "no:cacheprovider", f"--junitxml={junit}", "-o", "junit_family=xunit1", "-o", "junit_logging=no"]
    for plugin in declared_plugins(task):
        opts += ["-p", plugin]
    if not any(a == "--rootdir" or a.startswith("--rootdir=") for a in args):
        opts.append(f"--rootdir={WORKDIR}")
    return opts


def run_script(task: Task, inv: Invocation, python: str, folder: str, *, guarded: bool = True,
               solo: bool = False, preamble: Sequence[str] | None = None, command: str = "") -> str:
    """The script that runs the tests in the grading sandbox (``envs.grading.grader``'s step 3c).

    ``guarded``: pytest is started by the grader's guard in ``folder`` (a plain pytest invocation only);
    ``solo``: the isolated run follows, once every process the tests left is killed. ``preamble``: a
    dataset's eval-script lines (a bash script in the harness's shape, see the module doc); ``command``:
    its test command, run as it is when not guarded.
    """
    junit = f"{folder}/junit.xml"
    tests = task.test_files
    opts = _grader_options(task, inv, junit)
    clean = ('for v in $(env | sed -n -E \'s/^((PYTHON|PYTEST_)[A-Za-z0-9_]*)=.*/\\1/p\'); do '
             '[ "$v" = PYTHONPATH ] || unset "$v"; done')
    exports = "export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 PYTHONDONTWRITEBYTECODE=1 PYTHONNOUSERSITE=1"
    kill = "kill -s KILL -- -1 2>/dev/null"
    after: list[str] = []
    if inv.args is not None:
        args: list[str] = []
        for a in inv.args:
            args += tests if a == "{tests}" else [a.replace("{tests}", " ".join(tests))]
        env = ["env", *inv.assignments] if inv.assignments else []
        mode = inv.channel.mode if inv.channel is not None else "pytest"
        start = [f"{folder}/{GUARD_FILE}", f"{folder}/{CONFIG_FILE}", mode] if guarded else ["-m", "pytest"]
        if inv.channel is not None:  # the runner's own arguments, none of pytest's options
            args, opts = list(inv.args), []
        cmd = shlex.join([*env, python, *inv.python_flags, *start, *args, *opts])
        if guarded and solo:
            after = [kill, shlex.join([*env, python, *inv.python_flags, f"{folder}/{GUARD_FILE}",
                                       f"{folder}/{CONFIG_FILE}", "solo"]) + f" </dev/null >{folder}/solo.log 2>&1"]
    elif preamble is not None:
        cmd = command
    else:
        cmd = task.test_command.replace("{tests}", " ".join(shlex.quote(f) for f in task.test_files))
        exports += f" PYTEST_ADDOPTS={shlex.quote(shlex.join(opts))}"
    if preamble is None:
        return "\n".join([clean, exports, f"cd {WORKDIR}", cmd, "rc=$?", *after, kill, "exit $rc"])
    return "\n".join(["exec 2>&1", "set -uxo pipefail", *preamble, clean, exports, f"cd {WORKDIR}", START, cmd,
                      "rc=$?", END, f'echo "{EXIT_CODE}: $rc"', "set +x", *after, kill, "exit $rc"])
