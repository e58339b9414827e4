"""inspect-ai's sandbox extension point backed by agentenv: ``sandbox="agentenv"`` in a Task runs each sample in
its own agentenv sandbox (an image, or a Dockerfile built locally), with ``exec``'s user, stdin, cwd, env and
timeout enforced, and fork/snapshot as extra methods.

inspect finds the provider through the ``inspect_ai`` entry point in pyproject.toml (this module registers it
with ``@sandboxenv`` on import). agentenv's calls block, so each runs in a worker thread (``anyio.to_thread``).
Configuration: None (agentenv's base image), a string (a Dockerfile's path when such a file exists, else an image
name), or ``AgentenvSandboxConfig``; its unknown keys are refused, never ignored.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import shlex
from functools import partial
from pathlib import Path
from typing import Any, Literal, overload

import anyio
from inspect_ai.util import (
    ExecResult,
    OutputLimitExceededError,
    SandboxEnvironment,
    SandboxEnvironmentConfigType,
    SandboxEnvironmentLimits,
    SandboxUnavailableError,
    SandboxUserUnsupportedError,
    concurrency,
    sandboxenv,
)
from pydantic import BaseModel, ConfigDict

import agentenv
from agentenv import ExecResult as AgentenvResult
from agentenv import Sandbox, Snapshot, errors
from agentenv.api import DEFAULT_DISK, DEFAULT_IMAGE, JobEnd, JobOutput
from agentenv.harness.fetch import HARNESS_TTL
from agentenv.host import images

RETRY_TIMEOUTS = (60, 30)  # inspect's timeout_retry: two more tries, capped at these many seconds
_build_locks: dict[str, anyio.Lock] = {}


class AgentenvSandboxConfig(BaseModel):
    """The sandbox of each sample: ``image`` (a local image) or ``dockerfile`` (built locally, never pulling; tagged
    ``image`` when both are given), and the limits ``Sandbox.create`` enforces."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    image: str | None = None
    dockerfile: str | None = None
    cpus: float = 1.0
    memory: str = "1g"
    pids: int = 512
    disk: str | None = DEFAULT_DISK
    network: bool = False
    env: dict[str, str] = {}
    workdir: str | None = None


def parse_config(config: SandboxEnvironmentConfigType | None) -> AgentenvSandboxConfig:
    """The config inspect hands over, as ``AgentenvSandboxConfig`` (ValueError for one this provider cannot run)."""
    if config is None:
        return AgentenvSandboxConfig()
    if isinstance(config, AgentenvSandboxConfig):
        return config
    if isinstance(config, str):
        if config.endswith((".yaml", ".yml")):
            raise ValueError(f"the agentenv sandbox does not run compose files ({config}): give a Dockerfile "
                             "or an image name")
        return AgentenvSandboxConfig(dockerfile=config) if Path(config).is_file() else AgentenvSandboxConfig(image=config)
    if isinstance(config, BaseModel):
        return AgentenvSandboxConfig(**config.model_dump())
    raise ValueError(f"the agentenv sandbox cannot use a config of type {type(config).__name__}")


def image_of(cfg: AgentenvSandboxConfig) -> str:
    """The image a sample's sandbox starts from: the Dockerfile's tag (its path and content hashed) or ``image``."""
    if cfg.dockerfile is None:
        return cfg.image or DEFAULT_IMAGE
    if cfg.image:
        return cfg.image
    path = Path(cfg.dockerfile).resolve()
    digest = hashlib.sha256(str(path).encode() + b"\0" + path.read_bytes()).hexdigest()[:16]
    return f"agentenv-inspect/{digest}:latest"


async def ensure_image(cfg: AgentenvSandboxConfig) -> str:
    """Build the config's Dockerfile (its folder the context) once per tag, or fetch a named image the host lacks
    (a dataset record's, by its dataset's rule: ``agentenv.ensure_image``); the image's name."""
    tag = image_of(cfg)
    if cfg.dockerfile is None:
        if not await anyio.to_thread.run_sync(images.present, tag):
            await anyio.to_thread.run_sync(agentenv.ensure_image, tag)
        return tag
    lock = _build_locks.setdefault(tag, anyio.Lock())
    async with lock:
        if not await anyio.to_thread.run_sync(images.present, tag):
            path = Path(cfg.dockerfile).resolve()
            if path.name != "Dockerfile":
                raise ValueError(f"agentenv builds a file named Dockerfile in its context folder, not {path.name}")
            await anyio.to_thread.run_sync(partial(images.build, str(path.parent), tag))
    return tag


@sandboxenv(name="agentenv")
class AgentenvSandboxEnvironment(SandboxEnvironment):
    """One sample's agentenv sandbox; relative paths and the default cwd are its working directory."""

    def __init__(self, sandbox: Sandbox, workdir: str) -> None:
        super().__init__()
        self.sandbox = sandbox
        self.workdir = workdir
        self.forks: list[AgentenvSandboxEnvironment] = []  # closed with this one, at sample cleanup

    # --- the lifecycle inspect drives -------------------------------------------------------------

    @classmethod
    def config_files(cls) -> list[str]:
        return ["Dockerfile"]

    @classmethod
    def config_deserialize(cls, config: dict[str, Any]) -> BaseModel:
        return AgentenvSandboxConfig(**config)

    @classmethod
    async def task_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None) -> None:
        await ensure_image(parse_config(config))

    @classmethod
    async def sample_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None,
                          metadata: dict[str, str]) -> dict[str, SandboxEnvironment]:
        cfg = parse_config(config)
        image = await ensure_image(cfg)
        workdir = cfg.workdir or (await anyio.to_thread.run_sync(images.resolve, image)).workdir or "/"
        sb = await anyio.to_thread.run_sync(partial(
            Sandbox.create, image, cpus=cfg.cpus, memory=cfg.memory, pids=cfg.pids, disk=cfg.disk,
            network=cfg.network, env=dict(cfg.env), workdir=workdir, labels={"inspect-task": task_name}, ttl=HARNESS_TTL))
        return {"default": cls(sb, workdir)}

    @classmethod
    async def sample_cleanup(cls, task_name: str, config: SandboxEnvironmentConfigType | None,
                             environments: dict[str, SandboxEnvironment], interrupted: bool) -> None:
        for env in environments.values():
            if isinstance(env, AgentenvSandboxEnvironment):
                await env.close()

    @classmethod
    async def task_cleanup(cls, task_name: str, config: SandboxEnvironmentConfigType | None, cleanup: bool) -> None:
        """Nothing outlives a sample but the built image, kept as Docker keeps its build cache."""

    async def close(self) -> None:
        """Close this sandbox and the forks made from it."""
        for env in [*self.forks, self]:
            await anyio.to_thread.run_sync(env.sandbox.close)
        self.forks.clear()

    # --- commands and files -----------------------------------------------------------------------

    def _calls(self, user: str | None) -> Any:
        """The sandbox's calls as ``user`` (a name or a uid of its image), or as its default user."""
        if user is None:
            return self.sandbox
        name = user
        if user.isdecimal():  # inspect allows a uid: the image's passwd names it
            passwd = self.sandbox.read_file("/etc/passwd").decode(errors="replace").splitlines()
            names = [row.split(":")[0] for row in passwd if row.count(":") >= 6 and row.split(":")[2] == user]
            if not names:
                raise SandboxUserUnsupportedError(f"the sandbox's image has no account with uid {user}")
            name = names[0]
        return self.sandbox.as_user(name)

    def _cwd(self, cwd: str | None) -> str:
        return self.workdir if cwd is None else posixpath.join(self.workdir, cwd)

    def _run(self, command: str, input: bytes | None, cwd: str, env: dict[str, str] | None, user: str | None,
             timeout: int | None) -> AgentenvResult:
        calls = self._calls(user)
        if input is None:
            return calls.exec(command, timeout=timeout, cwd=cwd, env=env)
        job = calls.start(command, cwd=cwd, env=env, timeout=timeout, stdin=True)
        calls.send_input(job.pid, input)
        calls.close_input(job.pid)
        out: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
        for item in calls.output(job.pid):
            if isinstance(item, JobOutput):
                out.setdefault(item.stream, bytearray()).extend(item.data)
            elif isinstance(item, JobEnd):
                return AgentenvResult(exit_code=item.exit_code, stdout=out["stdout"].decode(errors="replace"),
                                      stderr=out["stderr"].decode(errors="replace"), duration=item.duration,
                                      timed_out=item.timed_out)
        raise SandboxUnavailableError(f"job {job.pid} of sandbox {self.sandbox.id} ended without its exit status")

    async def _exec_once(self, command: str, input: bytes | None, cwd: str, env: dict[str, str] | None,
                         user: str | None, timeout: int | None) -> AgentenvResult:
        try:
            return await anyio.to_thread.run_sync(partial(self._run, command, input, cwd, env, user, timeout))
        except errors.UnknownUser as e:
            raise SandboxUserUnsupportedError(str(e)) from e
        except (errors.SandboxStateError, errors.SandboxNotFound, errors.ConnectionLost) as e:
            raise SandboxUnavailableError(str(e)) from e

    async def exec(self, cmd: list[str], input: str | bytes | None = None, cwd: str | None = None,
                   env: dict[str, str] | None = None, user: str | None = None, timeout: int | None = None,
                   timeout_retry: bool = True, concurrency: bool = True) -> ExecResult[str]:
        """``cmd`` (quoted for /bin/sh, so ``cmd[0]`` is found on the sandbox's PATH with ``env`` applied) as
        ``user``; TimeoutError past ``timeout`` (after inspect's two shorter retries when ``timeout_retry``)."""
        command = shlex.join(cmd)
        data = input.encode() if isinstance(input, str) else input
        tries = [timeout] + ([min(timeout, t) for t in RETRY_TIMEOUTS] if timeout and timeout_retry else [])
        for limit in tries:
            if concurrency:
                async with _throttle():
                    res = await self._exec_once(command, data, self._cwd(cwd), env, user, limit)
            else:
                res = await self._exec_once(command, data, self._cwd(cwd), env, user, limit)
            if not res.timed_out:
                break
        else:
            raise TimeoutError(f"{command!r} ran past its timeout of {tries[-1]} s")
        for stream in (res.stdout, res.stderr):
            if len(stream.encode(errors="replace")) > SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE:
                raise OutputLimitExceededError(SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE_STR,
                                               stream[-SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE:])
        return ExecResult(success=res.exit_code == 0, returncode=res.exit_code, stdout=res.stdout,
                          stderr=res.stderr)

    async def write_file(self, file: str, contents: str | bytes) -> None:
        await anyio.to_thread.run_sync(self.sandbox.write_file, self._cwd(file), contents)

    @overload
    async def read_file(self, file: str, text: Literal[True] = True) -> str: ...

    @overload
    async def read_file(self, file: str, text: Literal[False]) -> bytes: ...

    async def read_file(self, file: str, text: bool = True) -> str | bytes:
        """The file's bytes, or its UTF-8 text with its newlines as they are; OutputLimitExceededError (before
        reading) for one over inspect's read limit."""
        path = self._cwd(file)
        info = await anyio.to_thread.run_sync(partial(self.sandbox.stat, path, resolve_links=True))
        if info.type == "dir":
            raise IsADirectoryError(f"{path} is a directory")
        if info.size > SandboxEnvironmentLimits.MAX_READ_FILE_SIZE:
            raise OutputLimitExceededError(SandboxEnvironmentLimits.MAX_READ_FILE_SIZE_STR, None)
        data: bytes = await anyio.to_thread.run_sync(self.sandbox.read_file, path)
        return data.decode("utf-8") if text else data

    # --- agentenv's extras: branch a sample's state -----------------------------------------------

    async def fork(self, n: int = 1) -> list[AgentenvSandboxEnvironment]:
        """``n`` copies of this sandbox as it is now (memory included); closed with it at sample cleanup."""
        children = await anyio.to_thread.run_sync(partial(self.sandbox.fork, n))
        envs = [AgentenvSandboxEnvironment(c, self.workdir) for c in children]
        self.forks.extend(envs)
        return envs

    async def snapshot(self, memory: bool = False) -> Snapshot:
        """A snapshot of this sandbox (its files; its processes too with ``memory``), for ``Sandbox.restore``."""
        return await anyio.to_thread.run_sync(partial(self.sandbox.snapshot, memory))


def _throttle() -> Any:
    """inspect's ``concurrency()`` for local sandboxes: at most twice the host's processors run commands at once."""
    return concurrency("agentenv-exec", 2 * (os.cpu_count() or 1), visible=False)
