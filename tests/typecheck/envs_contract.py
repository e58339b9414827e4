"""Checked by mypy, never run: every env of ``envs`` satisfies the Protocols rollout is typed against
(``envs.protocol``), and ``gymnasium.make``'s wrapped env is a ``GymEnv``."""

from __future__ import annotations

from typing import Any

import gymnasium as gym

from envs import LookupEnv, ShellEnv, SWEEnv, ToolEnv
from envs.protocol import BranchingEnv, GymEnv


def branching(tool: ToolEnv, swe: SWEEnv, lookup: LookupEnv, shell: ShellEnv) -> list[BranchingEnv]:
    return [tool, swe, lookup, shell]


def made(env: gym.Env[Any, Any]) -> GymEnv:
    return env
