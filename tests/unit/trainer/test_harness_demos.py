"""The harness demonstrator's script (``trainer.harness_demos.in_harness``): the Lookup expert, shown mini-swe-agent's
rendering of a command's output, looks first, then submits the code the harness's way; a plain answer becomes a
submission too."""

import json

from policy import chat
from rollout import scripted
from rollout.agent import LocalTokenizer
from rollout.experts import lookup_expert
from trainer.harness_demos import LOOK_AND_SUBMIT, SUBMIT, in_harness

TOK = LocalTokenizer()
BASH = [chat.tool_spec("bash", "Execute a bash command", {"command": {"type": "string"}}, ["command"])]


def prompt(messages: list[dict]) -> str:
    return scripted.readable(TOK.decode_pieces(TOK.encode_chat(messages, BASH)))


def command(text: str) -> str:
    (call,) = chat.parse_assistant(text).tool_calls
    return str(json.loads(call["function"]["arguments"])["command"])


def test_the_expert_looks_then_submits_what_mini_swe_agent_showed_it():
    script = in_harness(lookup_expert())
    first = [{"role": "system", "content": "Use bash."}, {"role": "user", "content": "What code is in file model?"}]
    assert command(script(prompt(first), 0)) == "cat model"
    shown = "<returncode>0</returncode>\n<output>\nelement\n</output>"     # mini-swe-agent's observation template
    second = [*first, {"role": "assistant", "content": "", "tool_calls": [{"id": "functions.bash:0", "type": "function",
              "function": {"name": "bash", "arguments": "{\"command\": \"cat model\"}"}}]},
              {"role": "tool", "tool_call_id": "functions.bash:0", "content": shown}]
    assert command(script(prompt(second), 1)) == SUBMIT.format(answer="element")


def test_a_plain_answer_is_submitted_the_harness_way():
    script = in_harness(lambda p, turn: "python")
    assert command(script("anything", 0)) == SUBMIT.format(answer="python")


def test_with_one_command_the_look_is_the_submission():
    script = in_harness(lookup_expert(), one_command=True)
    first = [{"role": "system", "content": "Use bash."}, {"role": "user", "content": "What code is in the file model?"}]
    assert command(script(prompt(first), 0)) == LOOK_AND_SUBMIT.format(look="cat *")   # level 0: one file
    level2 = [first[0], {"role": "user", "content": "What is the code of model in the files?"}]
    assert command(script(prompt(level2), 0)) == "grep model *"      # not a look whose output is the code
