"""FileTools: view, str_replace and create files under the working folder (``/testbed``) of a sandbox.

Paths are confined to the working folder, after following links inside the sandbox: ``../``, an
absolute path elsewhere, or a link that points out are refused. ``str_replace`` needs its
``old_str`` to occur exactly once, and keeps the file's mode.
"""

from __future__ import annotations

import posixpath
import re
import shlex

from envs.tools.core import ActionError, Box, SandboxTools, ToolOutput, tool

WORKDIR = "/testbed"
PATH = {"type": "string", "description": "a path under /testbed (relative paths start there)"}


def confine(path: str, workdir: str = WORKDIR) -> str:
    """The absolute, normalised path; ActionError when it leaves ``workdir``."""
    if not isinstance(path, str) or not path.strip() or "\0" in path:
        raise ActionError(f"path must be a non-empty string, got {path!r}")
    full = posixpath.normpath(posixpath.join(workdir, path.strip()))
    if full != workdir and not full.startswith(workdir.rstrip("/") + "/"):
        raise ActionError(f"path {path!r} is outside {workdir}; only files under {workdir} can be used")
    return full


def numbered(lines: list[str], start: int, end: int) -> str:
    """Lines ``start``..``end`` (1-based, inclusive) with their numbers, as ``view`` shows them."""
    return "\n".join(f"{n:6}\t{lines[n - 1]}" for n in range(start, end + 1))


class FileTools(SandboxTools):
    """view / str_replace / create on files under ``workdir``."""

    def __init__(self, box: Box, *, workdir: str = WORKDIR) -> None:
        super().__init__(box)
        self.workdir = workdir

    def _real(self, path: str) -> tuple[str, str]:
        """(real path, kind: 'file' | 'dir' | 'missing' | 'other') after following links, still confined."""
        full = confine(path, self.workdir)
        q = shlex.quote(full)
        r = self.sandbox.exec(f"realpath -m -- {q}; if [ -d {q} ]; then echo dir; elif [ -f {q} ]; then echo file;"
                              f" elif [ -e {q} ]; then echo other; else echo missing; fi", timeout=30)
        lines = r.stdout.split("\n")
        if r.exit_code != 0 or len(lines) < 2:
            raise ActionError(f"cannot resolve {path!r}: {r.stderr.strip()[:200]}")
        real = confine(lines[0], self.workdir) if lines[0].startswith("/") else full
        return real, lines[1]

    @tool("Show a file with line numbers (optionally lines [start, end], end -1 = last) or list a folder.",
          {"path": PATH, "view_range": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}},
          ["path"])
    def view(self, path: str, view_range: list[int] | None = None) -> ToolOutput:
        real, kind = self._real(path)
        if kind == "missing":
            raise ActionError(f"view: {path!r} does not exist")
        if kind == "dir":
            if view_range is not None:
                raise ActionError("view: view_range only applies to files")
            r = self.sandbox.exec(f"find {shlex.quote(real)} -maxdepth 2 -not -path '*/.git' -not -path '*/.git/*'"
                                  " -not -name __pycache__ | sort", timeout=30)
            return ToolOutput(r.stdout)
        if kind != "file":
            raise ActionError(f"view: {path!r} is not a regular file or folder")
        data = self.sandbox.read_file(real)
        if b"\0" in data[:8192]:
            return ToolOutput(f"{path}: binary file, {len(data)} bytes")
        lines = data.decode(errors="replace").splitlines()
        start, end = 1, len(lines)
        if view_range is not None:
            if len(view_range) != 2 or not all(isinstance(x, int) for x in view_range):
                raise ActionError("view: view_range must be two integers [start, end]")
            start, end = view_range
            end = len(lines) if end == -1 else end
            if not 1 <= start <= max(len(lines), 1) or end < start:
                raise ActionError(f"view: view_range {view_range} is invalid for a file of {len(lines)} lines")
            end = min(end, len(lines))
        return ToolOutput(numbered(lines, start, end) if lines else f"{path}: empty file")

    @tool("Replace old_str, which must occur exactly once in the file, by new_str.",
          {"path": PATH, "old_str": {"type": "string"}, "new_str": {"type": "string"}}, ["path", "old_str", "new_str"])
    def str_replace(self, path: str, old_str: str, new_str: str) -> ToolOutput:
        real, kind = self._real(path)
        if kind != "file":
            raise ActionError(f"str_replace: {path!r} is not an existing file")
        if not old_str:
            raise ActionError("str_replace: old_str is empty")
        text = self.sandbox.read_file(real).decode(errors="replace")
        count = text.count(old_str)
        if count == 0:
            raise ActionError(f"str_replace: old_str was not found in {path}; view the file and copy the text exactly")
        if count > 1:
            at, pos = [], -1
            while (pos := text.find(old_str, pos + 1)) >= 0:
                at.append(text.count("\n", 0, pos) + 1)
            raise ActionError(f"str_replace: old_str occurs {count} times in {path} (lines "
                              f"{', '.join(map(str, at[:10]))}); include more context to make it unique")
        mode = self.sandbox.exec(f"stat -c %a -- {shlex.quote(real)}", timeout=30).stdout.strip()
        new = text.replace(old_str, new_str, 1)
        self.sandbox.write_file(real, new, mode=int(mode, 8) if re.fullmatch(r"[0-7]{3,4}", mode) else 0o644)
        line = text.count("\n", 0, text.find(old_str)) + 1
        lines = new.splitlines()
        lo, hi = max(line - 4, 1), min(line + new_str.count("\n") + 4, len(lines))
        return ToolOutput(f"Edited {path}; lines {lo}-{hi} now read:\n{numbered(lines, lo, hi)}")

    @tool("Write a file with the given content (creating folders; an existing file is overwritten).",
          {"path": PATH, "file_text": {"type": "string"}}, ["path", "file_text"])
    def create(self, path: str, file_text: str) -> ToolOutput:
        real, kind = self._real(path)
        if kind == "dir" or kind == "other":
            raise ActionError(f"create: {path!r} exists and is not a regular file")
        self.sandbox.write_file(real, file_text)
        verb = "Overwrote" if kind == "file" else "Created"
        return ToolOutput(f"{verb} {path} ({len(file_text.encode())} bytes, {file_text.count(chr(10))} lines)")
