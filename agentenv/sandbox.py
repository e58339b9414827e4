"""Sandboxes: containers you exec in, snapshot, fork, pause and restore (DESIGN.md §3).

A sandbox is a runc container over a Docker image (see ``runtime``) whose PID 1 is the agent
(see ``agent``). Its record lives in ``<home>/sandboxes/<id>/sandbox.json``, so any process can
list, reattach to or restore it; state changes take a file lock, so two processes never snapshot
or close the same sandbox at once.

The record names the agent by pid *and* start time; each Sandbox object pins it with a pidfd and
checks, before every connection, that the process it reaches is still that agent. A pid number that
the kernel has since given to another sandbox's agent therefore never leads there: the handle follows
the record (another handle may have paused and resumed the sandbox) or fails with SandboxLost.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import fcntl
import json
import logging
import os
import posixpath
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from agentenv import agent, images, store
from agentenv.api import (
    DEFAULT_EXEC_TIMEOUT,
    DEFAULT_IMAGE,
    MAX_FORK,
    ExecResult,
    Limits,
    OutputCallback,
    ProcessInfo,
    SandboxInfo,
    SnapshotLike,
    State,
)
from agentenv.channel import Channel, Gate, Root
from agentenv.config import parse_size, paths
from agentenv.errors import (
    AgentEnvError,
    CheckpointError,
    ConnectionLost,
    SandboxError,
    SandboxLost,
    SandboxNotFound,
    SandboxStateError,
)
from agentenv.runtime import (
    AgentProcess,
    Container,
    ContainerSpec,
    copy_tree,
    dump_stats,
    proc_start_time,
    protect_agent,
)
from agentenv.store import Snapshot

log = logging.getLogger("agentenv")
START_TIMEOUT = 30.0  # seconds a new or restored agent has to answer its first ping
QUIESCE_TIMEOUT = 15.0  # seconds the agent has to close the host's connections before a memory snapshot
_gates: dict[str, Gate] = {}
_gates_lock = threading.Lock()


def _gate(sandbox_id: str) -> Gate:
    """One gate per sandbox per process, shared by every Sandbox object of that id."""
    with _gates_lock:
        return _gates.setdefault(sandbox_id, Gate())


class Process:
    """A background process started with ``Sandbox.spawn``; it survives snapshots and forks."""

    def __init__(self, sandbox: Sandbox, pid: int, log: str, command: str) -> None:
        self.sandbox, self.pid, self.log, self.command = sandbox, pid, log, command

    def __repr__(self) -> str:
        return f"Process(pid={self.pid}, command={self.command!r})"

    @property
    def exit_code(self) -> int | None:
        """None while it runs, else its exit code (128 + signal when killed)."""
        reply, _ = self.sandbox._channel.call({"op": "procs"})
        entry = reply["procs"].get(str(self.pid))
        return None if entry is None else entry["exit_code"]

    def output(self) -> str:
        """Everything it wrote so far (stdout and stderr interleaved)."""
        return self.sandbox.read_file(self.log).decode(errors="replace")

    def kill(self, signal: int = 9) -> None:
        self.sandbox._channel.call({"op": "kill", "pid": self.pid, "signal": signal})

    def info(self) -> ProcessInfo:
        return ProcessInfo(pid=self.pid, log=self.log, command=self.command, exit_code=self.exit_code)

    def wait(self, timeout: float = 60.0) -> int:
        deadline = time.monotonic() + timeout
        while (code := self.exit_code) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self!r} still running after {timeout} s")
            time.sleep(0.02)
        return code


class Sandbox:
    """An isolated Linux environment with fast snapshot, fork, pause and restore."""

    def __init__(self, record: dict[str, Any]) -> None:
        self._rec = record
        self.id: str = record["id"]
        self._container = Container(f"ae-{self.id}", paths().sandboxes / self.id, paths().runc_root)
        self._channel = Channel(self._root, _gate(self.id))
        self._agent: AgentProcess | None = None  # the pinned agent, once a call has needed it
        self._starting = False  # in _start: the record on disk does not name the new agent yet

    # --- creation ------------------------------------------------------------------------------

    @classmethod
    def create(cls, image: str = DEFAULT_IMAGE, *, cpus: float = 1.0, memory: str | int = "1g", pids: int = 512,
               network: bool = False, env: dict[str, str] | None = None, workdir: str | None = None,
               ttl: float | None = None, labels: dict[str, str] | None = None) -> Sandbox:
        """Start a sandbox from a Docker image: no network, CPU/memory/pids limits, few capabilities."""
        if not isinstance(cpus, int | float) or cpus <= 0:
            raise ValueError(f"cpus must be a positive number, got {cpus!r}")
        if not isinstance(pids, int) or pids < 8:
            raise ValueError(f"pids must be an integer >= 8, got {pids!r}")
        if ttl is not None and ttl <= 0:
            raise ValueError(f"ttl must be positive seconds, got {ttl!r}")
        limits = Limits(cpus=float(cpus), memory=parse_size(memory), pids=pids)
        info = images.resolve(image)
        merged = dict(e.split("=", 1) for e in info.env if "=" in e)
        merged.update(env or {})
        spec = ContainerSpec(image_id=info.id, layers=info.layers, env=[f"{k}={v}" for k, v in merged.items()],
                             workdir=workdir or info.workdir, limits=limits, network=network)
        sb = cls._new(spec, image=image, ttl=ttl, labels=labels, parent=None)
        sb._boot(None)
        return sb

    @classmethod
    def _new(cls, spec: ContainerSpec, image: str, ttl: float | None, labels: dict[str, str] | None,
             parent: str | None) -> Sandbox:
        now = time.time()
        rec = {"id": store.new_id("sb"), "image": image, "spec": spec.to_json(), "state": "creating",
               "created_at": now, "expires_at": now + ttl if ttl else None, "labels": dict(labels or {}),
               "init_pid": None, "paused_snapshot": None, "parent_snapshot": parent}
        sb = cls(rec)
        sb._container.bundle.mkdir(parents=True)
        sb._save()
        return sb

    def _boot(self, snap: Snapshot | None) -> None:
        """Start a new sandbox, fresh or from a snapshot; on failure nothing of it is left."""
        try:
            self._start(snap)
        except BaseException:
            self._destroy()
            raise

    def _start(self, snap: Snapshot | None) -> None:
        """Prepare the bundle, start the agent (or restore every process) and wait until it answers.

        On failure the container is torn down but the record stays: the caller decides its fate.
        """
        try:
            spec = self._spec()
            if not images.layers_present(spec.layers):  # e.g. the engine re-created its storage
                spec.layers = images.resolve(spec.image_id).layers
                self._rec["spec"] = spec.to_json()
            self._container.prepare(spec, fs_from=snap.fs_dir if snap else None)
            if snap is not None and snap.has_memory:
                pid = self._container.restore(snap.criu_dir, self._container.bundle / "criu-restore")
            else:
                pid = self._container.start()
            self._agent = None
            self._rec.update(init_pid=pid, init_start=proc_start_time(pid), state="running")
            protect_agent(pid)
            deadline = time.monotonic() + START_TIMEOUT
            self._starting = True
            try:
                with self._channel.connect(wait=START_TIMEOUT, through_gate=False) as s:
                    agent.send_frame(s, {"op": "ping"}, deadline=deadline)
                    agent.recv_frame(s, 0, deadline)
            finally:
                self._starting = False
            self._save()
        except BaseException:
            self._container.destroy()
            raise

    @classmethod
    def restore(cls, snapshot: SnapshotLike | str, *, labels: dict[str, str] | None = None) -> Sandbox:
        """A new sandbox from a snapshot, in any process, after dockerd restarts or the source is gone."""
        snap = snapshot if isinstance(snapshot, Snapshot) else Snapshot.get(
            snapshot if isinstance(snapshot, str) else snapshot.id)
        spec = ContainerSpec.from_json(snap.spec)
        sb = cls._new(spec, image=snap.labels.get("image", spec.image_id), ttl=None, labels=labels, parent=snap.id)
        sb._boot(snap)
        return sb

    # --- lookup -------------------------------------------------------------------------------

    @classmethod
    def get(cls, sandbox_id: str) -> Sandbox:
        try:
            rec = json.loads((paths().sandboxes / os.path.basename(sandbox_id) / "sandbox.json").read_text())
        except FileNotFoundError:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}") from None
        return cls(rec)

    @classmethod
    def list(cls) -> list[Sandbox]:
        """Every sandbox on this host, running or paused, oldest first."""
        found = []
        for d in paths().sandboxes.iterdir():
            with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
                found.append(cls(json.loads((d / "sandbox.json").read_text())))
        return sorted(found, key=lambda s: s.created_at)

    # --- properties ---------------------------------------------------------------------------

    def __repr__(self) -> str:
        return f"Sandbox(id={self.id!r}, state={self.state!r}, image={self.image!r})"

    @property
    def state(self) -> State:
        """'running', 'paused', 'closed', or 'lost' when its processes died behind our back."""
        self._reload()
        st = self.recorded_state
        if st == "running":
            runc = self._container.state()
            if runc is None or runc.get("status") not in ("running", "paused", "created"):
                return "lost"
        return st

    @property
    def recorded_state(self) -> State:
        """The state in the sandbox's record, without asking runc whether its processes still live."""
        return self._rec["state"]

    def exists(self) -> bool:
        """True while the sandbox is on this host (running or paused); False once closed."""
        return self._container.bundle.exists()

    def ping(self) -> None:
        """Ask the agent to answer; ConnectionLost (or another AgentEnvError) when it does not."""
        self._channel.call({"op": "ping"})

    def info(self, state: State | None = None) -> SandboxInfo:
        """What this sandbox is now (``state`` when the caller knows it, saving a runc call)."""
        return SandboxInfo(id=self.id, state=state or self.state, image=self.image,
                           created_at=self.created_at, expires_at=self.expires_at, labels=self.labels,
                           limits=self.limits)

    @property
    def image(self) -> str:
        return str(self._rec["image"])

    @property
    def created_at(self) -> float:
        return float(self._rec["created_at"])

    @property
    def labels(self) -> dict[str, str]:
        return dict(self._rec["labels"])

    @property
    def expires_at(self) -> float | None:
        return self._rec.get("expires_at")

    @property
    def limits(self) -> Limits:
        return self._spec().limits

    def set_ttl(self, ttl: float) -> None:
        """Extend (or shorten) the time to live, counted from now."""
        with self._locked():
            self._rec["expires_at"] = time.time() + ttl
            self._save()

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
                                "max_output": max_output(self._spec().limits.memory)}, on_output)
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

    def read_file(self, path: str) -> bytes:
        """A whole file (at most 1 GiB); the agent's own files are refused (PermissionError), its
        process logs excepted."""
        self.require_running()
        return self._channel.call({"op": "read", "path": _own_checked(_abs(path, self._spec().workdir), False)})[1]

    def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        """Write a whole file (at most 1 GiB) atomically, creating parent folders; the agent's own
        folders are refused (PermissionError)."""
        self.require_running()
        payload = data if isinstance(data, bytes) else data.encode() if isinstance(data, str) else bytes(data)
        if len(payload) > agent.MAX_FILE:
            raise ValueError(f"{len(payload)} bytes is over write_file's limit of {agent.MAX_FILE}")
        target = _own_checked(_abs(path, self._spec().workdir), True)
        self._channel.call({"op": "write", "path": target, "mode": mode}, payload)

    # --- snapshots ----------------------------------------------------------------------------

    def snapshot(self, memory: bool = False, *, labels: dict[str, str] | None = None) -> Snapshot:
        """Save the filesystem (and with ``memory=True`` every process) into the snapshot store."""
        with self._locked():
            self.require_running()
            return self._snapshot(memory, leave_running=True, labels=labels)

    def _snapshot(self, memory: bool, leave_running: bool, labels: dict[str, str] | None) -> Snapshot:
        snap_id = store.new_id("snap")
        with store.writing(snap_id) as folder:
            for attempt in range(3):
                with self._frozen(quiesce=memory):
                    shutil.rmtree(folder / "fs", ignore_errors=True)
                    copy_tree(self._container.upper, folder / "fs")
                    if not memory:
                        break
                    try:
                        self._container.checkpoint(folder / "criu", folder / "criu", leave_running=leave_running,
                                                   criu=os.environ.get("AGENTENV_CRIU"))
                        break
                    except CheckpointError as e:
                        # a host connection that another process opened in the meantime: quiesce again
                        if "unix" not in str(e).lower() or attempt == 2:
                            raise
                shutil.rmtree(folder / "criu", ignore_errors=True)
            snap = Snapshot(id=snap_id, parent_id=self._rec.get("parent_snapshot"), created_at=time.time(),
                            size_bytes=store.disk_usage(folder), has_memory=memory, sandbox_id=self.id,
                            spec=self._rec["spec"], labels={"image": self.image, **(labels or {})},
                            criu_stats=dump_stats(folder / "criu") if memory else {})
            store.write_meta(folder, snap)
        return snap

    @contextlib.contextmanager
    def _frozen(self, quiesce: bool) -> Iterator[None]:
        """Hold every process still (cgroup freezer); with ``quiesce``, first close the host's connections."""
        gate = self._channel.gate
        if quiesce:
            gate.shut()
        try:
            if quiesce:
                self._quiesce()
            try:
                self._container.freeze(True)
                yield
            finally:
                if self._container.freezer() is not None:
                    self._container.freeze(False)
        finally:
            if quiesce:
                gate.open()

    def _quiesce(self) -> None:
        """Have the agent close every host connection, within QUIESCE_TIMEOUT (a stopped agent never will)."""
        deadline = time.monotonic() + QUIESCE_TIMEOUT
        s = self._channel.connect(through_gate=False)  # the gate is shut: this is the one connection
        try:
            agent.send_frame(s, {"op": "quiesce"}, deadline=deadline)
            agent.recv_frame(s, 0, deadline)
            with contextlib.suppress(ConnectionError):
                agent.recv_frame(s, 0, deadline)  # returns only when the agent closed its end
        except TimeoutError:
            raise ConnectionLost(f"the sandbox agent did not get ready for a snapshot within {QUIESCE_TIMEOUT:g} s; "
                                 "nothing was saved and the sandbox was left running",
                                 fix="the agent may be stopped (traced) or starved of CPU; retry, or close the "
                                     "sandbox") from None
        finally:
            s.close()

    def fork(self, n: int = 1, *, memory: bool = True) -> builtins.list[Sandbox]:
        """``n`` independent sandboxes that continue from this instant; this one keeps running.

        With ``memory=False`` the children get this sandbox's files only (fresh processes): cheaper,
        and all an episode needs when its state lives in files.
        """
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_FORK:
            raise ValueError(f"fork count must be an integer in 1..{MAX_FORK}, got {n!r}")
        with self._locked():
            self.require_running()
            snap = self._snapshot(memory, leave_running=True, labels={"agentenv.kind": "fork"})
        try:
            with ThreadPoolExecutor(max_workers=n) as pool:
                futures = [pool.submit(Sandbox.restore, snap, labels=self.labels) for _ in range(n)]
            kids, errors = [], []
            for f in futures:
                try:
                    kids.append(f.result())
                except Exception as e:  # noqa: BLE001 - collected, re-raised below
                    errors.append(e)
            if errors:
                for k in kids:
                    k.close()
                raise errors[0]
            return kids
        finally:
            snap.delete(background=True)

    def pause(self) -> Snapshot:
        """Free the sandbox's CPU and memory; its whole state goes to the snapshot store."""
        with self._locked():
            self.require_running()
            snap = self._snapshot(True, leave_running=False, labels={"agentenv.kind": "pause"})
            self._container.destroy()
            shutil.rmtree(self._container.upper, ignore_errors=True)
            self._rec.update(state="paused", paused_snapshot=snap.id, init_pid=None, init_start=None)
            self._agent = None
            self._save()
            return snap

    def resume(self) -> None:
        """Bring a paused sandbox back where it was."""
        with self._locked():
            if self._rec["state"] != "paused":
                raise SandboxStateError(f"sandbox {self.id} is {self._rec['state']}, not paused")
            snap = Snapshot.get(self._rec["paused_snapshot"])
            for d in ("upper", "work"):
                shutil.rmtree(self._container.bundle / d, ignore_errors=True)
            try:
                self._start(snap)
            except BaseException:
                self._rec.update(state="paused", init_pid=None, init_start=None)
                self._agent = None
                self._save()
                raise
            self._rec["paused_snapshot"] = None
            self._save()
        snap.delete(background=True)

    # --- teardown -----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every process and remove the sandbox (its snapshots stay in the store); idempotent."""
        if not self._container.bundle.exists():
            self._rec["state"] = "closed"
            return
        with self._locked(allow_closed=True):
            paused = self._rec.get("paused_snapshot")
            self._destroy()
        if paused:
            with contextlib.suppress(Exception):
                Snapshot.get(paused).delete()

    def _destroy(self) -> None:
        self._container.destroy()
        self._agent = None
        self._rec["state"] = "closed"
        shutil.rmtree(self._container.bundle, ignore_errors=True)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @classmethod
    def reap_expired(cls) -> builtins.list[str]:
        """Pause every running sandbox past its TTL (its state is kept, not destroyed); returns their ids.

        One sandbox that cannot be paused (its agent stopped, say) is logged and skipped: it neither
        stalls the others (every step has a deadline) nor ends the round.
        """
        paused = []
        for sb in cls.list():
            exp = sb.expires_at
            try:
                if exp is not None and exp < time.time() and sb.state == "running":
                    sb.pause()
                    paused.append(sb.id)
            except AgentEnvError as e:
                log.warning("could not pause sandbox %s past its TTL: %s", sb.id, e)
        return paused

    # --- internals ----------------------------------------------------------------------------

    def _spec(self) -> ContainerSpec:
        return ContainerSpec.from_json(self._rec["spec"])

    def _root(self) -> Root:
        """The agent's root, for one connection, after checking that the process is the sandbox's agent.

        If the agent this object knew is gone, the record is read again: another handle (or process)
        may have paused, resumed or closed the sandbox. If the record still names the dead agent, the
        sandbox is lost (SandboxLost); a pid number reused by another process is never followed.
        """
        for _attempt in range(3):
            ref = self._agent
            pid = self._rec.get("init_pid")
            if ref is None or ref.pid != pid:
                ref = None
                if self._rec["state"] == "running" and pid:
                    with contextlib.suppress(OSError):
                        ref = AgentProcess(pid, self._rec.get("init_start"), self._container.cgroup)
                self._agent = ref
            if ref is not None:
                with contextlib.suppress(OSError):
                    return ref.root()
                self._agent = None
            if self._starting:
                raise SandboxError(f"the agent of sandbox {self.id} (pid {pid}) exited as it started",
                                   fix=f"check that the image has python3; runc's log: {self._container.bundle}/runc.log")
            seen = pid, self._rec.get("init_start")
            self._reload()
            self.require_running()
            if (self._rec.get("init_pid"), self._rec.get("init_start")) == seen:
                break
        raise SandboxLost(f"sandbox {self.id} is lost: its agent (pid {self._rec.get('init_pid')}) is gone",
                          fix="close it; restore one of its snapshots to go on from there")

    def _reload(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._rec = json.loads((self._container.bundle / "sandbox.json").read_text())
            return
        self._rec["state"] = "closed"

    def require_running(self) -> None:
        """SandboxStateError unless the sandbox is running (e.g. paused or closed)."""
        if self._rec["state"] != "running":
            self._reload()
        if self._rec["state"] != "running":
            raise SandboxStateError(f"sandbox {self.id} is {self._rec['state']}",
                                    fix="resume() a paused sandbox; a closed one is gone")

    def _save(self) -> None:
        path = self._container.bundle / "sandbox.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._rec))
        os.replace(tmp, path)

    @contextlib.contextmanager
    def _locked(self, allow_closed: bool = False) -> Iterator[None]:
        """An exclusive lock across processes for state changes; raises if the sandbox is gone."""
        try:
            fd = os.open(self._container.bundle / "lock", os.O_CREAT | os.O_RDWR, 0o600)
        except FileNotFoundError:
            raise SandboxNotFound(f"no sandbox {self.id!r} (closed?)") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._reload()
            if self._rec["state"] == "closed" and not allow_closed:
                raise SandboxStateError(f"sandbox {self.id} is closed")
            if self._rec["state"] == "running" and self._container.frozen():
                self._container.freeze(False)  # a snapshotter died holding it frozen; the lock is ours now
            yield
        finally:
            os.close(fd)


def max_output(memory: int) -> int:
    """Bytes of one command's output the agent keeps per stream: 64 MiB, or a sixteenth of the sandbox's
    memory when that is less (the agent holds them, in the sandbox's memory)."""
    return min(agent.MAX_OUTPUT, max(1 << 20, memory // 16))


def _dropped(n: int) -> str:
    """The visible marker for output past the agent's per-stream cap (``max_output``)."""
    return f"\n[agentenv: {n} more bytes of output were dropped]\n" if n else ""


def _own_checked(path: str, write: bool) -> str:
    """``path`` normalized (the path checked is the path sent), unless it is one of the agent's own files
    (PermissionError); reads of its process logs pass. The agent checks writes again, symlinks resolved."""
    norm = "/" + posixpath.normpath(path).lstrip("/")
    if not write and norm.startswith(agent.LOG_DIR + "/"):
        return norm
    for d in agent.OWN_DIRS:
        if norm == d or norm.startswith(d + "/"):
            raise PermissionError(errno.EACCES, f"{path} is in the sandbox agent's own folder {d}; "
                                                "the file API does not touch it")
    return norm


def _abs(path: str, workdir: str) -> str:
    """Absolute path inside the sandbox; relative ones are taken from the working directory."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise ValueError(f"path must be a non-empty string, got {path!r}")
    return path if path.startswith("/") else posixpath.join(workdir, path)
