"""ShellEnv: the Gymnasium view of a sandbox — the action is a shell command, the observation its output."""

from __future__ import annotations

import string
from typing import Any

import gymnasium as gym
from gymnasium import spaces

from agentenv.sandbox import DEFAULT_IMAGE, Sandbox

CHARSET = frozenset(string.printable)
MAX_OBSERVATION = 8192
MAX_ACTION = 4096
TRUNCATED = "\n[... output truncated ...]\n"


def to_observation(text: str, limit: int = MAX_OBSERVATION) -> str:
    """Map output onto the observation space: printable ASCII only, cut in the middle past ``limit``."""
    clean = "".join(c if c in CHARSET else "?" for c in text)
    if len(clean) > limit:
        keep = (limit - len(TRUNCATED)) // 2
        clean = clean[:keep] + TRUNCATED + clean[len(clean) - keep:]
    return clean


class ShellEnv(gym.Env[str, str]):
    """One sandbox per episode; each step runs a command and observes its output and exit code.

    Reward is 0 (a plain shell has no goal); subclass or wrap to add one. An episode is truncated
    after ``max_steps`` steps.
    """

    metadata = {"render_modes": ["ansi"]}

    def __init__(self, image: str = DEFAULT_IMAGE, max_steps: int = 50, timeout: float = 30.0,
                 render_mode: str | None = None, api: Any = None, **sandbox_kwargs: Any) -> None:
        self.api = api  # None: this host's sandboxes; or agentenv.connect(...) / agentenv.Pool(...)
        self.observation_space = spaces.Text(max_length=MAX_OBSERVATION, min_length=0, charset=string.printable)
        self.action_space = spaces.Text(max_length=MAX_ACTION, min_length=1, charset=string.printable)
        self.image, self.max_steps, self.timeout = image, max_steps, timeout
        self.render_mode = render_mode
        self._kwargs = sandbox_kwargs
        self.sandbox: Sandbox | None = None
        self._steps = 0
        self._last = ""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """Start a fresh sandbox (from ``options['snapshot']`` when given)."""
        super().reset(seed=seed)
        if self.sandbox is not None:
            self.sandbox.close()
        snap = (options or {}).get("snapshot")
        factory = Sandbox if self.api is None else self.api.Sandbox
        self.sandbox = factory.restore(snap) if snap else factory.create(self.image, **self._kwargs)
        self._steps = 0
        self._last = ""
        return "", {"sandbox_id": self.sandbox.id}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.sandbox is None:
            raise RuntimeError("call reset() before step()")
        if not isinstance(action, str):
            raise TypeError(f"action must be a shell command as text, got {type(action).__name__}")
        result = self.sandbox.exec(action, timeout=self.timeout)
        self._steps += 1
        text = result.stdout + result.stderr
        if result.timed_out:
            text += f"\n[timed out after {self.timeout:g} s]"
        self._last = to_observation(text)
        info = {"exit_code": result.exit_code, "timed_out": result.timed_out}
        return self._last, 0.0, False, self._steps >= self.max_steps, info

    def render(self) -> str | None:
        return self._last if self.render_mode == "ansi" else None

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()
            self.sandbox = None
