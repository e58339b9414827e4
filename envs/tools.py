"""Coding-agent tools over a sandbox: bash, view, str_replace, create, submit.

Actions come as a dict (``{"name": "bash", "arguments": {...}}``, ``{"tool": ..., "args": ...}`` or an
OpenAI-style ``{"function": {"name": ..., "arguments": "<json>"}}``) or as text in Kimi K3's tool-call
format (``<|tool_calls_section_begin|><|tool_call_begin|>functions.bash:0<|tool_call_argument_begin|>
{"command": "ls"}<|tool_call_end|><|tool_calls_section_end|>``; plain JSON text works too).

Nothing an agent sends raises: a malformed call, an unknown tool, a path outside ``/testbed``, an
``old_str`` that is missing or not unique, a command that hangs — each comes back as an observation
that says what was wrong. Long outputs are cut in the middle with a visible marker.
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

WORKDIR = "/testbed"
MAX_OUTPUT = 10_000
DEFAULT_TIMEOUT = 60.0
MAX_TIMEOUT = 600.0

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARG_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
_K3_CALL = re.compile(re.escape(CALL_BEGIN) + r"\s*(?:functions\.)?([A-Za-z_][\w.-]*)(?::\d+)?\s*"
                      + re.escape(ARG_BEGIN) + r"(.*?)" + re.escape(CALL_END), re.S)


def _fn(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required, "additionalProperties": False}}}


_PATH = {"type": "string", "description": "a path under /testbed (relative paths start there)"}
SWE_TOOLS: list[dict[str, Any]] = [
    _fn("bash", "Run a shell command in /testbed (no network). Output is stdout and stderr together.",
        {"command": {"type": "string"},
         "timeout": {"type": "number", "description": f"seconds (default {DEFAULT_TIMEOUT:g}, at most {MAX_TIMEOUT:g})"}},
        ["command"]),
    _fn("view", "Show a file with line numbers (optionally lines [start, end], end -1 = last) or list a folder.",
        {"path": _PATH, "view_range": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}},
        ["path"]),
    _fn("str_replace", "Replace old_str, which must occur exactly once in the file, by new_str.",
        {"path": _PATH, "old_str": {"type": "string"}, "new_str": {"type": "string"}}, ["path", "old_str", "new_str"]),
    _fn("create", "Write a file with the given content (creating folders; an existing file is overwritten).",
        {"path": _PATH, "file_text": {"type": "string"}}, ["path", "file_text"]),
    _fn("submit", "Submit the current state of /testbed as your fix; the episode ends and is graded.", {}, []),
]
# Names the issue and other agent scaffolds use for the same arguments.
ALIASES = {"file": "path", "old": "old_str", "new": "new_str", "content": "file_text", "cmd": "command",
           "lines": "view_range"}


class ActionError(ValueError):
    """An action that cannot be run; its message is what the agent sees."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    note: str = ""  # e.g. "2 tool calls given; only the first was run"


@dataclass(frozen=True)
class ToolOutput:
    text: str
    error: bool = False
    submitted: bool = False


class SandboxLike(Protocol):
    def exec(self, command: str, *, timeout: float | None = ..., cwd: str | None = ...,
             env: dict[str, str] | None = ...) -> Any: ...

    def read_file(self, path: str) -> bytes: ...

    def write_file(self, path: str, data: bytes | str, mode: int = ...) -> None: ...


def truncate(text: str, limit: int = MAX_OUTPUT) -> str:
    """``text`` cut in the middle past ``limit`` characters, with a marker saying how much went."""
    if len(text) <= limit:
        return text
    marker_room = 64
    keep = max(limit - marker_room, 0)
    head, tail = keep // 2, keep - keep // 2
    cut = len(text) - head - tail
    return text[:head] + f"\n[... {cut} characters truncated ...]\n" + (text[-tail:] if tail else "")


def tool_names(tools: list[dict[str, Any]]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def parse_action(action: Any) -> ToolCall:
    """A ToolCall from a dict or K3 tool-call text; ActionError says what is wrong otherwise."""
    if isinstance(action, Mapping):
        return _from_mapping(action)
    if not isinstance(action, str):
        raise ActionError(f"an action is a tool call (text or dict), got {type(action).__name__}")
    text = action.strip()
    if CALL_BEGIN in text or SECTION_BEGIN in text:
        calls = _K3_CALL.findall(text)
        if not calls:
            raise ActionError("malformed tool-call section: expected <|tool_call_begin|>functions.NAME:0"
                              "<|tool_call_argument_begin|>{json arguments}<|tool_call_end|>")
        name, raw = calls[0]
        args = _json_args(raw, name)
        note = f"{len(calls)} tool calls given; only the first ({name}) was run" if len(calls) > 1 else ""
        return ToolCall(name, args, note)
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ActionError(f"the action looks like JSON but does not parse: {e}") from None
        return _from_mapping(data) if isinstance(data, Mapping) else _from_mapping({})
    raise ActionError("no tool call found in the action: call a tool in the tool-call format "
                      "(<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>"
                      "{...}<|tool_call_end|><|tool_calls_section_end|>)")


def _json_args(raw: Any, name: str) -> dict[str, Any]:
    if isinstance(raw, Mapping):
        return dict(raw)
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return {}
    if not isinstance(raw, str):
        raise ActionError(f"arguments of {name!r} must be a JSON object, got {type(raw).__name__}")
    try:
        args = json.loads(raw)
    except ValueError as e:
        raise ActionError(f"arguments of {name!r} are not valid JSON: {e}") from None
    if not isinstance(args, dict):
        raise ActionError(f"arguments of {name!r} must be a JSON object, got {type(args).__name__}")
    return args


def _from_mapping(d: Mapping[str, Any]) -> ToolCall:
    if isinstance(d.get("function"), Mapping):
        d = d["function"]
    name = d.get("name", d.get("tool"))
    if not isinstance(name, str) or not name:
        raise ActionError("a tool call needs a tool name ('name')")
    raw = d.get("arguments", d.get("args", d.get("input")))
    return ToolCall(name.removeprefix("functions."), _json_args(raw, name))


def check_arguments(call: ToolCall, tools: list[dict[str, Any]]) -> dict[str, Any]:
    """Arguments of ``call`` renamed from aliases and checked against the tool's schema."""
    spec = next((t["function"] for t in tools if t["function"]["name"] == call.name), None)
    if spec is None:
        raise ActionError(f"unknown tool {call.name!r}; the tools are: {', '.join(tool_names(tools))}")
    props: dict[str, Any] = spec["parameters"]["properties"]
    args = {ALIASES.get(k, k) if ALIASES.get(k) in props else k: v for k, v in call.arguments.items()}
    unknown = sorted(set(args) - set(props))
    if unknown:
        raise ActionError(f"{call.name}: unknown argument(s) {unknown}; it takes {sorted(props) or 'none'}")
    missing = [k for k in spec["parameters"]["required"] if k not in args]
    if missing:
        raise ActionError(f"{call.name}: missing required argument(s) {missing}")
    for k, v in args.items():
        want = props[k].get("type")
        ok = {"string": isinstance(v, str), "number": isinstance(v, int | float) and not isinstance(v, bool),
              "integer": isinstance(v, int) and not isinstance(v, bool),
              "array": isinstance(v, list)}.get(want, True)
        if not ok:
            raise ActionError(f"{call.name}: argument {k!r} must be a {want}, got {type(v).__name__}")
    return args


def confine(path: str, workdir: str = WORKDIR) -> str:
    """The absolute, normalised path; ActionError when it leaves ``workdir``."""
    if not isinstance(path, str) or not path.strip() or "\0" in path:
        raise ActionError(f"path must be a non-empty string, got {path!r}")
    full = posixpath.normpath(posixpath.join(workdir, path.strip()))
    if full != workdir and not full.startswith(workdir.rstrip("/") + "/"):
        raise ActionError(f"path {path!r} is outside {workdir}; only files under {workdir} can be used")
    return full


class SWETools:
    """Runs SWE tool calls against one sandbox."""

    tools = SWE_TOOLS

    def __init__(self, sandbox: SandboxLike, *, workdir: str = WORKDIR, max_output: int = MAX_OUTPUT,
                 default_timeout: float = DEFAULT_TIMEOUT, max_timeout: float = MAX_TIMEOUT) -> None:
        self.sandbox, self.workdir, self.max_output = sandbox, workdir, max_output
        self.default_timeout, self.max_timeout = default_timeout, max_timeout

    def run(self, action: Any) -> tuple[ToolCall | None, ToolOutput]:
        """Parse and run one action; never raises for anything the agent sent."""
        call: ToolCall | None = None
        try:
            call = parse_action(action)
            args = check_arguments(call, self.tools)
            out = getattr(self, f"_tool_{call.name}")(**args)
        except ActionError as e:
            return call, ToolOutput(truncate(f"Error: {e}", self.max_output), error=True)
        text = truncate(out.text, self.max_output)
        if call.note:
            text = f"[{call.note}]\n{text}"
        return call, ToolOutput(text, out.error, out.submitted)

    # --- the tools --------------------------------------------------------------------------------

    def _tool_bash(self, command: str, timeout: float | None = None) -> ToolOutput:
        if not command.strip():
            raise ActionError("bash: command is empty")
        t = self.default_timeout if timeout is None else float(timeout)
        if not 0 < t <= self.max_timeout:
            raise ActionError(f"bash: timeout must be in (0, {self.max_timeout:g}] seconds, got {timeout!r}")
        r = self.sandbox.exec(f"{{ {command}\n}} 2>&1", timeout=t, cwd=self.workdir)
        text = r.stdout + r.stderr
        if r.timed_out:
            text += f"\n[the command timed out after {t:g} s and was killed]"
        elif r.exit_code != 0:
            text += f"\n[exit code {r.exit_code}]"
        return ToolOutput(text or "[no output]", error=bool(r.timed_out))

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

    def _tool_view(self, path: str, view_range: list[int] | None = None) -> ToolOutput:
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
        body = "\n".join(f"{n:6}\t{lines[n - 1]}" for n in range(start, end + 1))
        return ToolOutput(body if lines else f"{path}: empty file")

    def _tool_str_replace(self, path: str, old_str: str, new_str: str) -> ToolOutput:
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
        snippet = "\n".join(f"{n:6}\t{lines[n - 1]}" for n in range(lo, hi + 1))
        return ToolOutput(f"Edited {path}; lines {lo}-{hi} now read:\n{snippet}")

    def _tool_create(self, path: str, file_text: str) -> ToolOutput:
        real, kind = self._real(path)
        if kind == "dir" or kind == "other":
            raise ActionError(f"create: {path!r} exists and is not a regular file")
        self.sandbox.write_file(real, file_text)
        verb = "Overwrote" if kind == "file" else "Created"
        return ToolOutput(f"{verb} {path} ({len(file_text.encode())} bytes, {file_text.count(chr(10))} lines)")

    def _tool_submit(self) -> ToolOutput:
        return ToolOutput("Submitted.", submitted=True)


def describe_tools(tools: list[dict[str, Any]]) -> str:
    """The tool list as text, for the first observation."""
    out = []
    for t in tools:
        f = t["function"]
        params = ", ".join(f"{k}{'' if k in f['parameters']['required'] else '?'}: {v.get('type', 'any')}"
                           for k, v in f["parameters"]["properties"].items())
        out.append(f"- {f['name']}({params}): {f['description']}")
    return "\n".join(out)
