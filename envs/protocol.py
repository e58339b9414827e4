"""What rollout may use of an env: the Gymnasium face it steps, and the sandbox face it branches (``SandboxEnv``).

Rollout (the agent loop, GRPO groups, pause and resume, search) is typed against these Protocols, not against
``SandboxEnv`` and its hooks, and never probes an env for attributes:

- ``GymEnv``: ``reset`` / ``step`` / ``close`` and ``unwrapped``, what ``gymnasium.make`` returns (the env inside
  Gymnasium's wrappers, whose ``TimeLimit`` the loop steps through) and every ``SandboxEnv``;
- ``BranchingEnv``: the env under the wrappers (``unwrap(env)``): its ``task`` and step count (``steps``), its
  sandbox (``sandbox``: None until a ``lazy_sandbox`` env's first tool needs one), its tools (``toolbox``; an env
  whose actions are plain commands has none and raises ``NotImplementedError``), and the branching of an episode:
  ``fork``, ``snapshot``, ``restore``.

A step's answer to the agent's tool calls is typed too: ``info["tool_messages"]`` holds ``ToolMessage``s (one per
call that ran; ``tool_messages(info)`` reads them), so the loop builds the conversation from them instead of
parsing the observation. A step that ran no call (a shell env's command, an action with no readable call) has none.
``tests/typecheck/envs_contract.py`` checks that every env of ``envs`` satisfies ``BranchingEnv``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, SupportsFloat

import gymnasium as gym

from agentenv.api import SandboxLike, SnapshotLike
from envs.base import SandboxEnv
from envs.tools.toolbox import TOOL_MESSAGES, Toolbox, ToolMessage

__all__ = ["TOOL_MESSAGES", "BranchingEnv", "GymEnv", "ToolMessage", "tool_messages", "unwrap"]


class GymEnv(Protocol):
    """The Gymnasium face of an env: what the agent loop resets, steps and closes."""

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]: ...

    def step(self, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]: ...

    def close(self) -> None: ...

    @property
    def unwrapped(self) -> gym.Env[Any, Any]: ...


class BranchingEnv(GymEnv, Protocol):
    """An env whose episode lives in one sandbox, as rollout uses it (``SandboxEnv`` is one)."""

    steps: int
    """The steps taken in this episode (a restored lazy episode's count is set back)."""

    workdir: str
    """Where the task's files are (a harness playing the episode starts there)."""

    @property
    def lazy_sandbox(self) -> bool:
        """The sandbox starts when a tool first needs it, not at reset."""

    @property
    def task(self) -> object:
        """The episode's task (what ``reset(options={"task": ...})`` takes back); None before reset."""

    @property
    def sandbox(self) -> SandboxLike | None:
        """The episode's sandbox: None before reset, or before a lazy env's first tool needs it."""

    @property
    def toolbox(self) -> Toolbox:
        """The env's tools; ``NotImplementedError`` for an env whose actions are plain commands."""

    def fork(self, n: int, memory: bool = False) -> Sequence[BranchingEnv]: ...

    def grade_submission(self, submission: str) -> tuple[float, dict[str, Any]]: ...

    def snapshot(self, memory: bool = False) -> SnapshotLike: ...

    def restore(self, snapshot: SnapshotLike | str) -> str: ...


def unwrap(env: GymEnv) -> BranchingEnv:
    """The env inside Gymnasium's wrappers, as rollout branches it; TypeError for an env with no sandbox episode."""
    base = env.unwrapped
    if not isinstance(base, SandboxEnv):
        raise TypeError(f"{type(base).__name__} is not a SandboxEnv: rollout plays envs whose episode lives in a "
                        "sandbox (envs.base.SandboxEnv)")
    return base


def tool_messages(info: Mapping[str, Any]) -> tuple[ToolMessage, ...]:
    """The ``ToolMessage``s of a step's ``info`` (none when it ran no tool call)."""
    found = info.get(TOOL_MESSAGES, ())
    if not isinstance(found, tuple) or not all(isinstance(m, ToolMessage) for m in found):
        raise TypeError(f"info[{TOOL_MESSAGES!r}] holds ToolMessages, got {found!r}")
    return found
