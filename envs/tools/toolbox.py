"""A Toolbox: the tool groups of one env, run from an agent's action.

``Toolbox(FileTools(box), BashTool(box), SubmitTool()).run(action)`` parses the action, then runs
every call in order — each one's arguments checked against its tool's schema — and stops after a
call that ends the episode (``submit``, ``answer``). Nothing an agent sends raises: a malformed
action, an unknown tool, bad arguments or a failing tool each come back as text that says what was
wrong. The ``Turn`` it returns holds each call's result and the observation text, and the K3 tool messages that
answer the action's calls (``Turn.messages``: what an env's step hands the agent loop as ``info["tool_messages"]``,
so the loop never parses the observation again).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from envs.spaces import truncate
from envs.tools.actions import parse_action
from envs.tools.core import ActionError, ToolCall, ToolGroup, ToolOutput, check_arguments, describe_tools
from policy.chat import validate_tools

MAX_OUTPUT = 10_000
TOOL_MESSAGES = "tool_messages"  # the key of a step's ``info`` that holds its ``ToolMessage``s


@dataclass(frozen=True)
class ToolMessage:
    """The env's answer to one tool call of an action, as the agent's conversation holds it (a K3 tool message)."""

    call_id: str
    content: str

    def to_chat(self) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": self.call_id, "content": self.content}


@dataclass(frozen=True)
class CallResult:
    """One call that ran: its id and tool name, its (truncated) output, and whether it failed or ended the episode."""

    id: str
    name: str
    output: str
    error: bool = False
    submitted: bool = False
    arguments: dict[str, Any] = field(default_factory=dict)  # as checked ({} when they were refused)

    def to_info(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "error": self.error, "output": self.output}


@dataclass(frozen=True)
class Turn:
    """What one action did: the calls that ran, or why none could (``problem``)."""

    calls: tuple[CallResult, ...] = ()
    problem: str = ""

    @property
    def text(self) -> str:
        """The observation: the output of the call, each output under its tool's name when there are several."""
        if self.problem:
            return f"Error: {self.problem}"
        if len(self.calls) == 1:
            return self.calls[0].output
        return "\n\n".join(f"[{c.name}]\n{c.output}" for c in self.calls)

    @property
    def error(self) -> bool:
        return bool(self.problem) or any(c.error for c in self.calls)

    @property
    def ending(self) -> CallResult | None:
        """The call that ended the episode, if one did (it is the last that ran)."""
        return self.calls[-1] if self.calls and self.calls[-1].submitted else None

    @property
    def messages(self) -> tuple[ToolMessage, ...]:
        """One tool message per call that ran; none for an action whose calls could not be read (``problem``: it
        named no call the agent could be answered on, so the agent sees the observation as plain text)."""
        return tuple(ToolMessage(c.id or f"functions.{c.name}:{i}", c.output) for i, c in enumerate(self.calls))

    def info(self) -> dict[str, Any]:
        """``tool`` (the first call's name), ``error``, ``calls`` (``{id, name, error, output}`` each) and
        ``tool_messages`` (``messages``)."""
        return {"tool": self.calls[0].name if self.calls else None, "error": self.error,
                "calls": [c.to_info() for c in self.calls], TOOL_MESSAGES: self.messages}


class Toolbox:
    """The groups of tools an env offers, by name."""

    def __init__(self, *groups: ToolGroup, max_output: int = MAX_OUTPUT) -> None:
        self.groups, self.max_output = groups, max_output
        self._owner = {t.name: g for g in groups for t in g.tools}
        self.specs = validate_tools([t.spec for g in groups for t in g.tools])
        if len(self._owner) != len(self.specs):
            raise ValueError("two tool groups declare a tool of the same name")
        self.names = list(self._owner)

    def describe(self) -> str:
        return describe_tools(self.specs)

    def run(self, action: Any) -> Turn:
        """Run the action's calls in order, up to one that ends the episode; never raises for what the agent sent."""
        try:
            calls = parse_action(action)
        except ActionError as e:
            return Turn(problem=truncate(str(e), self.max_output))
        results: list[CallResult] = []
        for call in calls:
            results.append(self.call(call))
            if results[-1].submitted:
                break
        return Turn(tuple(results))

    def call(self, call: ToolCall) -> CallResult:
        """Run one call; an ActionError becomes an error output."""
        args: dict[str, Any] = {}
        try:
            args = check_arguments(call, self.specs)
            out = self._owner[call.name].run(call.name, args)
        except ActionError as e:
            out = ToolOutput(f"Error: {e}", error=True)
        return CallResult(call.id, call.name, truncate(out.text, self.max_output), out.error, out.submitted, args)
