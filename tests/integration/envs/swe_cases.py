"""What the tampering tests share: a shipped task's env reset on its image, and a command that must succeed."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from agentenv.api import SandboxLike
from envs.images import build_image
from envs.swe_env import SWEEnv
from envs.task import Task, shipped_tasks
from envs.tasks.libraries import load_libraries


@contextlib.contextmanager
def reset_env(library: str, pick: Callable[[Task], bool] = lambda t: True) -> Iterator[tuple[Task, SWEEnv]]:
    """The first shipped task of ``library`` that ``pick`` accepts, and its env, reset (the image built where
    missing); closed after."""
    lib = next(lib for lib in load_libraries() if lib.name == library)
    build_image(lib.recipe)
    task = next(t for t in shipped_tasks() if t.metadata["library"] == library and pick(t))
    env = SWEEnv(task=task)
    try:
        env.reset()
        yield task, env
    finally:
        env.close()


def run(sb: SandboxLike, command: str) -> str:
    r = sb.exec(command, timeout=120, cwd="/testbed")
    assert r.exit_code == 0, f"{command}: {r.stdout}{r.stderr}"
    return r.stdout
