"""An agent's action as tool calls.

An action is text in Kimi K3's tool-call format — read by ``policy.chat.parse_assistant``, the
parser the policy server uses, so an env runs exactly the calls the server reports and refuses
exactly the messages it flags malformed — or, for scripts and other scaffolds, a dict
(``{"name": "bash", "arguments": {...}}``, ``{"tool": ..., "args": ...}``, an OpenAI-style
``{"function": {"name": ..., "arguments": "<json>"}}``), a list of such dicts (OpenAI ``tool_calls``),
or one as plain JSON text. ``parse_action`` never looks at the arguments; ``check_arguments`` does, per call.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from envs.tools.core import ActionError, ToolCall
from policy.chat import parse_assistant
from policy.tool_calls import (
    CALL_END,
    FUNCTION_PREFIX,
    JSON_BEGIN,
    JSON_END,
    OPEN,
    SECTION_BEGIN,
    SECTION_END,
    SEP,
)

FORMAT = f'{SECTION_BEGIN}{OPEN}call tool="NAME"{SEP}{JSON_BEGIN}{{json arguments}}{JSON_END}{CALL_END}{SECTION_END}'
MALFORMED = ("malformed tool-call section: after any prose, write " + SECTION_BEGIN + ", then for each call "
             + OPEN + 'call tool="NAME" index="IDX"' + SEP + JSON_BEGIN + "{arguments}" + JSON_END + CALL_END
             + ", then " + SECTION_END + "; the arguments must be a JSON object (text that is not valid JSON, a list"
             " or a number is refused) and nothing may follow the section")
NO_CALL = f"no tool call found in the action: call a tool in the tool-call format ({FORMAT})"


def parse_action(action: Any) -> list[ToolCall]:
    """The tool calls of an action, in order; ActionError says what is wrong (and what the format is)."""
    if isinstance(action, Mapping):
        return [_from_mapping(action, 0)]
    if isinstance(action, Sequence) and not isinstance(action, str) and action:  # e.g. OpenAI ``tool_calls``
        if not all(isinstance(a, Mapping) for a in action):
            raise ActionError("a list action holds tool calls (dicts)")
        return [_from_mapping(a, i) for i, a in enumerate(action)]
    if not isinstance(action, str):
        raise ActionError(f"an action is a tool call (text or dict), got {type(action).__name__}")
    msg = parse_assistant(action)
    if msg.malformed:
        raise ActionError(MALFORMED)
    if msg.tool_calls:
        return [_from_mapping(c, i) for i, c in enumerate(msg.tool_calls)]
    if action.strip().startswith("{"):
        try:
            data = json.loads(action)
        except ValueError as e:
            raise ActionError(f"the action looks like JSON but does not parse: {e}") from None
        return [_from_mapping(data if isinstance(data, Mapping) else {}, 0)]
    raise ActionError(NO_CALL)


def _from_mapping(d: Mapping[str, Any], index: int) -> ToolCall:
    call_id = d.get("id")
    if isinstance(d.get("function"), Mapping):  # OpenAI style (and what parse_assistant returns)
        d = d["function"]
    name = d.get("name", d.get("tool"))
    if not isinstance(name, str) or not name:
        raise ActionError("a tool call needs a tool name ('name')")
    name = name.removeprefix(FUNCTION_PREFIX)
    arguments = d.get("arguments", d.get("args", d.get("input")))
    return ToolCall(name, arguments, call_id if isinstance(call_id, str) and call_id else
                    f"{FUNCTION_PREFIX}{name}:{index}")
