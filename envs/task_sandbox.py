"""The sandbox of an SWE task: the task's image with /testbed brought to the task's base commit.

Shared by the env (``SWEEnv.reset``) and the task-set tools (``envs.tasks``: build, validate).
"""

from __future__ import annotations

import shlex
from typing import Any

import agentenv
from agentenv.api import Backend, SandboxLike
from agentenv.errors import AgentEnvError
from envs.base import TASK_LABEL
from envs.task import Task


class SetupError(AgentEnvError):
    """A task's sandbox could not be brought to its base commit."""


def start_task_sandbox(task: Task, api: Backend = agentenv, **sandbox_kwargs: Any) -> SandboxLike:
    """A sandbox of ``task.image`` with /testbed at the task's base commit (the image is never rebuilt)."""
    kwargs = {"cpus": 1.0, "memory": "2g", **sandbox_kwargs}
    sb = api.Sandbox.create(task.image, labels={TASK_LABEL: task.instance_id}, **kwargs)
    try:
        commands = list(task.setup_commands) or [
            f"git checkout -q -f {shlex.quote(task.base_commit)} && git clean -fdq"]
        for cmd in commands:
            r = sb.exec(cmd, timeout=300, cwd="/testbed")
            if r.exit_code != 0:
                raise SetupError(f"task {task.instance_id}: setup command failed ({r.exit_code}): "
                                 f"{(r.stdout + r.stderr).strip()[-600:]}", fix="check the task's image and setup")
        head = sb.exec("git rev-parse HEAD", timeout=60, cwd="/testbed").stdout.strip()
        if not head.startswith(task.base_commit):
            raise SetupError(f"task {task.instance_id}: /testbed is at {head or 'no commit'}, not the base "
                             f"commit {task.base_commit}", fix="rebuild the image (python -m envs.tasks images)")
    except BaseException:
        sb.close()
        raise
    return sb
