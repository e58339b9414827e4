"""Environments built on agentenv: SWE-style coding tasks (``agentenv/SWE-v0``) and tool-use tasks (``agentenv/Tool-v0``)."""

import gymnasium

from envs.swe_env import SWEEnv
from envs.task import Task, TaskError, load_tasks
from envs.tool_env import ToolEnv

__all__ = ["SWEEnv", "Task", "TaskError", "ToolEnv", "load_tasks"]

if "agentenv/SWE-v0" not in gymnasium.registry:
    gymnasium.register(id="agentenv/SWE-v0", entry_point="envs.swe_env:SWEEnv")
if "agentenv/Tool-v0" not in gymnasium.registry:
    gymnasium.register(id="agentenv/Tool-v0", entry_point="envs.tool_env:ToolEnv")
