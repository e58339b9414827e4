"""A fake Backend whose sandboxes run the few shell commands a Lookup-v0 agent sends (``cat``, ``grep``, ``ls``)
over their dict of files, so the env and its expert run end to end without Docker."""

from __future__ import annotations

import posixpath
import re
import shlex

from fakes import FakeBackend, FakeSandbox, _Sandboxes, result

_WRAPPED = re.compile(r"\{ (.*)\n\} 2>&1", re.DOTALL)  # how the bash tool sends a command


class ShellSandbox(FakeSandbox):
    def exec(self, command, *, timeout=None, cwd=None, env=None, on_output=None):
        m = _WRAPPED.fullmatch(command)
        if m is None:
            return super().exec(command, timeout=timeout, cwd=cwd, env=env, on_output=on_output)
        self.commands.append(command)
        try:
            argv = shlex.split(m.group(1))
        except ValueError as e:
            return result(f"sh: {e}\n", exit_code=2)
        here = cwd or "/"

        def path(p: str) -> str:
            return posixpath.normpath(posixpath.join(here, p))

        def names(args: list[str]) -> list[str]:
            out = []
            for a in args:
                if a == "*":
                    out += sorted(posixpath.relpath(f, here) for f in self.files if posixpath.dirname(f) == here)
                else:
                    out.append(a)
            return out

        if argv and argv[0] == "cat":
            text, code = "", 0
            for n in names(argv[1:]):
                if path(n) in self.files:
                    text += self.files[path(n)]
                else:
                    text, code = text + f"cat: {n}: No such file or directory\n", 1
            return result(text, exit_code=code)
        if argv and argv[0] == "grep" and len(argv) >= 3:
            pattern, files = argv[1], names(argv[2:])
            hits = [f"{n}:{line}" if len(files) > 1 else line
                    for n in files if path(n) in self.files
                    for line in self.files[path(n)].splitlines() if pattern in line]
            return result("".join(h + "\n" for h in hits), exit_code=0 if hits else 1)
        if argv == ["ls"]:
            return result("".join(n + "\n" for n in names(["*"])))
        return result(f"sh: {argv[0] if argv else ''}: not found\n", exit_code=127)


class _ShellSandboxes(_Sandboxes):
    kind = ShellSandbox


class ShellBackend(FakeBackend):
    """A ``FakeBackend`` whose sandboxes understand ``cat``, ``grep`` and ``ls`` (see ``ShellSandbox``)."""

    def __init__(self) -> None:
        super().__init__()
        self.Sandbox = _ShellSandboxes(self)
