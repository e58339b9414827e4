"""Gymnasium environments on agentenv sandboxes: ``agentenv/Shell-v0`` (a shell), ``agentenv/SWE-v0`` (fix a
repository, graded like SWE-bench), ``agentenv/Tool-v0`` (small tool-use tasks with checkable answers) and
``agentenv/Lookup-v0`` (find a code in small files: the family the main job learns on).

The rooms: ``base`` (``SandboxEnv``), ``spaces``, ``tools/`` (tool groups, each tool declared once), the envs
(``shell_env``, ``swe_env``, ``tool_env``, ``lookup_env``), the task format and its sandbox (``task``,
``task_sandbox``), ``images``, ``grading/`` (the agent's patch graded in a fresh sandbox, guarded against
tampering) and ``tasks/`` (the shipped task set and ``agentenv tasks``).

``import envs`` registers them. Each is registered with Gymnasium's step limit (``max_episode_steps``,
so ``gymnasium.make`` wraps it in ``TimeLimit``) and the same number as the env's ``max_steps``, on
which it finishes the episode itself (see ``envs.base``). All of them build on ``envs.base.SandboxEnv``.
"""

import gymnasium

from envs import lookup_env, shell_env, swe_env, tool_env
from envs.base import SandboxEnv
from envs.lookup_env import LookupEnv
from envs.shell_env import ShellEnv
from envs.swe_env import SWEEnv
from envs.task import Task, TaskError, load_tasks
from envs.tool_env import ToolEnv

__all__ = ["LookupEnv", "SWEEnv", "SandboxEnv", "ShellEnv", "Task", "TaskError", "ToolEnv", "load_tasks"]

# id -> (entry point, step limit: TimeLimit's max_episode_steps and the env's own max_steps)
REGISTERED = {"agentenv/Shell-v0": ("envs.shell_env:ShellEnv", shell_env.DEFAULT_MAX_STEPS),
              "agentenv/SWE-v0": ("envs.swe_env:SWEEnv", swe_env.DEFAULT_MAX_STEPS),
              "agentenv/Tool-v0": ("envs.tool_env:ToolEnv", tool_env.DEFAULT_MAX_STEPS),
              "agentenv/Lookup-v0": ("envs.lookup_env:LookupEnv", lookup_env.DEFAULT_MAX_STEPS)}

for _id, (_entry_point, _steps) in REGISTERED.items():
    if _id not in gymnasium.registry:
        gymnasium.register(id=_id, entry_point=_entry_point, max_episode_steps=_steps, kwargs={"max_steps": _steps})
