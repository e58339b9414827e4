"""Step 3a of grading (``envs.grading.grader``): the grading sandbox made ready, and what it reports back.

The script resolves the interpreter the tests will run with (after the runner's environment activation,
e.g. SWE-bench's ``conda activate testbed``, before the patch is applied), lets git list the files the kept
patch touches (``git apply --numstat``: they must be exactly the kept files), applies it with the harness's
own commands in order (SWE-bench's ``git apply``, then ``--reject``, then ``patch --fuzz=5``; 5.x also tries
``--3way`` and resets the tree between tries), applies the task's test patch, puts back what the task hid from
the agent (R2E-Gym's tests, from its image: ``envs.grading.hidden``), prints the file the canaries go in and the
links under /testbed. A patch applied by a fallback is checked again by what changed on disk
(``git status``: only kept files, the ``.rej`` / ``.orig`` files the fallbacks leave removed), and the guard
then counts the whole of each touched file as the patch's code (line numbers no longer follow the patch).

Its output is ``name=value`` lines (binary values base64): ``fields`` reads them.
"""

from __future__ import annotations

import base64
import posixpath
import shlex
from collections.abc import Sequence

from envs.grading.command import Invocation
from envs.grading.patch import WORKDIR


def script(folder: str, interpreter: str, has_patch: bool, has_test_patch: bool, canary_file: str = "", *,
           apply: Sequence[str] = ("git apply --whitespace=nowarn",), reset_between: bool = False,
           activate: Sequence[str] = (), restore: Sequence[str] = ()) -> str:
    """The prepare script (see the module doc); ``apply``: the harness's patch-apply commands, tried in order;
    ``restore``: lines that put back what the task hid from the agent (``envs.grading.hidden``), run after the
    patches."""
    q = shlex.quote

    def resolve(name: str) -> str:  # the runner's activation needs bash (`source`); the path is the last line
        found = f"command -v {q(name)}"
        return f"/bin/bash -c {q('; '.join([*activate, found]))} 2>/dev/null | tail -n1" if activate else found

    lines = ["set -u", f"chmod 700 {folder}", f"cd {WORKDIR}", "g=/usr/bin/git; [ -x \"$g\" ] || g=git",
             f"echo \"python=$({resolve(interpreter)} || true)\"",
             f"p=$({resolve('pytest')} || true); [ -n \"$p\" ] && echo \"pytest_shebang=$(head -n1 \"$p\")\""]
    if has_patch:
        lines += [f"\"$g\" apply --numstat -z {folder}/model.patch > {folder}/numstat 2> {folder}/err "
                  f"|| {{ echo \"fail=numstat $(base64 -w0 {folder}/err)\"; exit 0; }}",
                  f"echo \"numstat=$(base64 -w0 {folder}/numstat)\"", "applied=''"]
        for i, cmd in enumerate(apply):
            words = cmd.split()
            exe = "\"$g\"" if words[0] == "git" else q(words[0])
            reset = "\"$g\" checkout -q -- . 2>/dev/null; \"$g\" clean -fdq 2>/dev/null; " if reset_between and i else ""
            lines.append(f"[ -n \"$applied\" ] || {{ {reset}{exe} {' '.join(q(w) for w in words[1:])} "
                         f"{folder}/model.patch >{folder}/err 2>&1 && applied={i}; }}")
        lines += [f"[ -n \"$applied\" ] || {{ echo \"fail=apply $(base64 -w0 {folder}/err)\"; exit 0; }}",
                  "echo \"applied=$applied\"",
                  f"if [ \"$applied\" != 0 ]; then find {WORKDIR} -path {WORKDIR}/.git -prune -o -type f "
                  f"\\( -name '*.rej' -o -name '*.orig' \\) -newer {folder}/numstat -exec rm -f {{}} +; "
                  f"echo \"changed=$(\"$g\" status --porcelain=v1 -z --untracked-files=all --no-renames | base64 -w0)\"; fi"]
    if has_test_patch:
        lines += [f"\"$g\" apply --whitespace=nowarn {folder}/test.patch 2> {folder}/err "
                  f"|| {{ echo \"fail=test_patch $(base64 -w0 {folder}/err)\"; exit 0; }}"]
    lines += restore
    if canary_file:
        path = q(f"{WORKDIR}/{canary_file}")
        lines += [f"if [ -f {path} ] && [ ! -L {path} ]; then echo \"canary_src=$(head -c 4000000 {path} | base64 -w0)\"; fi"]
    lines += [f"echo \"links=$(find {WORKDIR} -path {WORKDIR}/.git -prune -o -type l -printf '%P\\0%l\\0' "
              "| base64 -w0)\"", "echo ok=1"]
    return "\n".join(lines)


def changed_paths(porcelain: bytes) -> set[str]:
    """The paths ``git status --porcelain=v1 -z`` lists (``XY path\\0`` entries)."""
    return {e[3:].decode("utf-8", "surrogateescape") for e in porcelain.split(b"\0") if len(e) > 3}


def fields(stdout: str) -> dict[str, str]:
    """The ``name=value`` lines a grading script printed (the first of each name)."""
    out: dict[str, str] = {}
    for line in stdout.splitlines():
        k, sep, v = line.partition("=")
        if sep and k.isidentifier():
            out.setdefault(k, v)
    return out


def fields_raw(stdout: str) -> dict[str, str]:
    """``name=value`` lines whose name is a file name (``audit.log=...``)."""
    out: dict[str, str] = {}
    for line in stdout.splitlines():
        k, sep, v = line.partition("=")
        if sep and k and "/" not in k and " " not in k:
            out.setdefault(k, v)
    return out


def b64(s: str) -> bytes:
    try:
        return base64.b64decode(s.strip() or b"", validate=True)
    except ValueError:
        return b""


def python(inv: Invocation, found: dict[str, str]) -> str:
    """The interpreter's absolute path, as the pristine sandbox resolves it (before the patch is applied)."""
    if inv.interpreter.startswith("/"):
        return inv.interpreter
    if "/" in inv.interpreter:  # relative to the repository (R2E-Gym's .venv/bin/python)
        return posixpath.normpath(posixpath.join(WORKDIR, inv.interpreter))
    if inv.interpreter == "pytest":
        shebang = found.get("pytest_shebang", "").removeprefix("#!").split()
        if shebang and shebang[0].startswith("/") and posixpath.basename(shebang[0]) != "env":
            return shebang[0]  # else (`#!/usr/bin/env python3`) python3 as PATH resolves it
    return found.get("python", "")
