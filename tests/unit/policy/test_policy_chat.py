"""Tokenizer special tokens and K3's chat template / tool-call parser."""

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from policy import chat
from policy.chat import parse_assistant, render_assistant_body, render_chat, tool_spec, validate_tools
from policy.tokenizer import CORPUS, SPECIAL_TOKENS, load_tokenizer, train_tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_special_tokens_are_single_tokens_and_text_round_trips():
    tok = load_tokenizer()
    for s in SPECIAL_TOKENS:
        assert tok.encode_pieces([chat.Control(s)]) == [tok.token_id(s)] and tok.decode([tok.token_id(s)]) == s, s
    ids = tok.encode_chat([{"role": "user", "content": "Grüße, 世界! def f(x): return x"}], add_generation_prompt=False)
    assert tok.decode(ids) == "<|im_user|>user<|im_middle|>Grüße, 世界! def f(x): return x<|im_end|>"
    assert ids.count(tok.token_id("<|im_middle|>")) == 1
    assert tok.eos_id == tok.token_id("<|im_end|>")


def test_training_is_deterministic_and_matches_the_cached_tokenizer():
    a, b = train_tokenizer(CORPUS), train_tokenizer(CORPUS)
    assert a.get_vocab() == b.get_vocab()
    assert a.get_vocab() == load_tokenizer().tok.get_vocab()


def test_render_chat_follows_k3_format():
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "use the tool", "tool_calls": [
            {"id": "functions.get_weather:0", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"},
    ]
    out = render_chat(msgs, TOOLS)
    assert out.startswith("<|im_system|>tool_declare<|im_middle|>[{")
    assert json.loads(out.split("<|im_middle|>", 1)[1].split("<|im_end|>", 1)[0]) == TOOLS
    assert "<|im_system|>system<|im_middle|>Be brief.<|im_end|>" in out
    assert "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>" in out
    assert ("<|im_assistant|>assistant<|im_middle|><think>use the tool</think><|open|>tools<|sep|>"
            '<|open|>call tool="get_weather" index="0"<|sep|><|open|>json type="object"<|sep|>{"city": "Paris"}'
            "<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|im_end|>") in out
    assert "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nsunny<|im_end|>" in out
    assert out.endswith("<|im_assistant|>assistant<|im_middle|>")


def call(head: str, args: str = "{}") -> str:
    """A call in K3's format: ``head`` the text after ``<|open|>``, ``args`` the JSON block's text."""
    return f'<|open|>{head}<|sep|><|open|>json type="object"<|sep|>{args}<|close|>json<|sep|><|close|>call<|sep|>'


def section(*calls: str, end: str = "<|close|>tools<|sep|>") -> str:
    return "<|open|>tools<|sep|>" + "".join(calls) + end


@pytest.mark.parametrize("text", [
    "Plain answer.",
    "<think>let me think</think>The answer is 4.",
    "<think></think>",
    "Calling." + section(call('call tool="get_weather" index="0"', '{"city":  "Paris"}'),
                         call('call tool="run_command" index="1"', '{"cmd": "ls"}')),
    "<think>t</think>" + section(call('call tool="x.y-z" index="7"')),
])
def test_parse_then_render_round_trips(text):
    msg = parse_assistant(text)
    assert not msg.malformed
    assert render_assistant_body(msg.to_openai()) == text


def test_parse_gives_openai_tool_calls():
    text = "Sure." + section(call('call tool="get_weather" index="0"', '{"city": "Paris"}'))
    msg = parse_assistant(text)
    assert msg.content == "Sure."
    assert msg.tool_calls == [{"id": "functions.get_weather:0", "type": "function",
                               "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]


@pytest.mark.parametrize("text", [
    section(call('call tool="f" index="0"', "{bad json")),
    '<|open|>tools<|sep|><|open|>call tool="f" index="0"<|sep|><|open|>json type="object"<|sep|>{}',
    "text<|close|>call<|sep|>",
    section(call('call tool="non sense" index="0"')),
    "<|open|>tools<|sep|><|close|>tools<|sep|>",
    section(call('call tool="x.y-z" index="7"', "[]")),
])
def test_malformed_tool_calls_become_plain_content(text):
    msg = parse_assistant(text)
    assert msg.malformed and msg.tool_calls == [] and msg.content == text


def test_validate_tools_rejects_malformed():
    assert validate_tools(TOOLS) == TOOLS
    for bad in ["x", [{"type": "function"}], [{"type": "function", "function": {"name": "bad name!"}}],
                [{"type": "function", "function": {"name": "f", "parameters": "no"}}]]:
        with pytest.raises(ValueError):
            validate_tools(bad)


def argument(key: str, value: str, kind: str | None = None) -> str:
    typed = "" if kind is None else f' type="{kind}"'
    return f'<|open|>argument key="{key}"{typed}<|sep|>{value}<|close|>argument<|sep|>'


@pytest.mark.parametrize(("call_text", "name", "call_id", "args"), [
    (call('call tool="get_weather" index="3"'), "get_weather", "functions.get_weather:3", "{}"),
    (call('call tool="nonsense"'), "nonsense", "functions.nonsense:0", "{}"),          # no index: the position
    (call('call index="2" tool="bash"'), "bash", "functions.bash:2", "{}"),            # attributes in any order
    (call('call tool="functions.x" index="1"'), "functions.x", "functions.functions.x:1", "{}"),  # a name is a name
    (' \n <|open|>call  tool="bash" index="0" <|sep|>\n<|open|>json<|sep|>\n {"a": 1} \n<|close|>json<|sep|> '
     "<|close|>call<|sep|>\n", "bash", "functions.bash:0", '{"a": 1}'),                # blanks; json without type
    ('<|open|>call tool="bash" index="0"<|sep|><|close|>call<|sep|>', "bash", "functions.bash:0", "{}"),  # no args
    ('<|open|>call tool="bash" index="0"<|sep|>' + argument("command", ' ls "-la" ') + argument("n", "2", "number")
     + argument("x", '{"y": [true, null]}', "object") + argument("s", "t", "string") + "<|close|>call<|sep|>",
     "bash", "functions.bash:0", '{"command": " ls \\"-la\\" ", "n": 2, "x": {"y": [true, null]}, "s": "t"}'),
    ('<|open|>call tool="q&amp;a" index="0"<|sep|>' + argument("say &quot;hi&quot;", "é") + "<|close|>call<|sep|>",
     None, None, '{"say \\"hi\\"": "é"}'),                                              # escaped attributes
])
def test_lenient_forms_are_normalised(call_text, name, call_id, args):
    msg = parse_assistant(section(call_text))
    if name is None:   # "q&a" is not a tool name: malformed, though the escapes were read
        assert msg.malformed
        return
    assert not msg.malformed and msg.content == ""
    assert msg.tool_calls == [{"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}]


def test_missing_section_end_at_the_end_is_accepted_and_the_index_is_the_position():
    text = "x" + section(call('call tool="a"'), call('call tool="b"'), end="")
    msg = parse_assistant(text)
    assert [c["id"] for c in msg.tool_calls] == ["functions.a:0", "functions.b:1"] and msg.content == "x"
    assert render_assistant_body(msg.to_openai()) == "x" + section(call('call tool="a" index="0"'),
                                                                   call('call tool="b" index="1"'))


@pytest.mark.parametrize("text", [
    section(call('call tool="f"')) + "\nx",                                    # text after the section
    section(call('call tool="f"'), end="<|close|>tools<|sep|><|close|>tools<|sep|>"),
    section('<|open|>call tool="f"<|sep|>{}<|close|>call<|sep|>'),              # arguments outside a block
    section('<|open|>call tool="f"<|sep|><|open|>json<|sep|>{}<|close|>call<|sep|>'),  # a block not closed
    section(call('call tool="f"', "")),                                         # no arguments in the block
    section(call('call tool="f"', "1")),
    section(call('call tool="f"', '"{}"')),
    section(call('call tool="f" index="x"')),
    section(call('call tool="f" index="¹"')),                                   # a digit, but not a number
    section(call('call tool="f" colour="red"')),                                # an unknown attribute
    section(call('call tool="f" tool="g"')),                                    # an attribute twice
    section(call('call name="f"')),                                             # no tool
    section(call('call tool="f"') + "x" + call('call tool="g"')),               # text between calls
    section('<|open|>call tool="f"<|sep|>' + argument("n", "one", "number") + "<|close|>call<|sep|>"),
    section('<|open|>call tool="f"<|sep|>' + argument("n", "1") + argument("n", "2") + "<|close|>call<|sep|>"),
    section('<|open|>call tool="f"<|sep|><|open|>argument type="string"<|sep|>1<|close|>argument<|sep|>'
            "<|close|>call<|sep|>"),                                            # an argument without its key
    section('<|open|>call tool="f"<|sep|><|open|>json type="array"<|sep|>{}<|close|>json<|sep|><|close|>call<|sep|>'),
    "<|open|>tool<|sep|>" + call('call tool="f"'),                              # not a tools section
    "a<|sep|>b" + section(call('call tool="f"')),                               # a section token in the content
    "<think>r</think>x" + section(call('call tool="f"', "[" * 100_000)),
])
def test_everything_else_is_malformed(text):
    msg = parse_assistant(text)
    assert msg.malformed and msg.tool_calls == [] and msg.content == text and msg.reasoning_content is None


def test_section_tokens_inside_json_strings_are_data():
    args = json.dumps({"new_str": "SECTION = '<|open|>tools<|sep|><|open|>call tool=\"x\"<|sep|><|close|>call<|sep|>'"})
    text = section(call('call tool="create" index="0"', args))
    msg = parse_assistant(text)
    assert not msg.malformed and msg.tool_calls[0]["function"]["arguments"] == args
    assert render_assistant_body(msg.to_openai()) == text


def test_a_tool_result_names_the_canonical_id_of_the_call_it_answers():
    """K3's format has no call ids: a client's own id (``call_abc``) becomes ``functions.NAME:IDX`` in the call and in
    the result, so the model sees which result answers which call."""
    msgs: list[dict[str, Any]] = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_abc", "type": "function", "function": {"name": "bash", "arguments": "{}"}},
            {"id": "functions.bash:5", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "one"},
        {"role": "tool", "tool_call_id": "functions.bash:5", "content": "two"},
        {"role": "tool", "tool_call_id": "unknown", "content": "three"}]
    out = render_chat(msgs)
    assert 'call tool="bash" index="0"' in out and 'call tool="bash" index="5"' in out
    assert "## Return of functions.bash:0\none" in out and "## Return of functions.bash:5\ntwo" in out
    assert "## Return of unknown\nthree" in out


def test_tool_spec_declares_a_closed_object():
    spec = tool_spec("bash", "Run a command.", {"command": {"type": "string"}}, ["command"])
    assert spec == {"type": "function", "function": {"name": "bash", "description": "Run a command.", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"],
        "additionalProperties": False}}}
    assert validate_tools([spec]) == [spec]
    with pytest.raises(ValueError):
        tool_spec("bad name!", "", {}, [])


def test_chat_tokens_are_tokenizer_special_tokens():
    assert set(chat.CHAT_TOKENS) <= set(SPECIAL_TOKENS)
    assert chat.render_chat([]) == chat.GENERATION_PROMPT


def test_importing_the_chat_format_does_not_import_torch():
    code = ("import sys; from policy import chat; from policy.chat import parse_assistant; "
            "assert not any(m.split('.')[0] in ('torch', 'numpy', 'pydantic', 'tokenizers') for m in sys.modules), "
            "sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[3])
