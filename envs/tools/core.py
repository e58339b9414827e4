"""Tools declared once — schema and implementation together — in groups that envs compose.

A ``ToolGroup`` subclass declares its tools with ``@tool`` on the methods that run them::

    class CalculatorTool(ToolGroup):
        @tool("Evaluate an arithmetic expression.", {"expression": {"type": "string"}}, ["expression"])
        def calculator(self, expression: str) -> ToolOutput: ...

The group exposes its declarations (``specs()``: OpenAI-style function declarations, made by
``policy.chat.tool_spec``) and runs a tool by name (``run``). Arguments are checked against the
declared schema in one place, ``check_arguments``, before a tool runs, so a tool's method receives
only the arguments it declared, of the declared types. Anything wrong with a call raises
``ActionError``, whose message is what the agent sees.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from agentenv.api import SandboxLike
from policy.chat import tool_spec

# Names other agent scaffolds use for the same arguments; renamed when the tool takes the target name.
ALIASES = {"file": "path", "old": "old_str", "new": "new_str", "content": "file_text", "cmd": "command",
           "lines": "view_range"}
_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}
_MARK = "__agentenv_tool__"  # the attribute ``@tool`` puts its declaration under


class ActionError(ValueError):
    """An action or tool call that cannot be run; its message is what the agent sees."""


@dataclass(frozen=True)
class ToolCall:
    """One call as the agent sent it: ``arguments`` are a dict, JSON text, or None (no arguments)."""

    name: str
    arguments: Any = None
    id: str = ""


@dataclass(frozen=True)
class ToolOutput:
    """What a tool returns: the text the agent sees; ``submitted``: the call ends the episode."""

    text: str
    error: bool = False
    submitted: bool = False


@dataclass(frozen=True)
class Tool:
    """A tool's declaration: its name, what it does, its arguments' JSON schema, and the method that runs it."""

    name: str
    description: str
    properties: Mapping[str, Any]
    required: tuple[str, ...]
    method: str

    @property
    def spec(self) -> dict[str, Any]:
        """The OpenAI-style function declaration the agent is shown."""
        return tool_spec(self.name, self.description, dict(self.properties), list(self.required))


_F = TypeVar("_F", bound=Callable[..., ToolOutput])


def tool(description: str, properties: Mapping[str, Any] | None = None, required: Sequence[str] = (), *,
         name: str | None = None) -> Callable[[_F], _F]:
    """Declare the decorated method of a ``ToolGroup`` as a tool (named after the method by default)."""

    def declare(fn: _F) -> _F:
        setattr(fn, _MARK, Tool(name or fn.__name__, description, dict(properties or {}), tuple(required),
                                fn.__name__))
        return fn

    return declare


class ToolGroup:
    """Tools that belong together (e.g. the file tools); an env composes groups into a ``Toolbox``."""

    tools: ClassVar[tuple[Tool, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        found = {t.name: t for t in cls.tools}
        found.update({t.name: t for v in vars(cls).values() if isinstance(t := getattr(v, _MARK, None), Tool)})
        cls.tools = tuple(found.values())

    @classmethod
    def specs(cls) -> list[dict[str, Any]]:
        return [t.spec for t in cls.tools]

    def run(self, name: str, arguments: Mapping[str, Any]) -> ToolOutput:
        """Run the tool ``name`` with arguments already checked by ``check_arguments``."""
        found = next((t for t in self.tools if t.name == name), None)
        if found is None:
            raise ActionError(f"unknown tool {name!r}; the tools are: {', '.join(t.name for t in self.tools)}")
        out: ToolOutput = getattr(self, found.method)(**arguments)
        return out


Box = Callable[[], SandboxLike]  # the episode's sandbox, started on first use when the env starts it lazily


class SandboxTools(ToolGroup):
    """A group whose tools act in the episode's sandbox (asked for on each call, so it may start lazily)."""

    def __init__(self, box: Box) -> None:
        self._box = box

    @property
    def sandbox(self) -> SandboxLike:
        return self._box()


def tool_names(specs: Sequence[Mapping[str, Any]]) -> list[str]:
    return [t["function"]["name"] for t in specs]


def decode_arguments(call: ToolCall) -> dict[str, Any]:
    """The call's arguments as a dict: JSON text is decoded, None is no arguments."""
    raw = call.arguments
    if isinstance(raw, Mapping):
        return dict(raw)
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return {}
    if not isinstance(raw, str):
        raise ActionError(f"arguments of {call.name!r} must be a JSON object, got {type(raw).__name__}")
    try:
        args = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ActionError(f"arguments of {call.name!r} are not valid JSON: {e}") from None
    if not isinstance(args, dict):
        raise ActionError(f"arguments of {call.name!r} must be a JSON object, got {type(args).__name__}")
    return args


def check_arguments(call: ToolCall, specs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The call's arguments, decoded, renamed from ``ALIASES`` and checked against its tool's schema."""
    spec = next((t["function"] for t in specs if t["function"]["name"] == call.name), None)
    if spec is None:
        raise ActionError(f"unknown tool {call.name!r}; the tools are: {', '.join(tool_names(specs))}")
    props: dict[str, Any] = spec["parameters"]["properties"]
    args = {ALIASES.get(k, k) if ALIASES.get(k) in props else k: v for k, v in decode_arguments(call).items()}
    unknown = sorted(set(args) - set(props))
    if unknown:
        raise ActionError(f"{call.name}: unknown argument(s) {unknown}; it takes {sorted(props) or 'none'}")
    missing = [k for k in spec["parameters"]["required"] if k not in args]
    if missing:
        raise ActionError(f"{call.name}: missing required argument(s) {missing}")
    for k, v in args.items():
        want = props[k].get("type")
        if not _JSON_TYPES.get(want, lambda _: True)(v):
            article = "an" if want[0] in "aeiou" else "a"
            raise ActionError(f"{call.name}: argument {k!r} must be {article} {want}, got {type(v).__name__}")
    return args


def describe_tools(specs: Sequence[Mapping[str, Any]]) -> str:
    """The tool list as text, for an env's first observation."""
    out = []
    for t in specs:
        f = t["function"]
        params = ", ".join(f"{k}{'' if k in f['parameters']['required'] else '?'}: {v.get('type', 'any')}"
                           for k, v in f["parameters"]["properties"].items())
        out.append(f"- {f['name']}({params}): {f['description']}")
    return "\n".join(out)
