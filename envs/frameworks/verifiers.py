"""agentenv for verifiers (``verifiers.v1``): agentenv sandboxes as a ``vf.Runtime``, and SWE-v0 / Lookup-v0 as
verifiers tasksets whose rewards are our grader's.

``AgentenvRuntime(AgentenvConfig(image=..., cpus=..., memory=...))`` is a v1 runtime on an agentenv sandbox:
``start()`` creates it, ``run(argv, env)`` runs the argv (quoted, no shell of ours in between) with the task's
and the call's environment, ``read`` / ``write`` move files (``read``'s ``max_bytes`` cap is verifiers' own, on
top of our ``_read``), ``with_user(name)`` runs commands as an account of the image (agentenv's ``as_user``),
``stop()`` closes the sandbox. verifiers picks its own runtimes from a closed set of configs, so this one goes in
by hand where verifiers takes a live runtime (``Agent.run(runtime=...)``, a borrowed box). Live processes and
background servers (``open_process``, ``run_background``) and verifiers' network policies are not offered:
the first raise verifiers' own NotImplementedError; a task that asks for a network rule (``network_allow`` other
than ``*``, or ``network_block``) or for resources (``resources``: the env sets its own) is refused at setup
rather than run without them.

``SWETaskset`` / ``LookupTaskset`` yield ``AgentenvTask`` s: the prompt is the issue (or the question); a task's
``setup(trace, runtime)`` starts the agentenv env's episode (``gymnasium.make(env_id).reset``: for SWE-v0 the task
image with /testbed at its base commit and the pristine snapshot grading restores; for Lookup-v0 the files) and
hands its sandbox to the runtime, so the agent works in the env's own box. The ``@vf.reward`` is the env's: SWE-v0
grades /testbed in a fresh sandbox (1.0 resolved), Lookup-v0 checks the answer (the file ``ANSWER_PATH`` if the
agent wrote one, else its last reply) against the code the env generated (1.0 right).
"""

from __future__ import annotations

import asyncio
import shlex
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, Literal

import gymnasium
import verifiers.v1 as vf
from verifiers.v1.utils.score import read_answer_file_or_last_reply

import agentenv
import agentenv.errors
import envs  # noqa: F401  (registers the Gymnasium ids)
from agentenv.api import DEFAULT_IMAGE, SandboxLike
from envs.lookup_env import resolve as resolve_lookup
from envs.task import resolve_task

ANSWER_PATH = "/tmp/answer"  # where a Lookup-v0 agent may leave its answer (else its last reply is read)


class AgentenvConfig(vf.BaseConfig):
    """The sandbox an ``AgentenvRuntime`` starts (``agentenv.Sandbox.create``'s settings)."""

    type: Literal["agentenv"] = "agentenv"
    image: str = DEFAULT_IMAGE
    cpus: float = 1.0
    memory: str = "1g"
    workdir: str | None = None


class AgentenvRuntimeInfo(AgentenvConfig, vf.runtimes.BaseRuntimeInfo):
    """What a trace records of the box: the config and the sandbox id."""


class AgentenvRuntime(vf.Runtime):
    """A verifiers runtime on one agentenv sandbox (see the module docstring)."""

    supports_user: ClassVar[bool] = True

    def __init__(self, config: AgentenvConfig | None = None, name: str | None = None) -> None:
        super().__init__(name)
        self.config = config or AgentenvConfig()
        self.info = AgentenvRuntimeInfo(**self.config.model_dump())
        self.sandbox: SandboxLike | None = None
        self.episode: Any = None  # the agentenv env whose sandbox this is (``adopt``), closed with it

    async def start(self) -> None:
        if self.sandbox is None:
            sandbox = await asyncio.to_thread(agentenv.Sandbox.create, self.config.image, cpus=self.config.cpus,
                                              memory=self.config.memory, workdir=self.config.workdir)
            self.sandbox, self.info.id = sandbox, sandbox.id

    def adopt(self, sandbox: SandboxLike, episode: Any) -> None:
        """Work in ``sandbox`` (an env's episode, closed with this runtime) instead of the one ``start`` made."""
        old, self.sandbox, self.episode = self.sandbox, sandbox, episode
        self.info.id = sandbox.id
        if old is not None and old is not sandbox:
            old.close()

    def _box(self) -> Any:
        if self.sandbox is None:
            raise vf.SandboxError("the agentenv runtime is not started")
        return self.sandbox.as_user(self.user) if self.user is not None else self.sandbox  # type: ignore[attr-defined]

    async def run(self, argv: list[str], env: dict[str, str]) -> vf.ProgramResult:
        box = self._box()
        cwd = self.config.workdir or (self.home if self.user is not None else None)  # the user's HOME, as given
        r = await asyncio.to_thread(box.exec, shlex.join(argv), env=self.process_env(env), timeout=None, cwd=cwd)
        return vf.ProgramResult(exit_code=r.exit_code, stdout=r.stdout, stderr=r.stderr)

    async def _read(self, path: str, max_bytes: int | None = None) -> bytes:
        if max_bytes is not None:  # capped in the box by verifiers' own reader
            return await super()._read(path, max_bytes)
        try:
            return await asyncio.to_thread(self._box().read_file, path)
        except agentenv.errors.AgentEnvError as e:
            raise vf.SandboxError(f"read {path!r}: {e}") from e

    async def write(self, path: str, data: bytes) -> None:
        await asyncio.to_thread(self._box().write_file, path, data)

    def cleanup(self) -> None:
        sandbox, episode, self.sandbox, self.episode = self.sandbox, self.episode, None, None
        if episode is not None:
            episode.close()  # closes the sandbox too
        elif sandbox is not None:
            sandbox.close()


class AgentenvTaskData(vf.TaskData):
    """A verifiers task row: ``task`` is the agentenv task (an id, or a record)."""

    task: str | dict[str, Any]


class AgentenvTask(vf.Task[AgentenvTaskData, vf.State, vf.TaskConfig]):
    """One agentenv task; ``setup`` starts its env's episode in the runtime (see the module docstring)."""

    NEEDS_CONTAINER = True
    env_id: ClassVar[str]

    async def setup(self, trace: vf.Trace, runtime: vf.Runtime) -> None:
        if not isinstance(runtime, AgentenvRuntime):
            raise vf.TaskError(f"{type(self).__name__} runs in an AgentenvRuntime, not {type(runtime).__name__}")
        if self.data.network_allow != ["*"] or self.data.network_block:
            raise vf.TaskError("network_allow / network_block are not supported by the agentenv adapter")
        if any(v is not None for v in self.data.resources.model_dump().values()):
            raise vf.TaskError("task resources are not supported by the agentenv adapter: the env sets its own")
        env = gymnasium.make(self.env_id)
        try:
            obs, _ = await asyncio.to_thread(env.reset, options={"task": self.data.task})
            sandbox = await asyncio.to_thread(env.unwrapped.box)  # type: ignore[attr-defined]
        except BaseException:
            env.close()
            raise
        runtime.adopt(sandbox, env)
        trace.info["observation"] = obs


class SWETask(AgentenvTask):
    env_id = "agentenv/SWE-v0"

    @vf.reward
    async def resolved(self, runtime: vf.Runtime) -> float:
        """Our grader on /testbed (SWE-bench rules, in a fresh sandbox at the task's pristine state)."""
        env = _episode(runtime)
        return float((await asyncio.to_thread(env.unwrapped.grade)).reward)


class LookupTask(AgentenvTask):
    env_id = "agentenv/Lookup-v0"

    @vf.reward
    async def correct(self, trace: vf.Trace, runtime: vf.Runtime) -> float:
        """1.0 when the agent's answer is the code the env generated."""
        answer = await read_answer_file_or_last_reply(runtime, ANSWER_PATH, trace)
        env = _episode(runtime)
        _, reward, *_ = await asyncio.to_thread(env.step, {"name": "answer", "arguments": {"answer": answer}})
        return float(reward)


def _episode(runtime: vf.Runtime) -> Any:
    episode = getattr(runtime, "episode", None)
    if episode is None:
        raise vf.TaskError("no agentenv episode in this runtime: the task's setup did not run in it")
    return episode


class SWETaskset(vf.Taskset[SWETask, vf.TasksetConfig]):
    """SWE-v0 tasks (ids, records or ``Task`` s as ``envs.task.resolve_task`` takes them)."""

    def __init__(self, tasks: Sequence[Any], config: vf.TasksetConfig | None = None) -> None:
        super().__init__(config or vf.TasksetConfig())
        self.tasks = [resolve_task(t) for t in tasks]

    def load(self) -> Iterable[SWETask]:
        for t in self.tasks:
            data = AgentenvTaskData(id=t.instance_id, task=t.instance_id, prompt=t.problem_statement.strip(),
                                    image=t.image, workdir="/testbed")
            yield SWETask(data, self.config.task)


class LookupTaskset(vf.Taskset[LookupTask, vf.TasksetConfig]):
    """Lookup-v0 tasks (ids such as ``lookup-1-1000001``, see ``envs.lookup_env.task_ids``)."""

    def __init__(self, ids: Sequence[str], config: vf.TasksetConfig | None = None) -> None:
        super().__init__(config or vf.TasksetConfig())
        self.tasks = [resolve_lookup(i) for i in ids]

    def load(self) -> Iterable[LookupTask]:
        for t in self.tasks:
            yield LookupTask(AgentenvTaskData(id=t.id, task=t.id, prompt=t.question, workdir="/data"),
                             self.config.task)
