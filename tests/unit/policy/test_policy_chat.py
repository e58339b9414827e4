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
    assert ("<|im_assistant|>assistant<|im_middle|><think>use the tool</think><|tool_calls_section_begin|>"
            "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Paris\"}"
            "<|tool_call_end|><|tool_calls_section_end|><|im_end|>") in out
    assert "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nsunny<|im_end|>" in out
    assert out.endswith("<|im_assistant|>assistant<|im_middle|>")


@pytest.mark.parametrize("text", [
    "Plain answer.",
    "<think>let me think</think>The answer is 4.",
    "<think></think>",
    "Calling.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    '{"city":  "Paris"}<|tool_call_end|><|tool_call_begin|>functions.run_command:1<|tool_call_argument_begin|>'
    '{"cmd": "ls"}<|tool_call_end|><|tool_calls_section_end|>',
    "<think>t</think><|tool_calls_section_begin|><|tool_call_begin|>functions.x.y-z:7<|tool_call_argument_begin|>"
    "{}<|tool_call_end|><|tool_calls_section_end|>",
])
def test_parse_then_render_is_byte_identical(text):
    msg = parse_assistant(text)
    assert not msg.malformed
    assert render_assistant_body(msg.to_openai()) == text


def test_parse_gives_openai_tool_calls():
    text = ("Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
            '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>')
    msg = parse_assistant(text)
    assert msg.content == "Sure."
    assert msg.tool_calls == [{"id": "functions.get_weather:0", "type": "function",
                               "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]


@pytest.mark.parametrize("text", [
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{bad json<|tool_call_end|>"
    "<|tool_calls_section_end|>",
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}",
    "text<|tool_call_end|>",
    "<|tool_calls_section_begin|><|tool_call_begin|>non sense<|tool_call_argument_begin|>{}<|tool_call_end|>"
    "<|tool_calls_section_end|>",
    "<|tool_calls_section_begin|><|tool_calls_section_end|>",
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.x.y-z:7<|tool_call_argument_begin|>[]<|tool_call_end|>"
    "<|tool_calls_section_end|>",
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


@pytest.mark.parametrize(("call", "name", "call_id", "args"), [
    ("functions.get_weather:3<|tool_call_argument_begin|>{}", "get_weather", "functions.get_weather:3", "{}"),
    ("nonsense<|tool_call_argument_begin|>{}", "nonsense", "functions.nonsense:0", "{}"),  # no prefix, no :idx
    ("bash:2<|tool_call_argument_begin|>{}", "bash", "functions.bash:2", "{}"),
    ("functions.bash<|tool_call_argument_begin|>{}", "bash", "functions.bash:0", "{}"),
    (" \n functions.bash:0\t<|tool_call_argument_begin|>\n {\"a\": 1} \n", "bash", "functions.bash:0", '{"a": 1}'),
    ("functions.functions.x:1<|tool_call_argument_begin|>{}", "functions.x", "functions.functions.x:1", "{}"),
])
def test_lenient_call_ids_and_whitespace_are_normalised(call, name, call_id, args):
    text = f"<|tool_calls_section_begin|><|tool_call_begin|>{call}<|tool_call_end|><|tool_calls_section_end|>"
    msg = parse_assistant(text)
    assert not msg.malformed and msg.content == ""
    assert msg.tool_calls == [{"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}]


def test_missing_section_end_at_the_end_is_accepted_and_the_index_is_the_position():
    text = ("x<|tool_calls_section_begin|><|tool_call_begin|>a<|tool_call_argument_begin|>{}<|tool_call_end|>"
            "<|tool_call_begin|>b<|tool_call_argument_begin|>{}<|tool_call_end|>")
    msg = parse_assistant(text)
    assert [c["id"] for c in msg.tool_calls] == ["functions.a:0", "functions.b:1"] and msg.content == "x"
    assert render_assistant_body(msg.to_openai()) == (
        "x<|tool_calls_section_begin|><|tool_call_begin|>functions.a:0<|tool_call_argument_begin|>{}<|tool_call_end|>"
        "<|tool_call_begin|>functions.b:1<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>")


@pytest.mark.parametrize("text", [
    "<|tool_calls_section_begin|><|tool_call_begin|>f:0<|tool_call_argument_begin|>{}<|tool_call_end|>"
    "<|tool_calls_section_end|>\n",  # text after the section
    "<|tool_calls_section_begin|><|tool_call_begin|>f:0<|tool_call_argument_begin|>{}<|tool_call_end|>"
    "<|tool_calls_section_end|><|tool_calls_section_end|>",
    "<|tool_calls_section_begin|><|tool_call_begin|>f:0{}<|tool_call_end|><|tool_calls_section_end|>",  # no arg begin
    "<|tool_calls_section_begin|><|tool_call_begin|>f:0<|tool_call_argument_begin|><|tool_call_end|>",  # no args
    "<|tool_calls_section_begin|><|tool_call_begin|>f:0<|tool_call_argument_begin|>1<|tool_call_end|>",
    "<|tool_calls_section_begin|><|tool_call_begin|>f:0<|tool_call_argument_begin|>\"{}\"<|tool_call_end|>",
    "<|tool_calls_section_begin|><|tool_call_begin|>f:x<|tool_call_argument_begin|>{}<|tool_call_end|>",
    "<|tool_calls_section_begin|><|tool_call_argument_begin|><|tool_call_begin|>f:0{}<|tool_call_end|>",
    "<|tool_calls_section_begin|> <|tool_call_begin|>f:0<|tool_call_argument_begin|>{}<|tool_call_end|>",
    "a<|tool_call_argument_begin|>b<|tool_calls_section_begin|><|tool_call_begin|>f:0<|tool_call_argument_begin|>{}"
    "<|tool_call_end|><|tool_calls_section_end|>",  # a tool-call token in the content
    "<think>r</think>x<|tool_calls_section_begin|><|tool_call_begin|>f:0<|tool_call_argument_begin|>"
    + "[" * 100_000 + "<|tool_call_end|>",
])
def test_everything_else_is_malformed(text):
    msg = parse_assistant(text)
    assert msg.malformed and msg.tool_calls == [] and msg.content == text and msg.reasoning_content is None


def test_tool_call_tokens_inside_json_strings_are_data():
    args = json.dumps({"new_str": "SECTION = '<|tool_calls_section_begin|><|tool_call_begin|>'"})
    text = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.create:0<|tool_call_argument_begin|>"
            f"{args}<|tool_call_end|><|tool_calls_section_end|>")
    msg = parse_assistant(text)
    assert not msg.malformed and msg.tool_calls[0]["function"]["arguments"] == args
    assert render_assistant_body(msg.to_openai()) == text


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
