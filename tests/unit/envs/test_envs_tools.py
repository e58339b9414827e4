"""Tool calls: K3 text and dict parsing, argument checks, path confinement, truncation, tool groups, the
SWE tools on a fake sandbox."""

from __future__ import annotations

import json
import re

import pytest

from envs.spaces import truncate
from envs.tools import (
    ActionError,
    BashTool,
    FileTools,
    SubmitTool,
    Toolbox,
    ToolCall,
    ToolGroup,
    ToolOutput,
    check_arguments,
    confine,
    parse_action,
    tool,
)
from envs.tools.core import decode_arguments

from .fakes import FakeSandbox

SWE_TOOLS = [*BashTool.specs(), *FileTools.specs(), *SubmitTool.specs()]


def k3(*calls: tuple[str, dict]) -> str:
    body = "".join(f'<|open|>call tool="{n}" index="{i}"<|sep|><|open|>json type="object"<|sep|>{json.dumps(a)}'
                   "<|close|>json<|sep|><|close|>call<|sep|>" for i, (n, a) in enumerate(calls))
    return f"Let me look.<|open|>tools<|sep|>{body}<|close|>tools<|sep|>"


def named(calls: list[ToolCall]) -> list[tuple[str, dict]]:
    return [(c.name, decode_arguments(c)) for c in calls]


def test_k3_text_parses_to_every_call_in_order():
    assert named(parse_action(k3(("bash", {"command": "ls -la"})))) == [("bash", {"command": "ls -la"})]
    two = parse_action(k3(("view", {"path": "a.py"}), ("submit", {})))
    assert named(two) == [("view", {"path": "a.py"}), ("submit", {})]
    assert [c.id for c in two] == ["functions.view:0", "functions.submit:1"]


@pytest.mark.parametrize("action", [
    {"name": "bash", "arguments": {"command": "ls"}},
    {"name": "functions.bash", "arguments": '{"command": "ls"}'},
    {"tool": "bash", "args": {"command": "ls"}},
    {"type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}},
    '{"name": "bash", "arguments": {"command": "ls"}}',
])
def test_dict_and_json_forms(action):
    assert named(parse_action(action)) == [("bash", {"command": "ls"})]


def test_a_list_of_openai_tool_calls_keeps_their_ids():
    calls = parse_action([{"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": "{}"}},
                          {"name": "submit"}])
    assert [(c.id, c.name) for c in calls] == [("call_1", "bash"), ("functions.submit:1", "submit")]
    with pytest.raises(ActionError, match="holds tool calls"):
        parse_action([{"name": "bash"}, "ls"])


@pytest.mark.parametrize(("action", "words"), [
    ("just some prose", "no tool call"),
    ('<|open|>tools<|sep|><|open|>call tool="bash"<|sep|><|close|>json<|sep|>', "malformed"),
    (k3(("bash", {})).replace("{}", "{oops"), "not valid JSON"),
    (k3(("bash", {})).replace("{}", "[1, 2]"), "JSON object"),
    ({"arguments": {}}, "tool name"),
    (k3(("bash", {})).replace("{}", '"ls"'), "JSON object"),
    (42, "got int"),
    ("{broken json", "does not parse"),
])
def test_malformed_actions_say_what_is_wrong(action, words):
    with pytest.raises(ActionError, match=re.escape(words)):
        parse_action(action)


@pytest.mark.parametrize(("arguments", "words"), [("{oops", "not valid JSON"), ("[1, 2]", "JSON object"),
                                                  (5, "JSON object")])
def test_dict_arguments_are_decoded_when_the_call_runs(arguments, words):
    with pytest.raises(ActionError, match=re.escape(words)):
        check_arguments(parse_action({"name": "bash", "arguments": arguments})[0], SWE_TOOLS)


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


@pytest.fixture
def sb():
    return FakeSandbox(files={"/testbed/a.py": "x = 1\ny = 1\nz = 2\n", "/testbed/pkg/b.py": "print('b')\n"},
                       links={"/testbed/evil": "/etc/shadow"})


@pytest.fixture
def tools(sb):
    return Toolbox(BashTool(lambda: sb), FileTools(lambda: sb), SubmitTool(), max_output=2000)


def call(name, **args):
    return {"name": name, "arguments": args}


def test_view_shows_numbered_lines_and_ranges(tools):
    out = tools.run(call("view", path="a.py"))
    assert not out.error and out.text.splitlines()[0] == "     1\tx = 1"
    out = tools.run(call("view", path="a.py", view_range=[2, -1]))
    assert out.text.splitlines() == ["     2\ty = 1", "     3\tz = 2"]
    out = tools.run(call("view", path="a.py", view_range=[9, 10]))
    assert out.error and "invalid" in out.text


def test_str_replace_needs_a_unique_old_string(tools, sb):
    out = tools.run(call("str_replace", path="a.py", old_str="= 1", new_str="= 5"))
    assert out.error and "occurs 2 times" in out.text and "lines 1, 2" in out.text
    assert sb.files["/testbed/a.py"] == "x = 1\ny = 1\nz = 2\n"
    out = tools.run(call("str_replace", path="a.py", old_str="nope", new_str=""))
    assert out.error and "not found" in out.text
    out = tools.run(call("str_replace", path="a.py", old_str="y = 1", new_str="y = 7"))
    assert not out.error and sb.files["/testbed/a.py"] == "x = 1\ny = 7\nz = 2\n"
    assert sb.mode == 0o755  # the file's mode is kept


def test_paths_outside_testbed_are_refused_even_through_links(tools, sb):
    for path in ("/etc/passwd", "../../etc/passwd", "evil"):
        out = tools.run(call("view", path=path))
        assert out.error and "outside /testbed" in out.text, path
    out = tools.run(call("create", path="/tmp/x.py", file_text="1"))
    assert out.error and "/tmp/x.py" not in sb.files


def test_create_bash_submit_and_unknown_tools(tools, sb):
    out = tools.run(call("create", path="new/c.py", file_text="c = 3\n"))
    assert "Created" in out.text and sb.files["/testbed/new/c.py"] == "c = 3\n"
    out = tools.run(call("bash", command="false"))
    assert out.text == "ran\n\n[exit code 3]"
    out = tools.run(call("bash", command="sleep 100", timeout=1))
    assert "timed out after 1 s" in out.text
    out = tools.run(call("bash", command="yes"))
    assert len(out.text) <= 2000 and "characters truncated" in out.text
    out = tools.run(call("bash", command="ls", timeout=10_000))
    assert out.error and "timeout must be" in out.text
    out = tools.run(k3(("submit", {})))
    assert out.ending is not None and out.ending.name == "submit"
    out = tools.run(call("rm_rf", path="/"))
    assert out.error and "unknown tool" in out.text and out.ending is None


def test_every_call_runs_in_order_and_a_submit_ends_the_action(tools, sb):
    turn = tools.run(k3(("create", {"path": "n.txt", "file_text": "1"}), ("bash", {"command": "false"}),
                        ("view", {"path": "/etc/passwd"}), ("submit", {}), ("bash", {"command": "ls"})))
    assert [c.name for c in turn.calls] == ["create", "bash", "view", "submit"]  # nothing after submit runs
    assert sb.files["/testbed/n.txt"] == "1" and sb.commands.count("{ ls\n} 2>&1") == 0
    assert turn.error and turn.ending is not None
    assert turn.text.split("\n\n")[0] == "[create]\nCreated n.txt (1 bytes, 0 lines)"
    assert "[view]\nError: path '/etc/passwd' is outside /testbed" in turn.text
    info = turn.info()
    assert info["calls"][2] == {"id": "functions.view:2", "name": "view", "error": True,
                                "output": "Error: path '/etc/passwd' is outside /testbed; only files under /testbed "
                                          "can be used"}
    assert [c["error"] for c in info["calls"]] == [False, False, True, False]


def test_a_malformed_action_runs_nothing_and_says_the_format(tools, sb):
    turn = tools.run(k3(("bash", {"command": "touch x"})).replace("<|close|>call<|sep|>", ""))
    assert turn.calls == () and turn.error and "malformed" in turn.text and 'call tool="NAME"' in turn.text
    assert sb.commands == []


class Greeter(ToolGroup):
    @tool("Greet someone.", {"who": {"type": "string"}, "times": {"type": "integer"}}, ["who"])
    def greet(self, who: str, times: int = 1) -> ToolOutput:
        return ToolOutput(" ".join([f"hello {who}"] * times))

    @tool("Say goodbye; the episode ends.", name="bye")
    def leave(self) -> ToolOutput:
        return ToolOutput("bye", submitted=True)


def test_a_tool_group_declares_its_tools_once():
    assert [t.name for t in Greeter.tools] == ["greet", "bye"]
    spec = Greeter.specs()[0]["function"]
    assert spec["parameters"] == {"type": "object", "properties": {"who": {"type": "string"}, "times": {
        "type": "integer"}}, "required": ["who"], "additionalProperties": False}
    box = Toolbox(Greeter(), SubmitTool())
    assert box.names == ["greet", "bye", "submit"] and "- greet(who: string, times?: integer): Greet" in box.describe()
    assert box.run({"name": "greet", "arguments": {"who": "K3", "times": 2}}).text == "hello K3 hello K3"
    assert "must be an integer" in box.run({"name": "greet", "arguments": {"who": "K3", "times": "2"}}).text
    assert box.run({"name": "bye"}).ending is not None
    with pytest.raises(ValueError, match="same name"):
        Toolbox(Greeter(), Greeter())
