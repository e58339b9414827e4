"""The sandbox contract, written once: the value types and the Protocols of docs/architecture.md §3.

Three things implement it: the local API (the ``agentenv`` module: ``agentenv.Sandbox`` and
``agentenv.Snapshot``), a server's client (``agentenv.connect(url, token)``) and a ``Pool`` of
servers. Code that takes a ``Backend`` runs against any of them unchanged; mypy checks that each one
satisfies it (``tests/unit/test_contract.py``). The value types are plain dataclasses that travel as dicts
(``to_wire``, ``from_wire``: ``agentenv.values``), so a new field is one edit here. ``Process`` (what ``spawn``
returns) is here too, but for the two calls each side makes its own way: the client needs no host.
Standard library only: a user who wants sandboxes alone needs nothing else to read this contract.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

from agentenv.values import Value
from agentenv.values import info_of as info_of  # the contract's name for it

State = Literal["creating", "running", "paused", "closed", "lost"]
OutputCallback = Callable[[str, bytes], None]  # (stream: 'stdout' | 'stderr', data)
DEFAULT_IMAGE = "agentenv/base"
DEFAULT_EXEC_TIMEOUT = 600.0
DEFAULT_DISK = "10g"
MAX_FORK = 64  # children one fork makes at most: ``fork_count`` holds every fork to it (the servers' schemas say it)
MAX_DEPTH = 4096  # levels a listing goes down at most (a path of 4096 bytes has at most 2048)
# A sandbox's deadline unless its maker asks otherwise (``ttl=None``: none), as E2B's and Modal's: absolute, counted
# from its start and not extended by use (``set_ttl`` moves it); at the deadline it is closed (docs/sandboxes.md).
DEFAULT_TTL = 300.0


def fork_count(count: object) -> int:
    """``count`` as the number of children of a fork: an int from 1 to ``MAX_FORK``, else ValueError (bad input,
    a 400 on the wire). Every fork checks its count here, where it is asked for: ``Sandbox.fork``,
    ``RemoteSandbox.fork`` (a pool's spread fork included) and the server's ``Service.fork``."""
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_FORK:
        raise ValueError(f"fork count must be an integer in 1..{MAX_FORK}, got {count!r}")
    return count


def check_ttl(ttl: float | None) -> float | None:
    """``ttl`` as a sandbox's time to live: positive seconds, or None (no deadline: only when asked for); else
    ValueError (a 400 on the wire)."""
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int | float) or not 0 < ttl < float("inf")):
        raise ValueError(f"ttl must be positive seconds (or None: no deadline), got {ttl!r}")
    return ttl


@dataclass(frozen=True)
class Limits(Value):
    """Resource limits of one sandbox: CPU, memory and pids enforced by its cgroup, ``disk`` (bytes its files
    may take; None: no limit) by a quota on its writable layer."""

    cpus: float = 1.0
    memory: int = 1 << 30  # bytes
    pids: int = 512
    disk: int | None = None  # bytes; None in records made before disk limits existed, or asked for

    MIN_CPUS: ClassVar[float] = 0.01  # a CPU quota of 1 ms in 100: the kernel's least (less is none at all)

    def checked(self) -> Limits:
        """These limits (``cpus`` a float), or ValueError naming the first no sandbox may have: what a create refuses,
        and an import (runc takes a memory or pids limit of 0 as none, and a CPU quota under 1 ms as none too)."""
        number = (int, float)
        if not isinstance(self.cpus, number) or isinstance(self.cpus, bool) or not self.cpus >= self.MIN_CPUS \
                or self.cpus == float("inf"):
            raise ValueError(f"cpus must be a number of at least {self.MIN_CPUS}, got {self.cpus!r}")
        if not isinstance(self.memory, int) or isinstance(self.memory, bool) or self.memory <= 0:
            raise ValueError(f"memory must be a positive number of bytes, got {self.memory!r}")
        if not isinstance(self.pids, int) or isinstance(self.pids, bool) or self.pids < 8:
            raise ValueError(f"pids must be an integer >= 8, got {self.pids!r}")
        if self.disk is not None and (not isinstance(self.disk, int) or isinstance(self.disk, bool) or self.disk <= 0):
            raise ValueError(f"disk must be a positive number of bytes or None, got {self.disk!r}")
        return dataclasses.replace(self, cpus=float(self.cpus))


@dataclass(frozen=True)
class Network(Value):
    """A sandbox's link to the outside and its outbound rules, in E2B's shape (``agentenv.netpolicy`` says what
    they mean: an allowed destination wins over a denied one; the host, the other sandboxes and link-local
    addresses are never reachable; private ranges only where allowed). ``address`` (the sandbox's own) and
    ``resolved`` (each host name's addresses when the rule was set) are the host's answers, not asked for."""

    allow_out: tuple[str, ...] = ()
    deny_out: tuple[str, ...] = ()
    address: str | None = None
    resolved: dict[str, list[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class ExecResult(Value):
    """The outcome of one command."""

    exit_code: int
    stdout: str
    stderr: str
    duration: float
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


@dataclass(frozen=True)
class SandboxInfo(Value):
    """What a sandbox is, at one instant: the body of the server's sandbox routes."""

    id: str
    state: State
    image: str
    created_at: float
    expires_at: float | None
    labels: dict[str, str]
    limits: Limits
    network: Network | None = None  # None: loopback only
    parent_snapshot: str | None = None  # the snapshot it was restored or forked from (None: made from an image)
    forked_from: str | None = None  # the sandbox it is a fork of (None: created, or restored from a snapshot)

    _nested: ClassVar[dict[str, type[Value]]] = {"limits": Limits, "network": Network}


@dataclass(frozen=True)
class SnapshotInfo(Value):
    """A saved sandbox state: its filesystem, and with ``has_memory`` every process too."""

    id: str
    parent_id: str | None
    created_at: float
    size_bytes: int
    has_memory: bool
    sandbox_id: str | None = None
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ProcessInfo(Value):
    """A background process started with ``spawn``; ``exit_code`` is None while it runs."""

    pid: int
    log: str
    command: str
    exit_code: int | None = None


@dataclass(frozen=True)
class JobInfo(Value):
    """A job made by ``start``: its request, and ``exit_code`` once it ended (None while it runs)."""

    pid: int
    command: str
    cwd: str | None
    env: dict[str, str]
    tag: str | None
    stdin: bool  # started with stdin=True (a pipe fed by send_input)
    exit_code: int | None = None


@dataclass(frozen=True)
class JobOutput(Value):
    """A piece of a job's output: ``data`` starts at the absolute byte ``offset`` of its ``stream``."""

    stream: str  # "stdout" | "stderr" ("pty": a terminal's one stream, for ``Sandbox.start_terminal``)
    data: bytes
    offset: int


@dataclass(frozen=True)
class JobEnd(Value):
    """How a job ended: the last item of ``output``."""

    exit_code: int
    timed_out: bool
    duration: float


@dataclass(frozen=True)
class FileInfo(Value):
    """A file in a sandbox; ``type`` is that of what a symlink points to ('file' if nothing), the rest its own."""

    name: str
    path: str  # absolute
    type: str  # "file" | "dir"
    size: int
    mode: int  # permission bits (st_mode & 0o7777)
    permissions: str  # e.g. "-rw-r--r--"
    owner: str  # a name where the sandbox's /etc/passwd has it, else the uid
    group: str
    modified: float  # epoch seconds
    symlink_target: str | None = None  # set when the path itself is a symlink
    metadata: dict[str, str] | None = None  # its ``user.e2b.*`` extended attributes (E2B's file metadata), if any


@dataclass(frozen=True)
class ImageFetch(Value):
    """Where an image asked for (``ensure_image``) came from: ``source`` "local" (it was there), "tarball" (a
    ``docker load`` of the file ``detail``), "mirror" (pulled as ``detail``, tagged with ``image``) or "registry"
    (pulled by its own name); ``id`` the image's id, ``seconds`` how long it took."""

    image: str
    id: str
    source: str
    detail: str = ""
    seconds: float = 0.0


# --- the Protocols --------------------------------------------------------------------------------


@runtime_checkable
class ProcessLike(Protocol):
    """A background process in a sandbox; it survives snapshots and forks."""

    pid: int
    log: str
    command: str

    @property
    def exit_code(self) -> int | None: ...

    def output(self) -> str: ...

    def kill(self, signal: int = 9) -> None: ...

    def wait(self, timeout: float = 60.0) -> int: ...


class Process:
    """A ``ProcessLike`` of any sandbox, local or on a server: the part that needs no transport. How a subclass
    asks about it is its own (``exit_code``, ``kill``): ``agentenv.sandbox.calls.Process`` through the sandbox's
    keeper, ``agentenv.remote.client.RemoteProcess`` over HTTP; ``isinstance(p, agentenv.Process)`` holds for both."""

    def __init__(self, sandbox: Any, pid: int, log: str, command: str) -> None:  # sandbox: the subclass's kind
        self.sandbox, self.pid, self.log, self.command = sandbox, pid, log, command

    def __repr__(self) -> str:
        return f"Process(pid={self.pid}, command={self.command!r})"

    @property
    def exit_code(self) -> int | None:
        """None while it runs, else its exit code (128 + signal when killed)."""
        raise NotImplementedError

    def output(self) -> str:
        """Everything it wrote so far (stdout and stderr interleaved)."""
        return self.sandbox.read_file(self.log).decode(errors="replace")

    def kill(self, signal: int = 9) -> None:
        raise NotImplementedError

    def info(self) -> ProcessInfo:
        return ProcessInfo(pid=self.pid, log=self.log, command=self.command, exit_code=self.exit_code)

    def wait(self, timeout: float = 60.0) -> int:
        deadline = time.monotonic() + timeout
        while (code := self.exit_code) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self!r} still running after {timeout} s")
            time.sleep(0.02)
        return code


@runtime_checkable
class SnapshotLike(Protocol):
    """A snapshot in some store (this host's, or a server's)."""

    @property
    def id(self) -> str: ...

    @property
    def parent_id(self) -> str | None: ...

    @property
    def created_at(self) -> float: ...

    @property
    def size_bytes(self) -> int: ...

    @property
    def has_memory(self) -> bool: ...

    @property
    def sandbox_id(self) -> str | None: ...

    @property
    def labels(self) -> dict[str, str]: ...

    def delete(self, background: bool = False) -> None: ...


@runtime_checkable
class SandboxLike(Protocol):
    """An isolated Linux environment with exec, jobs, files, snapshot, fork, pause and resume."""

    id: str

    @property
    def state(self) -> str: ...

    @property
    def image(self) -> str: ...

    @property
    def created_at(self) -> float: ...

    @property
    def labels(self) -> dict[str, str]: ...

    @property
    def expires_at(self) -> float | None: ...

    @property
    def limits(self) -> Limits: ...

    @property
    def network(self) -> Network | None: ...

    @property
    def parent_snapshot(self) -> str | None: ...

    @property
    def forked_from(self) -> str | None: ...

    def update_network(self, allow_out: Sequence[str] = ..., deny_out: Sequence[str] = ...) -> Network: ...

    def set_ttl(self, ttl: float) -> None: ...

    def exec(self, command: str, *, timeout: float | None = ..., cwd: str | None = ...,
             env: dict[str, str] | None = ..., on_output: OutputCallback | None = ...) -> ExecResult: ...

    def spawn(self, command: str, *, cwd: str | None = ..., env: dict[str, str] | None = ...) -> ProcessLike: ...

    def processes(self) -> Sequence[ProcessLike]: ...

    def read_file(self, path: str) -> bytes: ...

    def write_file(self, path: str, data: bytes | str, mode: int = ...) -> None: ...

    # jobs: commands whose output waits in the sandbox until read, from byte offsets
    def start(self, command: str, *, cwd: str | None = ..., env: dict[str, str] | None = ...,
              timeout: float | None = ..., stdin: bool = ..., tag: str | None = ...) -> JobInfo: ...

    def jobs(self) -> Sequence[JobInfo]: ...

    def tail(self, pid: int, size: int = ...) -> Sequence[JobOutput]: ...

    def output(self, pid: int, offsets: tuple[int, int] | None = ..., *, follow: bool = ...
               ) -> Iterator[JobOutput | JobEnd | None]: ...

    def discard(self, pid: int, offsets: tuple[int, int]) -> None: ...

    def send_input(self, pid: int, data: bytes) -> None: ...

    def close_input(self, pid: int) -> None: ...

    def signal(self, pid: int, sig: int) -> None: ...

    # the file system
    def stat(self, path: str) -> FileInfo: ...

    def list_dir(self, path: str, depth: int = ...) -> Sequence[FileInfo]: ...

    def make_dir(self, path: str) -> bool: ...

    def move(self, src: str, dst: str) -> FileInfo: ...

    def remove(self, path: str) -> None: ...

    def snapshot(self, memory: bool = ..., *, labels: dict[str, str] | None = ...) -> SnapshotLike: ...

    def fork(self, n: int = ..., *, memory: bool = ..., ttl: float | None = ...) -> Sequence[SandboxLike]: ...

    def pause(self) -> SnapshotLike: ...

    def resume(self) -> None: ...

    def close(self) -> None: ...

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: object) -> None: ...


class SandboxFactory(Protocol):
    """``agentenv.Sandbox``, ``client.Sandbox``, ``pool.Sandbox``: make, find and list sandboxes."""

    def create(self, image: str = ..., *, cpus: float = ..., memory: str | int = ..., pids: int = ...,
               disk: str | int | None = ..., network: bool | Network | Mapping[str, Any] = ..., env: dict[str, str] | None = ...,
               workdir: str | None = ..., ttl: float | None = ...,
               labels: dict[str, str] | None = ..., share_memory: bool | None = ...) -> SandboxLike: ...

    def restore(self, snapshot: SnapshotLike | str, *, labels: dict[str, str] | None = ...,
                ttl: float | None = ...) -> SandboxLike: ...

    def get(self, sandbox_id: str) -> SandboxLike: ...

    def list(self) -> Sequence[SandboxLike]: ...


class SnapshotFactory(Protocol):
    """``agentenv.Snapshot``, ``client.Snapshot``, ``pool.Snapshot``: find and list snapshots."""

    def get(self, snapshot_id: str) -> SnapshotLike: ...

    def list(self) -> Sequence[SnapshotLike]: ...


class Backend(Protocol):
    """Where sandboxes live: this host (the ``agentenv`` module), one server (a client) or a ``Pool``."""

    @property
    def Sandbox(self) -> SandboxFactory: ...  # noqa: N802 - the attribute is named like the class it usually is

    @property
    def Snapshot(self) -> SnapshotFactory: ...  # noqa: N802
