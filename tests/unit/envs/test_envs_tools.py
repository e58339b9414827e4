"""Tool calls: K3 text and dict parsing, argument checks, path confinement, truncation, the tools on a fake sandbox."""

from __future__ import annotations

import json
import posixpath
import re
from dataclasses import dataclass

import pytest

from envs.tools import (
    SWE_TOOLS,
    ActionError,
    SWETools,
    ToolCall,
    check_arguments,
    confine,
    parse_action,
    truncate,
)


def k3(*calls: tuple[str, dict]) -> str:
    body = "".join(f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{json.dumps(a)}<|tool_call_end|>"
                   for i, (n, a) in enumerate(calls))
    return f"Let me look.<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"


def test_k3_text_parses_to_the_first_call():
    c = parse_action(k3(("bash", {"command": "ls -la"})))
    assert c == ToolCall("bash", {"command": "ls -la"})
    two = parse_action(k3(("view", {"path": "a.py"}), ("submit", {})))
    assert two.name == "view" and "only the first" in two.note


@pytest.mark.parametrize("action", [
    {"name": "bash", "arguments": {"command": "ls"}},
    {"name": "functions.bash", "arguments": '{"command": "ls"}'},
    {"tool": "bash", "args": {"command": "ls"}},
    {"type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}},
    '{"name": "bash", "arguments": {"command": "ls"}}',
])
def test_dict_and_json_forms(action):
    assert parse_action(action) == ToolCall("bash", {"command": "ls"})


@pytest.mark.parametrize(("action", "words"), [
    ("just some prose", "no tool call"),
    ("<|tool_calls_section_begin|><|tool_call_begin|>functions.bash:0<|tool_call_end|>", "malformed"),
    (k3(("bash", {})).replace("{}", "{oops"), "not valid JSON"),
    (k3(("bash", {})).replace("{}", "[1, 2]"), "JSON object"),
    ({"arguments": {}}, "tool name"),
    (42, "got int"),
    ("{broken json", "does not parse"),
])
def test_malformed_actions_say_what_is_wrong(action, words):
    with pytest.raises(ActionError, match=re.escape(words)):
        parse_action(action)


def test_arguments_are_checked_against_the_schema():
    assert check_arguments(ToolCall("str_replace", {"file": "a", "old": "x", "new": "y"}), SWE_TOOLS) == {
        "path": "a", "old_str": "x", "new_str": "y"}
    with pytest.raises(ActionError, match="unknown tool 'rm'"):
        check_arguments(ToolCall("rm", {}), SWE_TOOLS)
    with pytest.raises(ActionError, match="missing required"):
        check_arguments(ToolCall("bash", {}), SWE_TOOLS)
    with pytest.raises(ActionError, match="unknown argument"):
        check_arguments(ToolCall("bash", {"command": "ls", "sudo": True}), SWE_TOOLS)
    with pytest.raises(ActionError, match="must be a string"):
        check_arguments(ToolCall("bash", {"command": ["ls"]}), SWE_TOOLS)
    with pytest.raises(ActionError, match="must be a number"):
        check_arguments(ToolCall("bash", {"command": "ls", "timeout": "10"}), SWE_TOOLS)


@pytest.mark.parametrize(("path", "want"), [("a.py", "/testbed/a.py"), ("/testbed/x/../b.py", "/testbed/b.py"),
                                            (".", "/testbed"), ("./src//m.py", "/testbed/src/m.py")])
def test_confine_keeps_paths_under_testbed(path, want):
    assert confine(path) == want


@pytest.mark.parametrize("path", ["/etc/passwd", "../etc/passwd", "/testbed/../root", "/testbedx/a", "", "a\0b"])
def test_confine_refuses_the_rest(path):
    with pytest.raises(ActionError):
        confine(path)


def test_truncate_cuts_the_middle_with_a_marker():
    text = "".join(f"line {i}\n" for i in range(5000))
    out = truncate(text, 1000)
    assert len(out) <= 1000 and out.startswith("line 0\n") and out.endswith("line 4999\n")
    m = re.search(r"\[\.\.\. (\d+) characters truncated \.\.\.\]", out)
    assert m is not None
    kept = len(out) - len(m.group(0)) - 2  # the marker sits on its own line
    assert kept + int(m.group(1)) == len(text)
    assert truncate("short", 1000) == "short"


@dataclass
class R:
    exit_code: int = 0
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False


class FakeSandbox:
    """Files in a dict; understands the few commands the tools send besides bash."""

    def __init__(self, files: dict[str, str], links: dict[str, str] | None = None) -> None:
        self.files, self.links, self.commands = dict(files), dict(links or {}), []

    def _kind(self, p: str) -> str:
        if p in self.files:
            return "file"
        return "dir" if any(f.startswith(p.rstrip("/") + "/") for f in self.files) else "missing"

    def exec(self, command, *, timeout=None, cwd=None, env=None):
        self.commands.append(command)
        m = re.match(r"realpath -m -- (\S+);", command)
        if m:
            p = m.group(1).strip("'")
            real = posixpath.normpath(self.links.get(p, p))
            return R(stdout=f"{real}\n{self._kind(real)}\n")
        if command.startswith("stat -c %a"):
            return R(stdout="755\n")
        if "sleep" in command:
            return R(exit_code=-9, stdout="partial\n", timed_out=True)
        return R(stdout="x" * 50_000 if "yes" in command else "ran\n", exit_code=3 if "false" in command else 0)

    def read_file(self, path):
        return self.files[path].encode()

    def write_file(self, path, data, mode=0o644):
        self.files[path] = data if isinstance(data, str) else data.decode()
        self.mode = mode


@pytest.fixture
def tools():
    sb = FakeSandbox({"/testbed/a.py": "x = 1\ny = 1\nz = 2\n", "/testbed/pkg/b.py": "print('b')\n"},
                     links={"/testbed/evil": "/etc/shadow"})
    return SWETools(sb, max_output=2000)


def call(name, **args):
    return {"name": name, "arguments": args}


def test_view_shows_numbered_lines_and_ranges(tools):
    _, out = tools.run(call("view", path="a.py"))
    assert not out.error and out.text.splitlines()[0] == "     1\tx = 1"
    _, out = tools.run(call("view", path="a.py", view_range=[2, -1]))
    assert out.text.splitlines() == ["     2\ty = 1", "     3\tz = 2"]
    _, out = tools.run(call("view", path="a.py", view_range=[9, 10]))
    assert out.error and "invalid" in out.text


def test_str_replace_needs_a_unique_old_string(tools):
    _, out = tools.run(call("str_replace", path="a.py", old_str="= 1", new_str="= 5"))
    assert out.error and "occurs 2 times" in out.text and "lines 1, 2" in out.text
    assert tools.sandbox.files["/testbed/a.py"] == "x = 1\ny = 1\nz = 2\n"
    _, out = tools.run(call("str_replace", path="a.py", old_str="nope", new_str=""))
    assert out.error and "not found" in out.text
    _, out = tools.run(call("str_replace", path="a.py", old_str="y = 1", new_str="y = 7"))
    assert not out.error and tools.sandbox.files["/testbed/a.py"] == "x = 1\ny = 7\nz = 2\n"
    assert tools.sandbox.mode == 0o755  # the file's mode is kept


def test_paths_outside_testbed_are_refused_even_through_links(tools):
    for path in ("/etc/passwd", "../../etc/passwd", "evil"):
        _, out = tools.run(call("view", path=path))
        assert out.error and "outside /testbed" in out.text, path
    _, out = tools.run(call("create", path="/tmp/x.py", file_text="1"))
    assert out.error and "/tmp/x.py" not in tools.sandbox.files


def test_create_bash_submit_and_unknown_tools(tools):
    _, out = tools.run(call("create", path="new/c.py", file_text="c = 3\n"))
    assert "Created" in out.text and tools.sandbox.files["/testbed/new/c.py"] == "c = 3\n"
    _, out = tools.run(call("bash", command="false"))
    assert out.text == "ran\n\n[exit code 3]"
    _, out = tools.run(call("bash", command="sleep 100", timeout=1))
    assert "timed out after 1 s" in out.text
    _, out = tools.run(call("bash", command="yes"))
    assert len(out.text) <= 2000 and "characters truncated" in out.text
    _, out = tools.run(call("bash", command="ls", timeout=10_000))
    assert out.error and "timeout must be" in out.text
    c, out = tools.run(k3(("submit", {})))
    assert c is not None and c.name == "submit" and out.submitted
    c, out = tools.run(call("rm_rf", path="/"))
    assert out.error and "unknown tool" in out.text and not out.submitted
