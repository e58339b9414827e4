"""The remote sandbox API: ``agentenv.connect(url, token)`` mirrors the local one over HTTP.

``client.Sandbox.create(...)``, ``client.Sandbox.restore(snap)``, ``client.Snapshot.list()`` and the
methods of the sandboxes they return take the same arguments, return the same types (those of
``agentenv.api``) and raise the same exceptions as ``agentenv.Sandbox`` and ``agentenv.Snapshot``, so
code written against the local API (the ``agentenv.api.Backend`` contract) runs unchanged against a
server.

The calls go over ``transport.Transport`` (pooled connections, msgpack bodies, retries, timeouts); this module
is what they mean: the server, its sandboxes, processes and snapshots.
"""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from agentenv import errors, netpolicy
from agentenv.api import (
    DEFAULT_DISK,
    DEFAULT_EXEC_TIMEOUT,
    DEFAULT_IMAGE,
    DEFAULT_TTL,
    ExecResult,
    ImageFetch,
    JobEnd,
    JobInfo,
    JobOutput,
    Limits,
    Network,
    OutputCallback,
    Process,
    SandboxInfo,
    SnapshotInfo,
    SnapshotLike,
    check_ttl,
    fork_count,
)
from agentenv.errors import ConnectionLost, SandboxNotFound
from agentenv.remote.files import RemoteFiles
from agentenv.remote.transport import DEFAULT_TIMEOUT, Transport

INPUT_PIECE = 16 << 20  # bytes of stdin sent per request (the server takes bodies up to 32 MiB)


class Client(Transport):
    """One server: an HTTP connection pool with the token, and ``Sandbox`` / ``Snapshot`` like the module's."""

    def __init__(self, url: str, token: str, *, timeout: float = DEFAULT_TIMEOUT, retries: int = 3) -> None:
        super().__init__(url, token, timeout=timeout, retries=retries)
        self.on_sandbox: Callable[[RemoteSandbox], None] | None = None  # told of every sandbox it hands out
        self.spread: Callable[[RemoteSandbox, int, bool, float | None], list[RemoteSandbox]] | None = None  # a Pool's fork
        self.Sandbox = SandboxAPI(self)
        self.Snapshot = SnapshotAPI(self)

    def __repr__(self) -> str:
        return f"Client({self.url!r}{', down' if self.down else ''})"

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def server_info(self) -> dict[str, Any]:
        """Version, capacity (live and free sandboxes and memory) and what the server recovered at start."""
        return cast(dict[str, Any], self.request("GET", "/v1/server", idempotent=True))

    def ensure_image(self, image: str, *, deadline: float | None = None) -> ImageFetch:
        """Make sure ``image`` is on the server's host (its local store, a tarball, a mirror or a registry: the
        server's own sources, ``agentenv.host.image_store``); where it came from. ImageUnavailable when none has
        it. The call waits as long as the pull may take (``deadline``, at most the server's own)."""
        wait = (deadline or 3600.0) + 60.0
        return ImageFetch.from_wire(self.request("POST", "/v1/images/ensure", {"image": image, "deadline": deadline},
                                                 timeout=wait))

    def sandbox_of(self, info: dict[str, Any]) -> RemoteSandbox:
        """The handle of the sandbox a server's answer describes (``on_sandbox`` is told of it)."""
        sb = RemoteSandbox(self, SandboxInfo.from_wire(info))
        if self.on_sandbox is not None:
            self.on_sandbox(sb)
        return sb


def connect(url: str, token: str, *, timeout: float = DEFAULT_TIMEOUT, retries: int = 3) -> Client:
    """A client of the environment server at ``url``; it has ``.Sandbox`` and ``.Snapshot`` like the module."""
    return Client(url, token, timeout=timeout, retries=retries)


@dataclass(frozen=True)
class RemoteSnapshot(SnapshotInfo):
    """A snapshot in a server's store; ``delete`` removes it there."""

    client: Client | None = field(default=None, repr=False, compare=False)

    def delete(self, background: bool = False) -> None:
        assert self.client is not None
        self.client.request("DELETE", f"/v1/snapshots/{self.id}", params={"background": background}, idempotent=True)


def _snapshot(client: Client, info: dict[str, Any]) -> RemoteSnapshot:
    return RemoteSnapshot(**SnapshotInfo.from_wire(info).to_wire(), client=client)


class RemoteProcess(Process):
    """A background process in a remote sandbox."""

    sandbox: RemoteSandbox

    def __init__(self, sandbox: RemoteSandbox, pid: int, log: str, command: str) -> None:
        super().__init__(sandbox, pid, log, command)

    @property
    def exit_code(self) -> int | None:
        info = self.sandbox._client.request("GET", f"/v1/sandboxes/{self.sandbox.id}/processes/{self.pid}",
                                            idempotent=True)
        return cast(int | None, info["exit_code"])

    def kill(self, signal: int = 9) -> None:
        self.sandbox._client.request("POST", f"/v1/sandboxes/{self.sandbox.id}/processes/{self.pid}/kill",
                                     {"signal": signal})


class RemoteSandbox(RemoteFiles):
    """A sandbox on a server, with the methods and properties of ``agentenv.Sandbox``."""

    def __init__(self, client: Client, info: SandboxInfo) -> None:
        self._client, self._info = client, info
        self.id: str = info.id
        self._closed = False

    def __repr__(self) -> str:
        return f"RemoteSandbox(id={self.id!r}, server={self._client.url!r})"

    def __enter__(self) -> RemoteSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def client(self) -> Client:
        return self._client

    def _path(self, suffix: str = "") -> str:
        return f"/v1/sandboxes/{self.id}{suffix}"

    def _call(self, method: str, suffix: str, body: Any = None, **kw: Any) -> Any:
        if self._closed:
            raise errors.SandboxStateError(f"sandbox {self.id} is closed")
        return self._client.request(method, self._path(suffix), body, **kw)

    # properties
    @property
    def state(self) -> str:
        """'running', 'paused', 'closed', or 'lost' (its processes died, or its server stopped answering)."""
        if self._closed:
            return "closed"
        try:
            self._info = SandboxInfo.from_wire(self._client.request("GET", self._path(), idempotent=True))
        except SandboxNotFound:
            return "closed"
        except ConnectionLost:
            return "lost"
        return self._info.state

    def info(self) -> SandboxInfo:
        """What the sandbox is now, as the server sees it."""
        self._info = SandboxInfo.from_wire(self._call("GET", "", idempotent=True))
        return self._info

    @property
    def image(self) -> str:
        return self._info.image

    @property
    def created_at(self) -> float:
        return self._info.created_at

    @property
    def labels(self) -> dict[str, str]:
        return dict(self._info.labels)

    @property
    def expires_at(self) -> float | None:
        return self._info.expires_at

    @property
    def limits(self) -> Limits:
        return self._info.limits

    @property
    def network(self) -> Network | None:
        """The sandbox's address and outbound rules (as last seen: ``info()`` asks again); None: loopback only."""
        return self._info.network

    @property
    def parent_snapshot(self) -> str | None:
        """The snapshot it was restored or forked from (None: made from an image; or a server before the field)."""
        return self._info.parent_snapshot

    @property
    def forked_from(self) -> str | None:
        """The sandbox it is a fork of, on its server (None: created or restored; or a server before the field)."""
        return self._info.forked_from

    def set_ttl(self, ttl: float) -> None:
        """Extend (or shorten) the time to live, counted from now."""
        self._info = SandboxInfo.from_wire(self._call("POST", "/ttl", {"ttl": ttl}))

    def update_network(self, allow_out: Sequence[str] = (), deny_out: Sequence[str] = ()) -> Network:
        """Replace the outbound rules of a sandbox made with network (NetworkRuleError, nothing changed, for one
        that cannot be enforced; SandboxStateError for a sandbox made without network)."""
        body = _network_body({"allow_out": allow_out, "deny_out": deny_out})
        self._info = SandboxInfo.from_wire(self._call("PUT", "/network", body, idempotent=True))
        assert self._info.network is not None  # the server answers 409 for a sandbox without network
        return self._info.network

    # commands (the file calls are RemoteFiles')
    def exec(self, command: str, *, timeout: float | None = DEFAULT_EXEC_TIMEOUT, cwd: str | None = None,
             env: dict[str, str] | None = None, on_output: OutputCallback | None = None) -> ExecResult:
        """Run ``command`` with /bin/sh in the sandbox; ``on_output`` streams output as it comes."""
        body = {"command": command, "timeout": timeout, "cwd": cwd, "env": env or {}}
        wait = None if timeout is None else max(timeout, 0) + self._client.timeout
        if on_output is not None:
            if self._closed:
                raise errors.SandboxStateError(f"sandbox {self.id} is closed")
            r = self._client.exec_stream(self.id, body, on_output, wait)
        else:
            r = self._call("POST", "/exec", body, timeout=wait)
        return ExecResult.from_wire(r)

    def spawn(self, command: str, *, cwd: str | None = None, env: dict[str, str] | None = None) -> RemoteProcess:
        p = self._call("POST", "/spawn", {"command": command, "cwd": cwd, "env": env or {}})
        return RemoteProcess(self, p["pid"], p["log"], p["command"])

    def processes(self) -> builtins.list[RemoteProcess]:
        return [RemoteProcess(self, p["pid"], p["log"], p["command"])
                for p in self._call("GET", "/processes", idempotent=True)]

    # jobs
    def start(self, command: str, *, cwd: str | None = None, env: dict[str, str] | None = None,
              timeout: float | None = None, stdin: bool = False, tag: str | None = None) -> JobInfo:
        """Start ``command`` with /bin/sh and return at once; its output waits in the sandbox for ``output``."""
        body = {"command": command, "cwd": cwd, "env": env or {}, "timeout": timeout, "stdin": bool(stdin), "tag": tag}
        return JobInfo.from_wire(self._call("POST", "/jobs", body))

    def start_terminal(self, command: str, size: tuple[int, int], *, cwd: str | None = None,
                       env: dict[str, str] | None = None, timeout: float | None = None,
                       tag: str | None = None) -> JobInfo:
        """``start`` on a new terminal of ``size`` (rows, cols), as the local one: its output comes as the one
        stream "pty", ``send_input`` types at it, ``resize`` sets its size."""
        body = {"command": command, "cwd": cwd, "env": env or {}, "timeout": timeout, "stdin": True, "tag": tag,
                "pty": [int(size[0]), int(size[1])]}
        return JobInfo.from_wire(self._call("POST", "/jobs", body))

    def resize(self, pid: int, size: tuple[int, int]) -> None:
        """Set the (rows, cols) of the terminal of a job ``start_terminal`` made."""
        self._call("POST", f"/jobs/{pid}/resize", {"size": [int(size[0]), int(size[1])]}, idempotent=True)

    def jobs(self) -> builtins.list[JobInfo]:
        """The jobs ``start`` made that run, or ended but whose end ``output`` has not delivered yet."""
        return [JobInfo.from_wire(j) for j in self._call("GET", "/jobs", idempotent=True)]

    def output(self, pid: int, offsets: tuple[int, int] | None = None, *, follow: bool = True
               ) -> Iterator[JobOutput | JobEnd | None]:
        """A job's output from absolute ``offsets`` (None: the oldest kept); None items are heartbeats, JobEnd last.

        Like the local one it asks for nothing until iterated; closing it early leaves the job running.
        """
        if self._closed:
            raise errors.SandboxStateError(f"sandbox {self.id} is closed")
        body = {"offsets": None if offsets is None else [int(offsets[0]), int(offsets[1])], "follow": bool(follow)}
        with contextlib.closing(self._client.stream(self._path(f"/jobs/{pid}/output"), body,
                                                    self._client.timeout)) as frames:
            for item in frames:
                if "stream" in item:
                    yield JobOutput.from_wire(item)
                elif item.get("heartbeat"):
                    yield None
                elif "end" in item:
                    yield JobEnd.from_wire(item["end"])
                    return
                elif item.get("running"):
                    return
        raise ConnectionLost(f"the server at {self._client.url} ended the output of job {pid} without its end")

    def tail(self, pid: int, size: int = 64 << 10) -> builtins.list[JobOutput]:
        """The last ``size`` bytes of each of a job's streams, left for ``output`` (its end too): a look, not a read."""
        return [JobOutput.from_wire(o) for o in self._call("GET", f"/jobs/{pid}/tail", params={"size": size},
                                                           idempotent=True)]

    def discard(self, pid: int, offsets: tuple[int, int]) -> None:
        """Let the keeper drop a job's buffered output below ``offsets`` (never to be read again)."""
        self._call("POST", f"/jobs/{pid}/discard", {"offsets": [int(offsets[0]), int(offsets[1])]}, idempotent=True)

    def send_input(self, pid: int, data: bytes) -> None:
        """Write to a job's stdin (BrokenPipeError if it is closed or the job was started without one)."""
        view = memoryview(bytes(data))
        for at in range(0, max(len(view), 1), INPUT_PIECE):  # nothing: still one request (is there such a job?)
            self._call("POST", f"/jobs/{pid}/input", content=bytes(view[at:at + INPUT_PIECE]))

    def close_input(self, pid: int) -> None:
        """Close a job's stdin (EOF); idempotent."""
        self._call("POST", f"/jobs/{pid}/close-input", idempotent=True)

    def signal(self, pid: int, sig: int) -> None:
        """Send ``sig`` to the process group of a job (or of a spawned process)."""
        self._call("POST", f"/jobs/{pid}/signal", {"signal": int(sig)})

    # snapshots
    def snapshot(self, memory: bool = False, *, labels: dict[str, str] | None = None) -> RemoteSnapshot:
        return _snapshot(self._client, self._call("POST", "/snapshot", {"memory": memory, "labels": labels or {}}))

    def fork(self, n: int = 1, *, memory: bool = True, ttl: float | None = DEFAULT_TTL) -> builtins.list[RemoteSandbox]:
        """``n`` sandboxes that continue from this instant, on its server (a Pool's: spread, ``remote.spread``), each
        with a deadline ``ttl`` from now (``agentenv.Sandbox.fork``'s)."""
        count = fork_count(n)
        check_ttl(ttl)
        if self._client.spread is not None:
            return self._client.spread(self, count, bool(memory), ttl)
        return self.fork_here(count, memory=memory, ttl=ttl)

    def fork_here(self, n: int, *, memory: bool = True, ttl: float | None = DEFAULT_TTL) -> builtins.list[RemoteSandbox]:
        """``n`` children on this sandbox's server (QuotaExceeded when it lacks room for them all)."""
        return [self._client.sandbox_of(info)
                for info in self._call("POST", "/fork", {"count": n, "memory": bool(memory), "ttl": check_ttl(ttl)})]

    def pause(self) -> RemoteSnapshot:
        return _snapshot(self._client, self._call("POST", "/pause"))

    def resume(self) -> None:
        self._info = SandboxInfo.from_wire(self._call("POST", "/resume"))

    def close(self) -> None:
        """Remove the sandbox on the server; idempotent."""
        if self._closed:
            return
        with contextlib.suppress(SandboxNotFound):
            self._client.request("DELETE", self._path(), idempotent=True)
        self._closed = True


def _network_body(network: bool | Network | Mapping[str, Any] | None) -> bool | dict[str, list[str]]:
    """``network`` of ``Sandbox.create`` as the server takes it: a bool, or ``{allow_out, deny_out}``, its shape
    checked as the local API checks it (``netpolicy.asked``); the server checks the entries."""
    lists = netpolicy.asked(network)
    if lists is None or network is True:
        return lists is not None
    return {"allow_out": lists[0], "deny_out": lists[1]}


class SandboxAPI:
    """``client.Sandbox``: the class methods of ``agentenv.Sandbox``, on one server."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def create(self, image: str = DEFAULT_IMAGE, *, cpus: float = 1.0, memory: str | int = "1g", pids: int = 512,
               disk: str | int | None = DEFAULT_DISK, network: bool | Network | Mapping[str, Any] = False,
               env: dict[str, str] | None = None, workdir: str | None = None, ttl: float | None = DEFAULT_TTL,
               labels: dict[str, str] | None = None, share_memory: bool | None = False) -> RemoteSandbox:
        """A sandbox on the server, as ``agentenv.Sandbox.create`` makes one (``network``: False, True, or
        outbound rules: a ``Network`` or a mapping with ``allow_out`` / ``deny_out``; ``share_memory`` None: where
        the server's host can)."""
        body = {"image": image, "cpus": cpus, "memory": memory, "pids": pids, "disk": disk,
                "network": _network_body(network),
                "env": env or {}, "workdir": workdir, "ttl": check_ttl(ttl), "labels": labels or {}}
        if share_memory is not False:  # sent only when asked for: a server from before the option refuses it
            body["share_memory"] = share_memory
        return self._client.sandbox_of(self._client.request("POST", "/v1/sandboxes", body))

    def restore(self, snapshot: SnapshotLike | str, *, labels: dict[str, str] | None = None,
                ttl: float | None = DEFAULT_TTL) -> RemoteSandbox:
        sid = snapshot if isinstance(snapshot, str) else snapshot.id
        info = self._client.request("POST", f"/v1/snapshots/{sid}/restore", {"labels": labels or {}, "ttl": check_ttl(ttl)})
        return self._client.sandbox_of(info)

    def get(self, sandbox_id: str) -> RemoteSandbox:
        return self._client.sandbox_of(self._client.request("GET", f"/v1/sandboxes/{sandbox_id}", idempotent=True))

    def list(self) -> list[RemoteSandbox]:
        return [self._client.sandbox_of(i) for i in self._client.request("GET", "/v1/sandboxes", idempotent=True)]


class SnapshotAPI:
    """``client.Snapshot``: ``get`` and ``list`` of ``agentenv.Snapshot``, on one server."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def get(self, snapshot_id: str) -> RemoteSnapshot:
        return _snapshot(self._client, self._client.request("GET", f"/v1/snapshots/{snapshot_id}", idempotent=True))

    def list(self) -> list[RemoteSnapshot]:
        return [_snapshot(self._client, i) for i in self._client.request("GET", "/v1/snapshots", idempotent=True)]
