"""The tools that end an episode: ``submit`` (the work is done; the env grades it) and ``answer``."""

from __future__ import annotations

from envs.tools.core import ToolGroup, ToolOutput, tool


class SubmitTool(ToolGroup):
    """``submit``: the current state is the agent's solution."""

    @tool("Submit the current state of /testbed as your fix; the episode ends and is graded.")
    def submit(self) -> ToolOutput:
        return ToolOutput("Submitted.", submitted=True)


class AnswerTool(ToolGroup):
    """``answer``: the agent's final answer (the env scores ``arguments["answer"]``)."""

    @tool("Give the final answer; the episode ends.", {"answer": {"type": "string"}}, ["answer"])
    def answer(self, answer: str) -> ToolOutput:
        return ToolOutput(f"Answer recorded: {answer}", submitted=True)
