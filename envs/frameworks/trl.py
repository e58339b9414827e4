"""agentenv's envs as TRL environments: ``GRPOTrainer(environment_factory=SWEEnvironment)`` (or
``LookupEnvironment``, or a dict of both with an ``environment`` column).

TRL's contract (``trl.trainer.grpo_trainer``, 1.16): the factory makes one instance per concurrent rollout,
pooled and reused; before each rollout TRL calls ``reset(**row)`` with the dataset row and appends the string it
returns to the prompt's last user message; every public method of the class other than ``reset`` and
``get_reward`` is a tool, its schema read from its type hints and Google-style docstring, called as
``method(**arguments)`` when the model calls it, its return value the tool's message; after the rollout
``get_reward()`` scores it (weight 1, logged under the class name).

Here ``reset(task=..., prompt=...)`` starts the agentenv env's episode on the row's ``task`` (an id or record;
none: the env draws one) in a fresh sandbox (the previous rollout's is closed), and returns the env's first
observation (the issue, or the question). ``prompt`` is TRL's column (TRL renders it); any other column is an
error, not silently dropped. Each tool is one step of the env (``{"name", "arguments"}``), so the env's step
limit and its grader hold: ``get_reward()`` is our grader's reward. For SWE-v0 a rollout that never called
``submit`` is graded as the env grades at its last step (the patch as it stands); for Lookup-v0 no answer is 0.

Constructor keyword arguments go to ``gymnasium.make`` (``max_steps``, ``api``, sandbox settings...):
``environment_factory=functools.partial(SWEEnvironment, max_steps=20)``. This module needs no TRL import: the
contract is the shape of the class. Sandboxes are closed at the next ``reset``, by ``_close()``, or when the
instance is collected (``weakref.finalize``, which also runs at interpreter exit).
"""

from __future__ import annotations

import weakref
from typing import Any, ClassVar

import gymnasium

import envs  # noqa: F401  (registers the Gymnasium ids)

TRL_COLUMNS = frozenset({"prompt"})  # the columns TRL itself uses; every other one must mean something here


class _AgentenvEnvironment:
    """The episode plumbing shared by the TRL environments (its methods are private: public ones are tools)."""

    env_id: ClassVar[str]

    def __init__(self, **env_kwargs: Any) -> None:
        self._env = gymnasium.make(self.env_id, **env_kwargs)
        self._finalizer = weakref.finalize(self, self._env.close)
        self._reward: float | None = None
        self._done = False
        self._info: dict[str, Any] = {}

    def reset(self, task: Any = None, **row: Any) -> str:
        """Start an episode of ``task`` (the row's column); the env's first observation, for the prompt."""
        unknown = sorted(set(row) - TRL_COLUMNS)
        if unknown:
            raise TypeError(f"{type(self).__name__}.reset takes the row's 'task' (and TRL's 'prompt'); "
                            f"unknown columns: {unknown}")
        obs, info = self._env.reset(options={"task": task} if task is not None else None)
        self._reward, self._done, self._info = None, False, dict(info)
        return obs

    def _step(self, name: str, arguments: dict[str, Any]) -> str:
        obs, reward, terminated, truncated, info = self._env.step({"name": name, "arguments": arguments})
        if self._done:  # a call after the end (TRL goes on while the model calls tools): told so, reward kept
            return obs
        self._info = dict(info)
        if terminated or truncated:
            self._done, self._reward = True, float(reward)
        return obs

    def _unfinished_reward(self) -> float:
        return 0.0

    def get_reward(self) -> float:
        """The rollout's reward from our grader (see the module docstring for a rollout that did not finish)."""
        if self._reward is None:
            self._reward = self._unfinished_reward()
        return self._reward

    def _close(self) -> None:
        self._finalizer()


class SWEEnvironment(_AgentenvEnvironment):
    """``agentenv/SWE-v0``: fix a repository in /testbed; graded like SWE-bench (1.0: resolved)."""

    env_id = "agentenv/SWE-v0"

    def bash(self, command: str, timeout: float | None = None) -> str:
        """Run a shell command in /testbed (no network); stdout and stderr together.

        Args:
            command: the shell command.
            timeout: seconds to let it run (the env's default and maximum apply).
        """
        return self._step("bash", {"command": command} | ({} if timeout is None else {"timeout": timeout}))

    def view(self, path: str, view_range: list[int] | None = None) -> str:
        """Show a file with line numbers, or list a folder.

        Args:
            path: an absolute path in the sandbox.
            view_range: the lines [start, end] to show (end -1: the last line).
        """
        return self._step("view", {"path": path} | ({} if view_range is None else {"view_range": view_range}))

    def str_replace(self, path: str, old_str: str, new_str: str) -> str:
        """Replace old_str, which must occur exactly once in the file, by new_str.

        Args:
            path: an absolute path in the sandbox.
            old_str: the text to replace.
            new_str: the text to put in its place.
        """
        return self._step("str_replace", {"path": path, "old_str": old_str, "new_str": new_str})

    def create(self, path: str, file_text: str) -> str:
        """Write a file with the given content (creating folders; an existing file is overwritten).

        Args:
            path: an absolute path in the sandbox.
            file_text: the file's content.
        """
        return self._step("create", {"path": path, "file_text": file_text})

    def submit(self) -> str:
        """Submit the current state of /testbed as the fix; the episode ends and is graded."""
        return self._step("submit", {})

    def _unfinished_reward(self) -> float:
        return float(self._env.unwrapped.grade().reward)  # type: ignore[attr-defined]  # SWEEnv.grade


class LookupEnvironment(_AgentenvEnvironment):
    """``agentenv/Lookup-v0``: find a code in the files of /data, then answer it (1.0: the right code)."""

    env_id = "agentenv/Lookup-v0"

    def bash(self, command: str) -> str:
        """Run a shell command in /data; stdout and stderr together.

        Args:
            command: the shell command.
        """
        return self._step("bash", {"command": command})

    def answer(self, answer: str) -> str:
        """Give the final answer; the episode ends.

        Args:
            answer: the code.
        """
        return self._step("answer", {"answer": answer})
