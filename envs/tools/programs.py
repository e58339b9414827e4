"""Tools that run a program in the sandbox: ``bash``, ``python`` and ``search`` (grep over a document folder).

A program's output is its stdout and stderr; a non-zero exit code and a timeout are said at the end
(a timed-out program is killed, with everything it started).
"""

from __future__ import annotations

import shlex

from agentenv.api import ExecResult
from envs.tools.core import ActionError, Box, SandboxTools, ToolOutput, tool
from envs.tools.files import WORKDIR

DEFAULT_TIMEOUT = 60.0
MAX_TIMEOUT = 600.0


def program_output(r: ExecResult, timeout: float) -> ToolOutput:
    """What the agent sees of a finished program: its output, then how it ended unless it succeeded."""
    text = r.stdout + r.stderr
    if r.timed_out:
        text += f"\n[timed out after {timeout:g} s and killed]"
    elif r.exit_code != 0:
        text += f"\n[exit code {r.exit_code}]"
    return ToolOutput(text or "[no output]", error=r.timed_out)


class BashTool(SandboxTools):
    """``bash``: a shell command in ``workdir``, stdout and stderr merged, with an optional timeout."""

    def __init__(self, box: Box, *, workdir: str = WORKDIR, timeout: float = DEFAULT_TIMEOUT,
                 max_timeout: float = MAX_TIMEOUT) -> None:
        super().__init__(box)
        self.workdir, self.timeout, self.max_timeout = workdir, timeout, max_timeout

    @tool("Run a shell command in /testbed (no network). Output is stdout and stderr together.",
          {"command": {"type": "string"},
           "timeout": {"type": "number", "description": f"seconds (default {DEFAULT_TIMEOUT:g}, at most {MAX_TIMEOUT:g})"}},
          ["command"])
    def bash(self, command: str, timeout: float | None = None) -> ToolOutput:
        if not command.strip():
            raise ActionError("bash: command is empty")
        t = self.timeout if timeout is None else float(timeout)
        if not 0 < t <= self.max_timeout:
            raise ActionError(f"bash: timeout must be in (0, {self.max_timeout:g}] seconds, got {timeout!r}")
        return program_output(self.sandbox.exec(f"{{ {command}\n}} 2>&1", timeout=t, cwd=self.workdir), t)


class PythonTool(SandboxTools):
    """``python``: a Python 3 program, run from a file in /tmp."""

    def __init__(self, box: Box, *, timeout: float = 20.0) -> None:
        super().__init__(box)
        self.timeout = timeout

    @tool("Run a Python 3 program in a sandbox (no network) and see what it prints.", {"code": {"type": "string"}},
          ["code"])
    def python(self, code: str) -> ToolOutput:
        self.sandbox.write_file("/tmp/main.py", code)
        return program_output(self.sandbox.exec("python3 /tmp/main.py", timeout=self.timeout, cwd="/tmp"),
                              self.timeout)


DOCS = "/docs"


class SearchTool(SandboxTools):
    """``search``: case-insensitive search of the documents in ``docs`` (lines with one line of context)."""

    def __init__(self, box: Box, *, docs: str = DOCS, timeout: float = 20.0) -> None:
        super().__init__(box)
        self.docs, self.timeout = docs, timeout

    @tool(f"Search the documents in {DOCS} (case-insensitive); shows matching lines with context.",
          {"query": {"type": "string"}}, ["query"])
    def search(self, query: str) -> ToolOutput:
        q = query.strip()
        if not q:
            raise ActionError("search: the query is empty")
        r = self.sandbox.exec(f"grep -rinF -C1 -- {shlex.quote(q)} {self.docs} | head -n 60", timeout=self.timeout)
        return ToolOutput(r.stdout.replace(self.docs + "/", "") or f"no match for {q!r}")
