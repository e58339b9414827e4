"""Tools for agents in sandboxes, declared once and grouped; an env composes groups into a ``Toolbox``.

- ``core``: ``@tool``, ``ToolGroup``, ``ToolCall`` / ``ToolOutput``, ``check_arguments`` (the schema check);
- ``actions``: ``parse_action`` (K3 tool-call text through ``policy.chat.parse_assistant``, dicts, JSON);
- ``toolbox``: ``Toolbox`` (runs an action's calls in order), ``Turn``, ``CallResult``, ``ToolMessage`` (a call's
  answer as the agent's conversation holds it);
- the groups: ``BashTool``, ``PythonTool``, ``SearchTool`` (programs), ``FileTools`` (files),
  ``CalculatorTool``, ``SubmitTool`` and ``AnswerTool`` (finish).
"""

from envs.tools.actions import parse_action
from envs.tools.calculator import CalculatorTool, calculate
from envs.tools.core import (
    ActionError,
    Box,
    SandboxTools,
    Tool,
    ToolCall,
    ToolGroup,
    ToolOutput,
    check_arguments,
    describe_tools,
    tool,
)
from envs.tools.files import WORKDIR, FileTools, confine
from envs.tools.finish import AnswerTool, SubmitTool
from envs.tools.programs import BashTool, PythonTool, SearchTool
from envs.tools.toolbox import CallResult, Toolbox, ToolMessage, Turn

__all__ = ["WORKDIR", "ActionError", "AnswerTool", "BashTool", "Box", "CalculatorTool", "CallResult", "FileTools",
           "PythonTool", "SandboxTools", "SearchTool", "SubmitTool", "Tool", "ToolCall", "ToolGroup", "ToolMessage",
           "ToolOutput", "Toolbox", "Turn", "calculate", "check_arguments", "confine", "describe_tools", "parse_action", "tool"]
