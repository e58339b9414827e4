"""ShellEnv (``agentenv/Shell-v0``): the Gymnasium view of a sandbox — the action is a shell command,
the observation its output (printable ASCII, unprintable characters shown as ``?``).

Reward is 0 (a plain shell has no goal); subclass or wrap to add one. The episode's "task" is the
image its sandbox starts from; ``info`` of a step holds the command's exit code and whether it timed out.
"""

from __future__ import annotations

from typing import Any

from agentenv.api import DEFAULT_IMAGE, Backend, SandboxLike
from envs.base import SandboxEnv
from envs.spaces import PrintableText

MAX_OBSERVATION = 8192
MAX_ACTION = 4096


DEFAULT_MAX_STEPS = 50  # also the step limit it is registered with (envs/__init__.py)

class ShellEnv(SandboxEnv[str]):
    """One sandbox per episode; each step runs a command and observes its output and exit code."""

    def __init__(self, image: str = DEFAULT_IMAGE, max_steps: int | None = DEFAULT_MAX_STEPS, timeout: float = 30.0,
                 render_mode: str | None = None, api: Backend | None = None, **sandbox_kwargs: Any) -> None:
        super().__init__(api=api, max_steps=max_steps, render_mode=render_mode, sandbox_kwargs=sandbox_kwargs)
        self.observation_space = PrintableText(MAX_OBSERVATION)
        self.action_space = PrintableText(MAX_ACTION, min_length=1)
        self.image, self.timeout = image, timeout
        self.task = image  # what an unlabelled snapshot continues

    def _resolve_task(self, ref: Any) -> str:
        return str(ref) if ref is not None else self.image

    def _task_id(self, task: str) -> str:
        return task

    def _start_sandbox(self, task: str) -> SandboxLike:
        return self.api.Sandbox.create(task, **self.sandbox_kwargs)

    def _first_observation(self, task: str) -> str:
        return ""

    def _info(self) -> dict[str, Any]:
        return {"sandbox_id": self.sandbox.id if self.sandbox else None}

    def _act(self, action: Any) -> tuple[str, float, bool, dict[str, Any]]:
        if not isinstance(action, str):
            raise TypeError(f"action must be a shell command as text, got {type(action).__name__}")
        r = self.box().exec(action, timeout=self.timeout)
        text = r.stdout + r.stderr + (f"\n[timed out after {self.timeout:g} s]" if r.timed_out else "")
        return text, 0.0, False, {"exit_code": r.exit_code, "timed_out": r.timed_out}
