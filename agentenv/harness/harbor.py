"""harbor's environment extension point backed by agentenv: ``--env agentenv.harness.harbor:AgentenvEnvironment``
(harbor loads an environment class by import path) runs each trial's task in an agentenv sandbox, its image built
locally from the task's ``environment/Dockerfile`` (never pulled) or named by ``docker_image``.

harbor needs Python >= 3.12, so this module runs in the interpreter ``scripts/python3.13.sh`` builds, with agentenv
installed there too. What a task asks for is enforced or refused at construction (harbor's own validators read
``capabilities``): cpus, memory and storage become the sandbox's limits; no-network, allowlist and public network
policies agentenv's outbound rules, changeable after start; users (a name or a uid of the image) ``as_user``.
GPUs, TPUs, compose files, host mounts, Windows and stream (SSH) mode are refused. agentenv's calls block, so
each runs in a worker thread.
"""

from __future__ import annotations

import codecs
import logging
import os
import posixpath
import stat
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import EnvironmentCapabilities, EnvironmentResourceCapabilities
from harbor.environments.definition import (
    effective_exec_cwd,
    parse_dockerfile_workdir,
    require_agent_environment_definition,
)
from harbor.models.task.config import NetworkMode, NetworkPolicy

import agentenv
from agentenv import Sandbox, errors
from agentenv.api import DEFAULT_DISK
from agentenv.harness.fetch import create_sandbox
from agentenv.host import images

log = logging.getLogger(__name__)
COMPOSE_FILES = ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml")


def network_of(policy: NetworkPolicy) -> bool | dict[str, list[str]]:
    """A harbor network policy as ``Sandbox.create(network=...)``: False (loopback only), True, or an allowlist."""
    if policy.network_mode == NetworkMode.NO_NETWORK:
        return False
    if policy.network_mode == NetworkMode.PUBLIC:
        return True
    return {"allow_out": list(policy.allowed_hosts), "deny_out": ["0.0.0.0/0"]}


class AgentenvEnvironment(BaseEnvironment):
    """One trial's environment: a single agentenv sandbox (the task's main service)."""

    def __init__(self, environment_dir: Path, environment_name: str, session_id: str, trial_paths: Any,
                 task_env_config: Any, *args: Any, **kwargs: Any) -> None:
        self._sandbox: Sandbox | None = None
        super().__init__(environment_dir, environment_name, session_id, trial_paths, task_env_config, *args,
                         **kwargs)
        self._dockerfile_workdir = parse_dockerfile_workdir(self.environment_dir / "Dockerfile")

    @staticmethod
    def type() -> str:
        return "agentenv"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(disable_internet=True, network_allowlist=True,
                                       network_allowlist_hostnames=True, network_allowlist_ipv4_addresses=True,
                                       network_allowlist_ipv4_cidrs=True, dynamic_network_policy=True)

    @classmethod
    def resource_capabilities(cls) -> EnvironmentResourceCapabilities:
        return EnvironmentResourceCapabilities(cpu_limit=True, memory_limit=True, fractional_cpus=True)

    def _validate_definition(self) -> None:
        found = [n for n in COMPOSE_FILES if (self.environment_dir / n).exists()]
        if found or self.extra_docker_compose_paths:
            raise ValueError(f"the agentenv environment runs one container per trial, not compose files "
                             f"({found or self.extra_docker_compose_paths})")
        require_agent_environment_definition(self.environment_dir, docker_image=self.task_env_config.docker_image)

    # --- lifecycle --------------------------------------------------------------------------------

    @property
    def sandbox(self) -> Sandbox:
        if self._sandbox is None:
            raise RuntimeError("the agentenv sandbox is not started: call start() first")
        return self._sandbox

    def _image(self, force_build: bool) -> str:
        """The task's image: ``docker_image``, or its Dockerfile built locally (once per environment_id)."""
        if self.task_env_config.docker_image:
            return str(self.task_env_config.docker_image)
        name = "".join(c if c.isalnum() or c in "-_." else "-" for c in self.environment_name.lower())
        tag = f"agentenv-harbor/{name}:{self.environment_id[:16]}"
        if force_build or not images.present(tag):
            images.build(str(self.environment_dir), tag, nocache=force_build,
                         on_output=lambda line: self.logger.debug(line))
        return tag

    def _create(self, force_build: bool) -> Sandbox:  # docker_image: fetched when the host lacks it
        image = self._image(force_build)
        cpus, memory, storage = self._effective_cpus, self._effective_memory_mb, self._effective_storage_mb
        workdir = self.task_env_config.workdir or self._dockerfile_workdir
        sb = create_sandbox(agentenv, image, cpus=float(cpus or 1), memory=f"{memory}m" if memory else "1g",
                            disk=f"{storage}m" if storage else DEFAULT_DISK, network=self._startup_network(),
                            env=self._startup_env(), workdir=workdir, labels={"harbor-session": self.session_id})
        assert isinstance(sb, Sandbox)  # this host's, as agentenv's own module makes
        return sb

    def _startup_network(self) -> bool | dict[str, list[str]]:
        """The startup policy's network; a no-network start whose later phases need one gets a network with
        everything denied, so that ``set_network_policy`` can open it."""
        net = network_of(self.network_policy)
        later = [network_of(p) for p in self._phase_network_policies]
        if net is False and any(n is not False for n in later):
            return {"allow_out": [], "deny_out": ["0.0.0.0/0"]}
        return net

    async def start(self, force_build: bool) -> None:
        self._sandbox = await anyio.to_thread.run_sync(self._create, force_build)
        await self.ensure_dirs(self._mount_targets(writable_only=True))
        await self._upload_environment_dir_after_start()

    async def stop(self, delete: bool) -> None:
        """Close the sandbox; with ``delete=False`` (harbor's --no-delete) it is kept running, its id logged."""
        if self._sandbox is None:
            return
        if not delete:
            self.logger.info(f"keeping agentenv sandbox {self._sandbox.id} (delete=False)")
        else:
            await anyio.to_thread.run_sync(self._sandbox.close)
        self._sandbox = None

    async def _apply_network_policy(self, network_policy: NetworkPolicy) -> None:
        """A later phase's policy as the sandbox's outbound rules (no-network: everything denied)."""
        def apply() -> None:
            has_net = self.sandbox.info().network is not None
            net = network_of(network_policy)
            if net is False:
                if has_net:
                    self.sandbox.update_network(deny_out=["0.0.0.0/0"])
                return
            if not has_net:
                raise RuntimeError("this agentenv sandbox was started without a network; one cannot be added")
            self.sandbox.update_network(**({} if net is True else net))
        await anyio.to_thread.run_sync(apply)

    # --- commands -------------------------------------------------------------------------------

    def _calls(self, user: str | int | None) -> Any:
        """The sandbox's calls as ``user`` (a name or a uid of its image; None: the image's default)."""
        if user is None:
            return self.sandbox
        name = str(user)
        if name.isdecimal():
            rows = self.sandbox.read_file("/etc/passwd").decode(errors="replace").splitlines()
            names = [r.split(":")[0] for r in rows if r.count(":") >= 6 and r.split(":")[2] == name]
            if not names:
                raise errors.UnknownUser(f"the sandbox's image has no account with uid {name}")
            name = names[0]
        return self.sandbox.as_user(name)

    async def exec(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout_sec: int | None = None, user: str | int | None = None) -> ExecResult:
        """``command`` with /bin/sh (as harbor's Docker environment runs it); RuntimeError past ``timeout_sec``."""
        who = self._resolve_user(user)
        merged = self._merge_env(env)
        where = effective_exec_cwd(cwd, self.task_env_config.workdir, self._dockerfile_workdir)
        emit = self._output_callback()
        decoders = {s: codecs.getincrementaldecoder("utf-8")(errors="replace") for s in ("stdout", "stderr")}

        def on_output(stream: str, data: bytes) -> None:
            if emit is not None:
                anyio.from_thread.run(emit, decoders[stream].decode(data), stream)

        def run() -> Any:
            return self._calls(who).exec(command, timeout=timeout_sec or None, cwd=where, env=merged,
                                         on_output=on_output if emit is not None else None)

        res = await anyio.to_thread.run_sync(run)
        if res.timed_out:
            raise RuntimeError(f"Command timed out after {timeout_sec} seconds")
        return ExecResult(stdout=res.stdout, stderr=res.stderr, return_code=res.exit_code)

    async def is_dir(self, path: str, user: str | int | None = None) -> bool:
        return await self._kind(path, user) == "dir"

    async def is_file(self, path: str, user: str | int | None = None) -> bool:
        return await self._kind(path, user) == "file"

    async def _kind(self, path: str, user: str | int | None) -> str | None:
        def look() -> str | None:
            try:
                return str(self._calls(self._resolve_user(user)).stat(path, resolve_links=True).type)
            except FileNotFoundError:
                return None
        return await anyio.to_thread.run_sync(look)

    # --- files (as root: harbor's transfers are the orchestrator's, not the agent's) --------------

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        src = Path(source_path)
        await anyio.to_thread.run_sync(partial(self.sandbox.write_file, target_path, src.read_bytes(),
                                               stat.S_IMODE(src.stat().st_mode)))

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        root = Path(source_dir)

        def copy() -> None:
            self.sandbox.make_dir(target_dir)
            for dirpath, dirnames, filenames in os.walk(root):
                rel = Path(dirpath).relative_to(root).as_posix()
                for d in dirnames:
                    self.sandbox.make_dir(posixpath.normpath(posixpath.join(target_dir, rel, d)))
                for f in filenames:
                    p = Path(dirpath) / f
                    self.sandbox.write_file(posixpath.normpath(posixpath.join(target_dir, rel, f)),
                                            p.read_bytes(), stat.S_IMODE(p.stat().st_mode))
        await anyio.to_thread.run_sync(copy)

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        data = await anyio.to_thread.run_sync(self.sandbox.read_file, source_path)
        Path(target_path).parent.mkdir(parents=True, exist_ok=True)
        Path(target_path).write_bytes(data)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        """Every file under ``source_dir`` (symlinks not followed), overwriting what ``target_dir`` has."""
        def copy() -> None:
            target = Path(target_dir)
            target.mkdir(parents=True, exist_ok=True)
            base = self.sandbox.stat(source_dir, resolve_links=True).path
            for info in self.sandbox.list_dir(base, depth=64):
                rel = posixpath.relpath(info.path, base)
                if rel.startswith("..") or posixpath.isabs(rel):
                    continue
                dest = target / rel
                if info.type == "dir":
                    dest.mkdir(parents=True, exist_ok=True)
                elif info.symlink_target is None:
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.write_bytes(self.sandbox.read_file(info.path))
        await anyio.to_thread.run_sync(copy)
