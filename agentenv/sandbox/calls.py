"""Calls into a running sandbox: commands, background processes, jobs and files (what the keeper does for us).

``Calls`` is the half of ``Sandbox`` that works inside a running sandbox through its keeper, apart from its
lifecycle (create, snapshot, pause, close: ``agentenv.sandbox.core``): ``exec``, ``spawn``, ``read_file`` and
``write_file``, the job calls (``start``, ``output``, ``send_input``...) and the file system calls (``stat``,
``list_dir``, ``move``...), whose host side is ``agentenv.sandbox.jobs``. Every call goes through the sandbox's
channel (``agentenv.sandbox.channel``); paths are checked here first: relative ones are taken from the working
directory, and the keeper's own folders are refused. (``hostcalls`` is another thing: the kernel calls that
set a sandbox up.)
"""

from __future__ import annotations

import builtins
import errno
import posixpath
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from agentenv import api
from agentenv.api import (
    DEFAULT_EXEC_TIMEOUT,
    ExecResult,
    FileInfo,
    JobEnd,
    JobInfo,
    JobOutput,
    OutputCallback,
)
from agentenv.inside import frames, keeper
from agentenv.inside.jobs import MAX_OUTPUT
from agentenv.sandbox import jobs
from agentenv.sandbox.channel import Channel

if TYPE_CHECKING:
    from agentenv.host.runtime import ContainerSpec


class Process(api.Process):
    """A background process started with ``Sandbox.spawn``; it survives snapshots and forks. What its sandbox's
    keeper answers is this subclass's; the rest, shared with a server's processes, is ``agentenv.api.Process``."""

    sandbox: Calls

    def __init__(self, sandbox: Calls, pid: int, log: str, command: str) -> None:
        super().__init__(sandbox, pid, log, command)

    @property
    def exit_code(self) -> int | None:
        """None while it runs, else its exit code (128 + signal when killed)."""
        reply, _ = self.sandbox._channel.call({"op": "procs"})
        entry = reply["procs"].get(str(self.pid))
        return None if entry is None else entry["exit_code"]

    def kill(self, signal: int = 9) -> None:
        self.sandbox._channel.call({"op": "kill", "pid": self.pid, "signal": signal})


class Calls:
    """The calls into a running sandbox; ``Sandbox`` inherits them (it provides what is declared here, and is
    the only class that does; ``Process`` needs no more of it than these calls)."""

    id: str
    _channel: Channel

    if TYPE_CHECKING:
        def container_spec(self) -> ContainerSpec: ...

        def require_running(self) -> None: ...

    def _workdir(self) -> str:
        """Where relative paths start: the sandbox's working directory."""
        return self.container_spec().workdir

    def as_user(self, name: str) -> Calls:
        """These calls as the account ``name`` of the sandbox's image (E2B's ``user=``; not part of the backend
        contract): commands run with its uid, gid, groups and environment, in its home by default (where
        relative paths start too); file calls run with its permissions, and what they make is its own.
        UnknownUser if the image has no such account."""
        return AsUser(self, name)

    # --- commands and files -------------------------------------------------------------------

    def exec(self, command: str, *, timeout: float | None = DEFAULT_EXEC_TIMEOUT, cwd: str | None = None,
             env: dict[str, str] | None = None, on_output: OutputCallback | None = None) -> ExecResult:
        """Run ``command`` with /bin/sh; past ``timeout`` its whole process group is killed.

        ``on_output(stream, data)`` receives output as it comes ('stdout' or 'stderr').
        """
        self.require_running()
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        h = self._channel.exec({"cmd": command, "timeout": timeout, "cwd": cwd, "env": env or {},
                                "max_output": max_output(self.container_spec().limits.memory)}, on_output)
        out, err = (h[k].decode(errors="replace") + _dropped(n) for k, n in zip(("stdout", "stderr"), h["dropped"], strict=True))
        return ExecResult(exit_code=h["exit_code"], stdout=out, stderr=err, duration=h["duration"],
                          timed_out=h["timed_out"])

    def spawn(self, command: str, *, cwd: str | None = None, env: dict[str, str] | None = None) -> Process:
        """Start a background process; its output goes to a log file inside the sandbox."""
        self.require_running()
        reply, _ = self._channel.call({"op": "spawn", "cmd": command, "cwd": cwd, "env": env or {}})
        return Process(self, reply["pid"], reply["log"], command)

    def processes(self) -> builtins.list[Process]:
        """Every process started with ``spawn`` (running or finished)."""
        self.require_running()
        reply, _ = self._channel.call({"op": "procs"})
        return [Process(self, int(pid), p["log"], p["cmd"]) for pid, p in reply["procs"].items()]

    def open_port(self, port: int, timeout: float = 10.0) -> socket.socket:
        """A connection to what listens on TCP ``port`` of the sandbox's loopback (through its keeper, so a sandbox
        without a network serves it too); ``ConnectionRefusedError`` when nothing does."""
        self.require_running()
        return self._channel.tunnel(port, timeout)

    def read_file(self, path: str) -> bytes:
        """A whole file (at most 1 GiB); the keeper's own files are refused (PermissionError), its
        process logs excepted."""
        self.require_running()
        return self._channel.call({"op": "read", "path": _own_checked(_abs(path, self._workdir()), False)})[1]

    def write_file(self, path: str, data: bytes | str, mode: int = 0o644, *,
                   metadata: dict[str, str] | None = None) -> None:
        """Write a whole file (at most 1 GiB) atomically, creating parent folders; the keeper's own
        folders are refused (PermissionError). ``metadata``: the new file's ``user.e2b.*`` xattrs (those of
        the file it replaces go with it)."""
        self.require_running()
        payload = data if isinstance(data, bytes) else data.encode() if isinstance(data, str) else bytes(data)
        if len(payload) > frames.MAX_FILE:
            raise ValueError(f"{len(payload)} bytes is over write_file's limit of {frames.MAX_FILE}")
        target = _own_checked(_abs(path, self._workdir()), True)
        self._channel.call({"op": "write", "path": target, "mode": mode, **({"metadata": dict(metadata)} if metadata else {})},
                           payload)

    # --- jobs and the file system (the host side: agentenv.sandbox.jobs) --------------------------------

    def start(self, command: str, *, cwd: str | None = None, env: dict[str, str] | None = None,
              timeout: float | None = None, stdin: bool = False, tag: str | None = None) -> JobInfo:
        """Start ``command`` with /bin/sh and return at once; its output waits in the sandbox for ``output``."""
        self.require_running()
        return jobs.start(self._channel, command, cwd=cwd, env=env, timeout=timeout, stdin=stdin, tag=tag,
                          max_output=max_output(self.container_spec().limits.memory))

    def start_terminal(self, command: str, size: tuple[int, int], *, cwd: str | None = None,
                       env: dict[str, str] | None = None, timeout: float | None = None,
                       tag: str | None = None) -> JobInfo:
        """``start`` on a new terminal of ``size`` (rows, cols), the session's controlling one (E2B's PTYs; not
        part of the backend contract): its output comes as the one stream "pty", ``send_input`` types at it."""
        self.require_running()
        return jobs.start(self._channel, command, cwd=cwd, env=env, timeout=timeout, stdin=True, tag=tag,
                          max_output=max_output(self.container_spec().limits.memory), pty=size)

    def resize(self, pid: int, size: tuple[int, int]) -> None:
        """Set the (rows, cols) of the terminal of a job ``start_terminal`` made (ValueError for another job)."""
        jobs.resize(self._channel, pid, size)

    def jobs(self) -> builtins.list[JobInfo]:
        """The jobs ``start`` made that run, or ended but whose end ``output`` has not delivered yet."""
        return jobs.listing(self._channel)

    def output(self, pid: int, offsets: tuple[int, int] | None = None, *, follow: bool = True
               ) -> Iterator[JobOutput | JobEnd | None]:
        """A job's output from absolute ``offsets`` (None: the oldest kept); None items are heartbeats, JobEnd last."""
        return jobs.output(self._channel, pid, offsets, follow)

    def tail(self, pid: int, size: int = 64 << 10) -> builtins.list[JobOutput]:
        """The last ``size`` bytes of each of a job's streams, left for ``output`` (its end too): a look, not a read."""
        return jobs.tail(self._channel, pid, size)

    def discard(self, pid: int, offsets: tuple[int, int]) -> None:
        """Let the keeper drop a job's buffered output below ``offsets`` (never to be read again)."""
        jobs.discard(self._channel, pid, offsets)

    def send_input(self, pid: int, data: bytes) -> None:
        """Write to a job's stdin (BrokenPipeError if it is closed or the job was started without one)."""
        jobs.send_input(self._channel, pid, data)

    def close_input(self, pid: int) -> None:
        """Close a job's stdin (EOF); idempotent."""
        jobs.close_input(self._channel, pid)

    def signal(self, pid: int, sig: int) -> None:
        """Send ``sig`` to the process group of a job (or of a spawned process)."""
        jobs.signal(self._channel, pid, sig)

    def stat(self, path: str, *, resolve_links: bool = False) -> FileInfo:
        """What is at ``path`` (FileNotFoundError if nothing); with ``resolve_links`` a symlink's target is given
        resolved and absolute (E2B's way) instead of as written."""
        return jobs.stat(self._channel, _own_checked(_abs(path, self._workdir()), False), resolve_links)

    def list_dir(self, path: str, depth: int = 1, *, resolve_links: bool = False) -> builtins.list[FileInfo]:
        """The entries under ``path`` down to ``depth`` levels (1: its children), symlinked folders not followed;
        ``resolve_links`` as for ``stat``."""
        return jobs.list_dir(self._channel, _own_checked(_abs(path, self._workdir()), False), depth,
                             resolve_links)

    def make_dir(self, path: str) -> bool:
        """Make a folder and its parents; False if it already was one (FileExistsError if a file is there)."""
        return jobs.make_dir(self._channel, _own_checked(_abs(path, self._workdir()), True))

    def move(self, src: str, dst: str) -> FileInfo:
        """Rename ``src`` to ``dst`` (across file systems too); the info of ``dst``."""
        return jobs.move(self._channel, *(_own_checked(_abs(p, self._workdir()), True) for p in (src, dst)))

    def remove(self, path: str) -> None:
        """Remove a file, a symlink or a whole folder (FileNotFoundError if nothing is there)."""
        jobs.remove(self._channel, _own_checked(_abs(path, self._workdir()), True))


class AsUser(Calls):
    """A sandbox's calls as one account of its image (``Calls.as_user``): every request names it."""

    def __init__(self, sandbox: Calls, name: str) -> None:
        self.sandbox, self.user, self.id = sandbox, name, sandbox.id
        self._channel = _UserChannel(sandbox._channel, name)  # type: ignore[assignment]
        reply, _ = sandbox._channel.call({"op": "account", "name": name})
        self.uid, self.home = int(reply["account"]["uid"]), str(reply["account"]["home"])

    def container_spec(self) -> ContainerSpec:
        return self.sandbox.container_spec()

    def require_running(self) -> None:
        self.sandbox.require_running()

    def _workdir(self) -> str:
        return self.home


class _UserChannel:
    """A sandbox's channel whose requests all carry ``"user"`` (the keeper runs each as that account)."""

    def __init__(self, channel: Channel, user: str) -> None:
        self.channel, self.user = channel, user

    def call(self, header: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        return self.channel.call({**header, "user": self.user}, *args, **kwargs)

    def exec(self, header: dict[str, Any], on_output: OutputCallback | None) -> dict[str, Any]:
        return self.channel.exec({**header, "user": self.user}, on_output)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.channel, name)


def max_output(memory: int) -> int:
    """Bytes of one command's output the keeper keeps per stream: 64 MiB, or a sixteenth of the sandbox's
    memory when that is less (the keeper holds them, in the sandbox's memory)."""
    return min(MAX_OUTPUT, max(1 << 20, memory // 16))


def _dropped(n: int) -> str:
    """The visible marker for output past the keeper's per-stream cap (``max_output``)."""
    return f"\n[agentenv: {n} more bytes of output were dropped]\n" if n else ""


def _own_checked(path: str, write: bool) -> str:
    """``path`` normalized (the path checked is the path sent), unless it is one of the keeper's own files
    (PermissionError); reads of its process logs pass. The keeper checks writes again, symlinks resolved."""
    norm = "/" + posixpath.normpath(path).lstrip("/")
    if not write and norm.startswith(keeper.LOG_DIR + "/"):
        return norm
    for d in keeper.OWN_DIRS:
        if norm == d or norm.startswith(d + "/"):
            raise PermissionError(errno.EACCES, f"{path} is in the sandbox keeper's own folder {d}; "
                                                "the file API does not touch it")
    return norm


def _abs(path: str, workdir: str) -> str:
    """Absolute path inside the sandbox; relative ones are taken from the working directory."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise ValueError(f"path must be a non-empty string, got {path!r}")
    return path if path.startswith("/") else posixpath.join(workdir, path)
