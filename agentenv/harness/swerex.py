"""SWE-ReX's deployment and runtime over an agentenv sandbox: what SWE-agent runs its agent's commands through.

``AgentenvDeployment(image=...)`` is a SWE-ReX ``AbstractDeployment``: ``start()`` creates a sandbox, ``runtime``
is an ``AgentenvRuntime`` (an ``AbstractRuntime``) on it, ``stop()`` closes both. SWE-agent takes it as
``SWEEnv(deployment=AgentenvDeployment(...), ...)``.

Sessions. ``create_session`` starts one long-lived ``bash`` in the sandbox per session name, as an agentenv job with
stdin; ``run_in_session`` writes the command to its stdin, so ``cd``, ``export``, shell variables and functions
persist across calls, as in SWE-ReX's own pexpect sessions. The command runs in the shell itself, its stdin
``/dev/null`` (so it cannot read the lines that follow it) and its stderr merged into stdout. After it the shell
prints a fresh random marker (``secrets.token_hex``) on stdout, and the marker with ``$?`` on stderr: the job's
stderr, which no command output reaches (it is redirected to stdout for the command). A call ends when both have
come; its output is the stdout before the marker, the exit code is the one on stderr. Output that happens to
contain a marker (of this call or an old one) neither ends the call nor sets its exit code, and the next call
starts reading after this call's marker, so nothing carries over.

Syntax is checked first (``bash -n`` in the sandbox: ``BashIncorrectSyntaxError``, as SWE-ReX). Past the action's
``timeout`` the command's processes are killed, the shell (with its state) goes on, and ``CommandTimeoutError`` is
raised, SWE-ReX's error; a command that loops in the shell itself (a builtin ``while`` loop) leaves no process to
kill: the session is then ended too, and a later call on it raises ``SessionDoesNotExistError``. Between calls
nothing of a call runs any more, so SWE-agent's ``BashInterruptAction`` after a timeout has nothing left to stop and
answers at once. ``check`` is honoured (``raise``: ``NonZeroExitCodeError``); interactive actions
(``is_interactive_command``, ``expect``) need a terminal this adapter does not emulate and are refused with
``NotImplementedError``, never run half-way.

Beyond SWE-ReX: ``deployment.fork(n)`` and ``deployment.snapshot()`` branch the sandbox (its files and processes);
a fork's runtime starts with no sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import posixpath
import secrets
import shlex
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from swerex.deployment.abstract import AbstractDeployment
from swerex.deployment.hooks.abstract import CombinedDeploymentHook, DeploymentHook
from swerex.exceptions import (
    BashIncorrectSyntaxError,
    CommandTimeoutError,
    DeploymentNotStartedError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
)
from swerex.runtime.abstract import (
    AbstractRuntime,
    Action,
    BashInterruptAction,
    BashObservation,
    CloseBashSessionResponse,
    CloseResponse,
    CloseSessionRequest,
    CloseSessionResponse,
    Command,
    CommandResponse,
    CreateBashSessionRequest,
    CreateBashSessionResponse,
    CreateSessionRequest,
    CreateSessionResponse,
    IsAliveResponse,
    Observation,
    ReadFileRequest,
    ReadFileResponse,
    UploadRequest,
    UploadResponse,
    WriteFileRequest,
    WriteFileResponse,
)

import agentenv
from agentenv.api import DEFAULT_IMAGE, Backend, JobEnd, JobOutput, SandboxLike, SnapshotLike
from agentenv.harness.fetch import HARNESS_TTL, create_sandbox

_T = TypeVar("_T")
KILL_GRACE = 5.0  # seconds a timed-out command's shell has to print its marker once its processes are killed


async def _thread(fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """Sandbox calls block: run them off the event loop SWE-ReX's callers run on."""
    return await asyncio.to_thread(fn, *args, **kwargs)


class _Shell:
    """One persistent bash in the sandbox (an agentenv job with stdin) and a thread that reads its two streams."""

    def __init__(self, sandbox: SandboxLike, name: str) -> None:
        self.sandbox, self.name = sandbox, name
        self.job = sandbox.start("exec bash --norc --noprofile", stdin=True, tag=f"swerex-session-{name}")
        self.out, self.err = bytearray(), bytearray()  # what has come and no call has taken yet
        self.read_to = [0, 0]  # absolute offsets (stdout, stderr) read so far: the agent may drop what lies below
        self.ended: JobEnd | None = None
        self.cond = threading.Condition()
        self.reading = sandbox.output(self.job.pid)
        self.reader = threading.Thread(target=self._read, name=f"swerex-{name}", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        try:
            for item in self.reading:
                with self.cond:
                    if isinstance(item, JobOutput):
                        (self.out if item.stream == "stdout" else self.err).extend(item.data)
                        i = 0 if item.stream == "stdout" else 1
                        self.read_to[i] = max(self.read_to[i], item.offset + len(item.data))
                    elif isinstance(item, JobEnd):
                        self.ended = item
                    self.cond.notify_all()
        except Exception as e:  # the connection went away (the sandbox closed): the shell is gone for us
            logging.getLogger("rex-runtime").debug("session %s: reading ended: %s", self.name, e)
        finally:
            with self.cond:
                if self.ended is None:
                    self.ended = JobEnd(exit_code=-1, timed_out=False, duration=0.0)
                self.cond.notify_all()

    def run(self, script: str, timeout: float | None) -> tuple[str, int]:
        """Run ``script`` in the shell; (output, exit code). TimeoutError past ``timeout`` (the shell then goes on
        once its children are killed, or is ended: ``self.ended`` set)."""
        marker = secrets.token_hex(16)
        end_out, end_err = f"\n{marker}\n".encode(), marker.encode()
        line = (f"{{ {script}\n}} < /dev/null 2>&1\n"
                f"__swerex_ec=$?; printf '\\n%s\\n' {marker}; printf '%s %d\\n' {marker} \"$__swerex_ec\" >&2\n")
        self.sandbox.send_input(self.job.pid, line.encode())
        deadline = None if timeout is None else time.monotonic() + timeout
        got = self._wait(end_out, end_err, deadline)
        if got is None:
            self._kill_children()
            if self._wait(end_out, end_err, time.monotonic() + KILL_GRACE) is None:
                self.close()
            raise TimeoutError
        with self.cond:
            read_to = (self.read_to[0], self.read_to[1])
        with contextlib.suppress(Exception):  # a long session's output must not pile up in the sandbox's agent
            self.sandbox.discard(self.job.pid, read_to)
        return got

    def _wait(self, end_out: bytes, marker: bytes, deadline: float | None) -> tuple[str, int] | None:
        with self.cond:
            while True:
                at = self.err.find(marker + b" ")
                cut = self.out.rfind(end_out)
                if at >= 0 and (nl := self.err.find(b"\n", at)) >= 0 and cut >= 0:
                    code = int(self.err[at + len(marker) + 1:nl])
                    output = bytes(self.out[:cut]).decode(errors="backslashreplace")
                    del self.out[:cut + len(end_out)]
                    del self.err[:nl + 1]
                    return output, code
                if self.ended is not None:
                    raise SessionDoesNotExistError(f"session {self.name!r} ended (its shell exited "
                                                   f"{self.ended.exit_code})")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self.cond.wait(left)

    def _kill_children(self) -> None:
        """SIGKILL every process under the shell (read from /proc in the sandbox), the shell itself spared."""
        r = self.sandbox.exec("cat /proc/[0-9]*/stat 2>/dev/null", timeout=30)
        parent: dict[int, int] = {}
        for row in r.stdout.splitlines():
            pid, _, rest = row.partition(" (")
            fields = rest.rpartition(") ")[2].split()
            if pid.isdigit() and len(fields) > 1 and fields[1].isdigit():
                parent[int(pid)] = int(fields[1])
        under: set[int] = set()
        frontier = {self.job.pid}  # the job's pid is the process `exec bash` became
        while frontier:
            frontier = {p for p, pp in parent.items() if pp in frontier} - under
            under |= frontier
        if under:
            self.sandbox.exec(f"kill -9 {' '.join(map(str, sorted(under)))} 2>/dev/null", timeout=30)

    def close(self) -> None:
        if self.ended is None:
            with contextlib.suppress(Exception):  # already gone
                self.sandbox.signal(self.job.pid, 9)
        self.reader.join(timeout=10)
        if self.reader.is_alive():
            self.reading.interrupt()  # type: ignore[attr-defined]
            self.reader.join(timeout=10)


class AgentenvRuntime(AbstractRuntime):
    """SWE-ReX's runtime on one agentenv sandbox (see the module doc)."""

    def __init__(self, sandbox: SandboxLike, *, logger: logging.Logger | None = None) -> None:
        self.sandbox = sandbox
        self.logger = logger or logging.getLogger("rex-runtime")
        self.sessions: dict[str, _Shell] = {}

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        try:
            r = await _thread(self.sandbox.exec, "true", timeout=timeout or 30)
        except Exception as e:
            return IsAliveResponse(is_alive=False, message=f"{type(e).__name__}: {e}")
        return IsAliveResponse(is_alive=r.exit_code == 0, message="" if r.exit_code == 0 else r.stderr)

    async def create_session(self, request: CreateSessionRequest) -> CreateSessionResponse:
        if request.session in self.sessions:
            raise SessionExistsError(f"session {request.session} already exists")
        if not isinstance(request, CreateBashSessionRequest):
            raise ValueError(f"unknown session type: {request!r}")
        shell = await _thread(_Shell, self.sandbox, request.session)
        self.sessions[request.session] = shell
        output = ""
        if request.startup_source:
            script = " ; ".join(f"source {shlex.quote(p)}" for p in request.startup_source)
            try:
                output, _ = await _thread(shell.run, script, request.startup_timeout)
            except TimeoutError:
                raise CommandTimeoutError(f"timeout after {request.startup_timeout} seconds while sourcing "
                                          f"{request.startup_source}") from None
        return CreateBashSessionResponse(output=output)

    async def run_in_session(self, action: Action) -> Observation:
        shell = self.sessions.get(action.session)
        if shell is None or shell.ended is not None:
            self.sessions.pop(action.session, None)
            raise SessionDoesNotExistError(f"session {action.session!r} does not exist")
        if isinstance(action, BashInterruptAction):  # between calls nothing runs: the last call already ended
            return BashObservation(output="", exit_code=0)
        if action.is_interactive_command or action.is_interactive_quit or action.expect:
            raise NotImplementedError("interactive session actions (is_interactive_command, is_interactive_quit, "
                                      "expect) need a terminal; agentenv's SWE-ReX runtime runs whole commands only")
        syntax = await _thread(self.sandbox.exec, f"bash -n -c {shlex.quote(action.command)}", timeout=30)
        if syntax.exit_code != 0:
            raise BashIncorrectSyntaxError(
                f"Error (exit code {syntax.exit_code}) while checking bash command \n{action.command!r}\n"
                f"---- Stderr ----\n{syntax.stderr}\n---- Stdout ----\n{syntax.stdout}",
                extra_info={"bash_stdout": syntax.stdout, "bash_stderr": syntax.stderr})
        try:
            output, code = await _thread(shell.run, action.command, action.timeout)
        except TimeoutError:
            if shell.ended is not None:
                self.sessions.pop(action.session, None)
            raise CommandTimeoutError(f"timeout after {action.timeout} seconds while running command "
                                      f"{action.command!r}") from None
        if action.check == "raise" and code != 0:
            msg = f"Command {action.command!r} failed with exit code {code}. Here is the output:\n{output!r}"
            raise NonZeroExitCodeError(f"{action.error_msg}: {msg}" if action.error_msg else msg)
        return BashObservation(output=output, exit_code=None if action.check == "ignore" else code,
                               expect_string="")

    async def close_session(self, request: CloseSessionRequest) -> CloseSessionResponse:
        shell = self.sessions.pop(request.session, None)
        if shell is None:
            raise SessionDoesNotExistError(f"session {request.session!r} does not exist")
        await _thread(shell.close)
        return CloseBashSessionResponse()

    async def execute(self, command: Command) -> CommandResponse:
        """One command in a new process, like ``subprocess.run``: ``shell``, ``env`` (the whole environment, as
        subprocess takes it), ``cwd``, ``timeout``, ``merge_output_streams`` and ``check`` honoured."""
        if command.shell:
            line = command.command if isinstance(command.command, str) else shlex.join(command.command)
        else:
            line = shlex.join([command.command] if isinstance(command.command, str) else command.command)
        if command.env is not None:
            line = shlex.join(["env", "-i", *(f"{k}={v}" for k, v in command.env.items()), "sh", "-c", line])
        if command.merge_output_streams:
            line = f"{{ {line}\n}} 2>&1"
        r = await _thread(self.sandbox.exec, line, timeout=command.timeout, cwd=command.cwd)
        if r.timed_out:
            raise CommandTimeoutError(f"Timeout ({command.timeout}s) exceeded while running command")
        resp = CommandResponse(stdout=r.stdout, stderr=r.stderr, exit_code=r.exit_code)
        if command.check and r.exit_code != 0:
            msg = (f"Command {command.command!r} failed with exit code {r.exit_code}. "
                   f"Stdout:\n{r.stdout!r}\nStderr:\n{r.stderr!r}")
            raise NonZeroExitCodeError(f"{command.error_msg}: {msg}" if command.error_msg else msg)
        return resp

    async def read_file(self, request: ReadFileRequest) -> ReadFileResponse:
        data = await _thread(self.sandbox.read_file, request.path)
        return ReadFileResponse(content=data.decode(request.encoding or "utf-8", request.errors or "strict"))

    async def write_file(self, request: WriteFileRequest) -> WriteFileResponse:
        await _thread(self.sandbox.write_file, request.path, request.content.encode())
        return WriteFileResponse()

    async def upload(self, request: UploadRequest) -> UploadResponse:
        """A host file or folder into the sandbox, as ``shutil.copy`` / ``copytree`` would (modes kept)."""
        await _thread(self._upload, Path(request.source_path), request.target_path)
        return UploadResponse()

    def _upload(self, source: Path, target: str) -> None:
        if source.is_dir():
            for path in sorted(source.rglob("*")):
                dest = posixpath.join(target, *path.relative_to(source).parts)
                if path.is_dir():
                    self.sandbox.make_dir(dest)
                elif path.is_file():
                    self.sandbox.write_file(dest, path.read_bytes(), path.stat().st_mode & 0o7777)
            self.sandbox.make_dir(target)  # an empty folder too
            return
        if not source.is_file():
            raise FileNotFoundError(f"no such file or folder on this host: {source}")
        try:
            if self.sandbox.stat(target).type == "dir":
                target = posixpath.join(target, source.name)
        except FileNotFoundError:
            pass
        self.sandbox.write_file(target, source.read_bytes(), source.stat().st_mode & 0o7777)

    async def close(self) -> CloseResponse:
        for name in list(self.sessions):
            await _thread(self.sessions.pop(name).close)
        return CloseResponse()


class AgentenvDeployment(AbstractDeployment):
    """SWE-ReX's deployment as an agentenv sandbox: ``start`` creates it (or uses ``sandbox=``, which ``stop`` then
    leaves open), with the sandbox's limits (``cpus``, ``memory``, ``pids``, ``network``; enforced)."""

    def __init__(self, *, image: str | None = None, cpus: float | None = None, memory: str | int | None = None,
                 pids: int | None = None, network: bool | None = None, workdir: str | None = None,
                 sandbox: SandboxLike | None = None, snapshot: SnapshotLike | str | None = None,
                 api: Backend | None = None, logger: logging.Logger | None = None) -> None:
        self.logger = logger or logging.getLogger("rex-deploy")
        self.api: Backend = api if api is not None else agentenv
        if sandbox is not None and snapshot is not None:
            raise ValueError("give sandbox= or snapshot=, not both")
        asked = {"image": image, "cpus": cpus, "memory": memory, "pids": pids, "network": network, "workdir": workdir}
        if (sandbox is not None or snapshot is not None) and (given := [k for k, v in asked.items() if v is not None]):
            raise ValueError(f"{', '.join(given)}: set when a sandbox is created; a sandbox given as sandbox= or "
                             "restored from snapshot= keeps its own")
        self.image = image or DEFAULT_IMAGE
        self.cpus, self.memory = 1.0 if cpus is None else cpus, "1g" if memory is None else memory
        self.pids, self.network, self.workdir = 512 if pids is None else pids, bool(network), workdir
        self.sandbox: SandboxLike | None = sandbox
        self._snapshot, self._owned = snapshot, sandbox is None
        self._runtime: AgentenvRuntime | None = None
        self._hooks = CombinedDeploymentHook()

    def add_hook(self, hook: DeploymentHook) -> None:
        self._hooks.add_hook(hook)

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        if self._runtime is None:
            return IsAliveResponse(is_alive=False, message="Runtime is None.")
        return await self._runtime.is_alive(timeout=timeout)

    async def start(self) -> None:
        if self.sandbox is None:
            self._hooks.on_custom_step("Starting agentenv sandbox")
            if self._snapshot is not None:
                self.sandbox = await _thread(self.api.Sandbox.restore, self._snapshot)
            else:
                self.sandbox = await _thread(create_sandbox, self.api, self.image, cpus=self.cpus, memory=self.memory,
                                             pids=self.pids, network=self.network, workdir=self.workdir)
        self._runtime = AgentenvRuntime(self.sandbox, logger=self.logger)

    async def stop(self) -> None:
        if self._runtime is not None:
            await self._runtime.close()
            self._runtime = None
        if self.sandbox is not None and self._owned:
            sandbox, self.sandbox = self.sandbox, None
            await _thread(sandbox.close)

    @property
    def runtime(self) -> AgentenvRuntime:
        if self._runtime is None:
            raise DeploymentNotStartedError()
        return self._runtime

    def fork(self, n: int = 1, *, memory: bool = True) -> list[AgentenvDeployment]:
        """``n`` deployments on copies of this one's sandbox, each owning its copy (``stop`` closes it); start each
        before use. Their runtimes start with no sessions."""
        if self.sandbox is None:
            raise DeploymentNotStartedError()
        out = []
        for sb in self.sandbox.fork(n, memory=memory, ttl=HARNESS_TTL):
            d = AgentenvDeployment(sandbox=sb, api=self.api, logger=self.logger)
            d._owned = True
            out.append(d)
        return out

    def snapshot(self, memory: bool = False) -> SnapshotLike:
        """A snapshot of the sandbox for ``AgentenvDeployment(snapshot=...)``; the caller deletes it."""
        if self.sandbox is None:
            raise DeploymentNotStartedError()
        return self.sandbox.snapshot(memory)
