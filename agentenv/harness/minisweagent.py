"""mini-swe-agent's ``Environment`` over an agentenv sandbox, with ``fork()`` and ``snapshot()`` for search.

mini-swe-agent (``pip install -e '.[minisweagent]'``) loads an environment by dotted path::

    environment:
      environment_class: agentenv.harness.minisweagent.AgentenvEnvironment
      image: agentenv/base
      cwd: /testbed

Each ``execute(action, cwd, timeout=...)`` runs ``action["command"]`` in the sandbox, as mini-swe-agent's own
``DockerEnvironment`` does in a container: through ``interpreter`` (``bash -lc``), stderr merged into stdout, and
the same result dict, ``{"output", "returncode", "exception_info"}``. A command past its timeout is killed with its
whole process group (agentenv's exec) and reported as mini-swe-agent reports one: ``returncode`` -1, the output
so far, ``exception_info`` naming ``subprocess.TimeoutExpired`` and ``extra.exception_type``. An output whose
first line is ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` (and exit status 0) raises ``Submitted``, mini-swe-agent's
convention. The submission is what the agent printed; a grader should read the sandbox instead (``envs``'
grading extracts the patch from it and tests it elsewhere).

Beyond the protocol: ``fork(n)`` gives ``n`` environments on copies of the sandbox (processes and files),
``snapshot()`` a snapshot a later ``AgentenvEnvironment(snapshot=...)`` starts from: a search branches the agent's
state there. Whatever the config asks for is enforced (``user``: the image's account runs every command;
``cpus``, ``memory``, ``pids``, ``network``: the sandbox's limits) or refused with a clear error.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import subprocess
from collections.abc import Sequence
from typing import Any

from minisweagent.exceptions import Submitted
from minisweagent.utils.serialize import recursive_merge
from pydantic import BaseModel, ConfigDict

import agentenv
from agentenv.api import DEFAULT_IMAGE, Backend, SandboxLike, SnapshotLike
from agentenv.harness.fetch import HARNESS_TTL, create_sandbox

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
SANDBOX_FIELDS = ("image", "cpus", "memory", "pids", "network", "sandbox_ttl")  # what making a sandbox takes
UNAME_FIELDS = ("system", "node", "release", "version", "machine")  # platform.uname()'s, as mini's templates use


class AgentenvEnvironmentConfig(BaseModel):
    """What the ``environment:`` section may set; an unknown key is an error, not ignored."""

    model_config = ConfigDict(extra="forbid")

    image: str = DEFAULT_IMAGE
    cwd: str = "/"
    """Working directory of every command (an ``execute`` call's ``cwd`` wins)."""
    env: dict[str, str] = {}
    forward_env: list[str] = []
    """Host variables passed to every command when set on the host (``env`` wins on a clash)."""
    timeout: int = 30
    """Seconds a command may run (an ``execute`` call's ``timeout`` wins); past it, its process group is killed."""
    interpreter: list[str] = ["bash", "-lc"]
    user: str | None = None
    """An account of the image that runs every command (None: the image's default, root)."""
    cpus: float = 1.0
    memory: str | int = "1g"
    """Bytes, or a size such as '2g'."""
    pids: int = 512
    network: bool = False
    """False: loopback only."""
    sandbox_ttl: float | None = HARNESS_TTL
    """Seconds until agentenv closes the sandbox (and each fork) on its own (None: until ``cleanup``)."""


class AgentenvEnvironment:
    """mini-swe-agent's Environment protocol on one agentenv sandbox.

    ``sandbox``: run in this (already started) sandbox instead of creating one; the caller keeps it (``cleanup``
    leaves it open). ``snapshot``: start from a snapshot (``snapshot()``'s, or its id). ``api``: where sandboxes
    live (this host by default; ``agentenv.connect(url, token)`` for a server).
    """

    def __init__(self, *, config_class: type = AgentenvEnvironmentConfig, logger: logging.Logger | None = None,
                 sandbox: SandboxLike | None = None, snapshot: SnapshotLike | str | None = None,
                 api: Backend | None = None, **kwargs: Any) -> None:
        self.logger = logger or logging.getLogger("minisweagent.environment")
        self.config = config_class(**kwargs)
        self.api: Backend = api if api is not None else agentenv
        if sandbox is not None and snapshot is not None:
            raise ValueError("give sandbox= or snapshot=, not both")
        self._owned = sandbox is None
        if sandbox is not None or snapshot is not None:
            given = sorted(self.config.model_fields_set & set(SANDBOX_FIELDS))
            if given:  # a running sandbox or a snapshot has these already: never accepted and ignored
                raise ValueError(f"{', '.join(given)}: set when a sandbox is created; a sandbox given as sandbox= or "
                                 "restored from snapshot= keeps its own (they are read back into the config)")
            self.sandbox = sandbox if sandbox is not None else self.api.Sandbox.restore(
                snapshot, ttl=HARNESS_TTL)  # type: ignore[arg-type]
            limits = self.sandbox.limits
            self.config = self.config.model_copy(update={
                "image": self.sandbox.image, "cpus": limits.cpus, "memory": limits.memory, "pids": limits.pids,
                "network": self.sandbox.network is not None, "sandbox_ttl": None})
        else:
            self.sandbox = create_sandbox(  # the record's image, fetched when the host lacks it
                self.api, self.config.image, cpus=self.config.cpus, memory=self.config.memory, pids=self.config.pids,
                network=self.config.network, ttl=self.config.sandbox_ttl)
        self._runner: Any = self._as_user(self.sandbox)
        self._uname: dict[str, str] | None = None

    def _as_user(self, sandbox: SandboxLike) -> Any:
        if self.config.user is None:
            return sandbox
        as_user = getattr(sandbox, "as_user", None)
        if as_user is None:
            raise NotImplementedError(f"user={self.config.user!r}: this backend's sandboxes ({type(sandbox).__name__}) "
                                      "cannot run commands as another account; use a local sandbox or drop user=")
        return as_user(self.config.user)

    # --- the protocol ----------------------------------------------------------------------------

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        """Run ``action["command"]`` in the sandbox; the result dict of mini-swe-agent's own environments."""
        command = action.get("command", "")
        cwd = cwd or self.config.cwd
        limit = timeout or self.config.timeout
        env = {k: v for k in self.config.forward_env if (v := os.getenv(k)) is not None} | self.config.env
        line = f"{shlex.join([*self.config.interpreter, command])} 2>&1"
        try:
            r = self._runner.exec(line, timeout=limit, cwd=cwd, env=env)
            if r.timed_out:  # killed with its process group; reported as subprocess reports it to mini
                raise subprocess.TimeoutExpired(command, limit, output=r.stdout)
            output: dict[str, Any] = {"output": r.stdout + r.stderr, "returncode": r.exit_code, "exception_info": ""}
        except Exception as e:
            raw = getattr(e, "output", None)
            raw = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else (raw or "")
            output = {"output": raw, "returncode": -1,
                      "exception_info": f"An error occurred while executing the command: {e}",
                      "extra": {"exception_type": type(e).__name__, "exception": str(e)}}
        self._check_finished(output)
        return output

    def _check_finished(self, output: dict[str, Any]) -> None:
        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_MARKER and output["returncode"] == 0:
            submission = "".join(lines[1:])
            raise Submitted({"role": "exit", "content": submission,
                             "extra": {"exit_status": "Submitted", "submission": submission}})

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        """The config, the sandbox's ``uname`` (``system``, ``release``, ... as mini's templates use) and ``kwargs``."""
        return recursive_merge(self.config.model_dump(), self.uname(), {"sandbox_id": self.sandbox.id}, kwargs)

    def serialize(self) -> dict[str, Any]:
        return {"info": {"config": {
            "environment": self.config.model_dump(mode="json") | {"sandbox_id": self.sandbox.id},
            "environment_type": f"{self.__class__.__module__}.{self.__class__.__name__}"}}}

    # --- beyond the protocol: search, and the end ---------------------------------------------------

    def uname(self) -> dict[str, str]:
        """The sandbox's ``uname`` fields (asked once)."""
        if self._uname is None:
            r = self.sandbox.exec("uname -s; uname -n; uname -r; uname -v; uname -m", timeout=30)
            values = r.stdout.splitlines() if r.exit_code == 0 else []
            self._uname = dict(zip(UNAME_FIELDS, [*values, *[""] * len(UNAME_FIELDS)], strict=False))
        return self._uname

    def fork(self, n: int = 1, *, memory: bool = True) -> list[AgentenvEnvironment]:
        """``n`` environments, each on its own copy of this sandbox (its files, and with ``memory`` its running
        processes); each owns its copy (``cleanup`` closes it). This environment goes on unchanged."""
        copies: Sequence[SandboxLike] = self.sandbox.fork(n, memory=memory, ttl=self.config.sandbox_ttl)
        out = []
        for sb in copies:
            child = AgentenvEnvironment(config_class=type(self.config), logger=self.logger, sandbox=sb, api=self.api,
                                        **self.config.model_dump(exclude=set(SANDBOX_FIELDS)))
            child._owned = True
            out.append(child)
        return out

    def snapshot(self, memory: bool = False, *, labels: dict[str, str] | None = None) -> SnapshotLike:
        """A snapshot of the sandbox (files; with ``memory`` its processes too) for ``AgentenvEnvironment(snapshot=)``;
        the caller deletes it (``.delete()``)."""
        return self.sandbox.snapshot(memory, labels=labels)

    def cleanup(self) -> None:
        """Close the sandbox if this environment made it (one passed in as ``sandbox=`` stays open)."""
        sandbox = getattr(self, "sandbox", None)  # None when __init__ failed before it had one
        if getattr(self, "_owned", False) and sandbox is not None and sandbox.state not in ("closed", "lost"):
            sandbox.close()

    def __del__(self) -> None:
        """mini-swe-agent's runners (``mini-extra swebench``, ...) never call ``cleanup``: they drop the environment,
        and its own environments close their container here. So does this one, its sandbox."""
        with contextlib.suppress(Exception):
            self.cleanup()

    def __enter__(self) -> AgentenvEnvironment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
