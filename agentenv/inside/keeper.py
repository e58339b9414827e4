"""The keeper: PID 1 of every sandbox, serving exec, spawn and files over a unix socket. (It was called the
agent before the name went to the LLM agent, ``rollout/agent.py``; its socket keeps its name, ``agent.sock``:
sandboxes paused and snapshots taken before then listen there, ``agentenv.host.keeper_start``.)

It runs inside the container with the image's own python3 and the standard library only, so any
image with python3 works. The host reaches it at ``/proc/<pid>/root/dev/agentenv/agent.sock``,
which avoids ``docker exec``'s round trip, and because the keeper *is* the container's init, a CRIU
snapshot carries every job, its buffered output and the listening socket along.

The keeper is seven files, sent into the sandbox as one (``agentenv.host.keeper_start`` joins them in this order):
``frames`` (the wire, shared with the host), ``users`` (the image's accounts), ``pty`` (terminals), ``jobs``
(commands and their output), ``files`` (the file calls),
``tunnel`` (ports reached from the host, and host endpoints forwarded in) and this one, which answers requests and runs the keeper as a sandbox's init.

Both ends treat the other as untrusted: a process in the sandbox can replace the socket with its own
server, or connect to the keeper itself (so ``reroot``, which re-executes the keeper with the argv it is
given, is refused unless the peer is outside the sandbox's pid namespace: the host). Every frame is capped,
files are streamed rather than held in memory, and the keeper survives what its sandbox can throw at it:
SIGTERM/SIGINT from inside, running out of pids (it answers an error instead of dying), ptrace (it is not
dumpable), memory pressure (its children get the highest OOM score, so the kernel picks them first).
"""

from __future__ import annotations

import _socket
import _thread
import errno
import os
import struct
import sys
import time

from agentenv.inside.files import check_own, fs, send_file, write_stream
from agentenv.inside.frames import (
    SMALL_BLOB,
    _recv_exact,
    drain,
    recv_header,
    send_frame,
    send_parts,
    suppress,
)
from agentenv.inside.jobs import HEARTBEAT, INPUT_TIMEOUT, MAX_OUTPUT, Jobs, Starved, close_stdin
from agentenv.inside.pty import resize
from agentenv.inside.tunnel import accept_forward, listen, open_tunnel
from agentenv.inside.users import AsAccount, UnknownUser, account

TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal as _signal  # no stub for _signal: its names are signal's
    import socket
    from typing import Any
else:
    import _signal

SOCKET_DIR = "/dev/agentenv"  # on the sandbox's private /dev tmpfs: saved with the processes
SOCKET_PATH = SOCKET_DIR + "/agent.sock"
LOG_DIR = SOCKET_DIR + "/proc"
OWN_DIRS = (SOCKET_DIR, "/.agentenv")  # the keeper's own files: the file API refuses to write there
_PR_SET_DUMPABLE = 4
_PR_SET_MEMORY_MERGE = 67


class Keeper(Jobs):
    """The sandbox's init: its jobs (``Jobs``), and the handlers of the requests its connections bring."""

    def __init__(self, log_dir: str = LOG_DIR, own_dirs: tuple[str, ...] = OWN_DIRS) -> None:
        super().__init__(log_dir)
        self.own_dirs = own_dirs
        self.conns: set[_socket.socket] = set()
        self.socket_path = ""  # where main listens
        self.tunnels: set[_socket.socket] = set()  # the sandbox ends of the host's tunnels to its ports (and forwards')
        self.listeners: dict[int, socket.socket] = {}  # the sandbox's ports forwarded to the host, by port

    def serve(self, conn: _socket.socket, starved: bool = False) -> None:
        """Answer requests on one connection until the host closes it (registered by ``accept``).

        ``starved``: no thread could be started for it, so it runs on the accept loop: one request
        that needs no new thread or process, under a short deadline.
        """
        try:
            while True:
                header, blen = recv_header(conn)
                if header.get("op") == "write":
                    blob = b""
                elif blen <= SMALL_BLOB:
                    blob = _recv_exact(conn, blen) if blen else b""
                else:
                    drain(conn, blen)
                    send_frame(conn, {"error": "BadRequest", "message": f"a {header.get('op')!r} request "
                                                                         "carries no data"})
                    continue
                if starved and header.get("op") in ("exec", "spawn", "start", "tunnel", "forward"):
                    drain(conn, blen)
                    self._refuse_starved(conn, "cannot start a thread to serve it")
                    return
                self.handle(conn, header, blob, blen)
                if starved:
                    return
        except (ConnectionError, OSError, ValueError):
            pass
        finally:
            with self.lock:
                self.conns.discard(conn)
                self.closing.discard(conn)
            conn.close()

    @staticmethod
    def _refuse_starved(conn: _socket.socket, why: str) -> None:
        send_frame(conn, {"error": "SandboxError", "message": f"the sandbox is out of processes: {why}",
                          "fix": "kill processes in the sandbox (or give it a higher pids limit), then retry"})

    def handle(self, conn: _socket.socket, h: dict[str, Any], blob: bytes, blen: int = 0) -> None:
        op = h.get("op")
        try:
            if op == "write":  # the blob is still on the socket: it streams to the file
                try:
                    path = check_own(str(h["path"]), self.own_dirs)
                    who = as_account(h)
                    who.__enter__()  # before the bytes are read: a refusal drains them
                except BaseException:
                    drain(conn, blen)
                    raise
                try:
                    write_stream(path, conn, blen, int(h.get("mode", 0o644)), h.get("metadata"))
                finally:
                    who.__exit__()
                send_frame(conn, {"ok": True})
            elif op == "account":
                send_frame(conn, {"account": account(str(h["name"])).wire()})
            elif op == "ping":
                not_dumpable()  # again: a restore from a snapshot may have brought the process back dumpable
                merge_memory()  # and without its PR_SET_MEMORY_MERGE
                send_frame(conn, {"ok": True, "pid": os.getpid()})
            elif op == "exec":  # start the job, or attach to the one a closed connection left behind
                with self.lock:
                    job_id = self.keys.get(h.get("key", ""))
                if job_id is None:
                    job_id = self.start_job(h).id
                send_frame(conn, {"job": job_id, "beat": HEARTBEAT})
                self.wait(conn, job_id, list(h.get("offsets", [0, 0])), bool(h.get("stream")))
            elif op == "spawn":
                with self.lock:
                    done = self.replies.get(h.get("key", ""))
                send_frame(conn, done if done is not None else self.spawn(h))
            elif op == "procs":
                with self.lock:
                    table = {str(pid): dict(v) for pid, v in self.spawned.items()}
                send_frame(conn, {"procs": table})
            elif op == "kill":
                pid, sig = int(h["pid"]), int(h.get("signal", _signal.SIGTERM))
                if pid in self.spawned or pid in self.started:
                    os.killpg(pid, sig)  # spawn and start make it a group leader: the shell and what it started
                else:
                    os.kill(pid, sig)
                send_frame(conn, {"ok": True})
            elif op == "start":  # a job that runs on its own; attach reads its output
                send_frame(conn, self.start_job(h, listed=True).listing())
            elif op == "attach":
                job = self.started_job(h)
                offsets = h.get("offsets")
                with job.cond:
                    at = list(job.base) if offsets is None else [max(int(offsets[i]), job.base[i]) for i in (0, 1)]
                send_frame(conn, {"job": job.id, "beat": HEARTBEAT, "offsets": at, "pty": job.tty is not None})
                self.wait(conn, job.id, at, True, bool(h.get("follow", True)))
            elif op == "jobs":
                with self.lock:
                    listed = [j.listing() for j in self.started.values() if not j.handing]
                send_frame(conn, {"jobs": listed})
            elif op == "tail":  # the last bytes of a job's output, left in place (and its end with it)
                job = self.started_job(h)
                size = max(0, min(int(h["size"]), MAX_OUTPUT))
                with job.cond:
                    parts: list[bytes | bytearray | memoryview] = [
                        bytes(job.out[i][len(job.out[i]) - size:]) if size else b"" for i in (0, 1)]
                    at = [job.base[i] + len(job.out[i]) - len(parts[i]) for i in (0, 1)]
                send_parts(conn, {"at": at, "stdout_len": len(parts[0]), "pty": job.tty is not None}, parts)
            elif op == "resize":  # a job's terminal (``pty``)
                resize(self.started_job(h), h.get("pty"))
                send_frame(conn, {"ok": True})
            elif op == "discard":
                self.discard(self.started_job(h), list(h["offsets"]))
                send_frame(conn, {"ok": True})
            elif op == "input":
                job = self.started_job(h)
                try:
                    self.write_input(conn, job, str(h.get("key", "")), blob,
                                     min(INPUT_TIMEOUT, max(0.0, float(h.get("timeout", INPUT_TIMEOUT)))))
                except (BrokenPipeError, TimeoutError) as e:  # the job's pipe, not this connection
                    send_frame(conn, {"error": type(e).__name__, "errno": e.errno, "message": str(e)})
                else:
                    send_frame(conn, {"ok": True})
            elif op == "close_stdin":
                job = self.started_job(h)
                if not job.stdin_lock.acquire(timeout=INPUT_TIMEOUT):
                    raise TimeoutError(f"a write to the stdin of job {job.pid} is still blocked")
                try:
                    close_stdin(job)
                finally:
                    job.stdin_lock.release()
                send_frame(conn, {"ok": True})
            elif op == "fs":
                with as_account(h):
                    reply = fs(h, self.own_dirs)
                send_frame(conn, reply)
            elif op == "read":
                with as_account(h):
                    send_file(conn, h["path"])
            elif op == "reroot":  # a fork gave this (pooled) sandbox another root: run from it, as a new keeper
                if peer_pid(conn) != 0:  # sent from inside: the sandbox's own program would become its keeper
                    raise PermissionError(errno.EPERM, "reroot is the host's request alone: refused")
                argv, env = [str(a) for a in h["argv"]], {**os.environ, **{str(k): str(v) for k, v in h["env"].items()}}
                os.makedirs(str(h["cwd"]), exist_ok=True)  # as runc makes a missing working folder
                os.chdir(str(h["cwd"]))
                os.unlink(self.socket_path)  # a connect from now on reaches the new keeper, or waits for it
                send_frame(conn, {"ok": True})
                os.execve(sys.executable, argv, env)  # what ran from the old root (interpreter, modules) is gone
            elif op == "tunnel":  # the host's connection to a port of the sandbox: raw bytes after the answer
                if peer_pid(conn) != 0:
                    raise PermissionError(errno.EPERM, "tunnel is the host's request alone: refused")
                open_tunnel(conn, int(h["port"]), self.tunnels)
                raise ConnectionError("tunnel closed")  # the connection carried raw bytes: no frame may follow
            elif op in ("listen", "forward"):  # a host endpoint forwarded in (agentenv.sandbox.forward)
                if peer_pid(conn) != 0:  # from inside: a process of the sandbox would open its own way out
                    raise PermissionError(errno.EPERM, f"{op} is the host's request alone: refused")
                port = int(h["port"])
                with self.lock:
                    listen(port, self.listeners)  # again after a reroot or a fresh start: it left no listener
                    server = self.listeners[port]
                if op == "listen":
                    send_frame(conn, {"ok": True})
                else:  # answered once a process of the sandbox connects: raw bytes after the answer
                    accept_forward(conn, server, self.tunnels)
                    raise ConnectionError("forward closed")
            elif op == "quiesce":
                self.quiesce(conn)
                send_frame(conn, {"ok": True})
                raise ConnectionError("quiesced")  # the host waits for this close before CRIU runs
            else:
                send_frame(conn, {"error": "BadRequest", "message": f"unknown op {op!r}"})
        except (ConnectionError, BrokenPipeError):
            raise
        except UnknownUser as e:
            send_frame(conn, {"error": "UnknownUser", "message": str(e),
                              "fix": "name an account of the sandbox's image (its /etc/passwd), or add one"})
        except Starved as e:
            send_frame(conn, {"error": "SandboxError", "message": str(e),
                              "fix": "kill processes in the sandbox (or give it a higher pids limit), then retry"})
        except (KeyError, TypeError) as e:
            send_frame(conn, {"error": "BadRequest", "message": f"missing or malformed field {e}"})
        except ValueError as e:
            send_frame(conn, {"error": "ValueError", "message": str(e)})
        except OSError as e:
            send_frame(conn, {"error": type(e).__name__, "errno": e.errno, "message": str(e)})
        except MemoryError:
            send_frame(conn, {"error": "SandboxError", "message": "the keeper ran out of memory serving the request",
                              "fix": "free memory in the sandbox (kill processes, delete /dev/shm files)"})

    def quiesce(self, keep: _socket.socket) -> None:
        """Close every other host connection, so that CRIU finds no socket with a peer outside."""
        with self.lock:
            others = [c for c in self.conns if c is not keep]
            self.closing.update(others)
            jobs = list(self.jobs.values())
        for c in others + list(self.tunnels):
            with suppress(OSError):
                c.shutdown(_socket.SHUT_RDWR)
        for job in jobs:
            with job.cond:
                job.cond.notify_all()
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            with self.lock:
                if not (self.conns - {keep}):
                    break
            time.sleep(0.001)


class _AsRoot:
    """What a request that names no account (or root) runs as: the keeper's own ids, unchanged."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def as_account(h: dict[str, Any]) -> AsAccount | _AsRoot:
    """The ids a file request runs under: those of the account ``h["user"]`` names (UnknownUser if the
    image has none), root's for root or no name."""
    name = h.get("user")
    acct = None if name is None else account(str(name))
    return _AsRoot() if acct is None or acct.uid == 0 else AsAccount(acct)


def peer_pid(conn: _socket.socket) -> int:
    """The pid of the process that connected ``conn``, as the keeper's pid namespace numbers it: 0 for one outside
    that namespace (the host), which no process of the sandbox can be (it may not make pid namespaces)."""
    return int(struct.unpack("3i", conn.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, 12))[0])



_prctl: list[Any] = []
_merging: list[bool] = []  # [True] in a sandbox made with share_memory (kept through a CRIU restore)


def not_dumpable() -> None:
    """PR_SET_DUMPABLE 0: no process of the sandbox can ptrace the keeper, read its memory or its /proc files.

    Best effort: an image's python3 without ctypes still runs the keeper.
    """
    with suppress(Exception):
        if not _prctl:
            import ctypes

            _prctl.append(ctypes.CDLL(None, use_errno=True).prctl)
        _prctl[0](_PR_SET_DUMPABLE, 0, 0, 0, 0)


def merge_memory() -> None:
    """PR_SET_MEMORY_MERGE 1 where the host asked for it (a sandbox made with ``share_memory``): KSM may merge any
    page of the keeper and of every process it starts with identical pages of other flagged processes. The host
    checks the flag took (``agentenv.host.ksm``), so a failure here is not silent. Again on every ping:
    CRIU restores each mapping's mergeable bit but not the process's flag, which new mappings need."""
    if os.environ.pop("AGENTENV_SHARE_MEMORY", None) == "1":
        _merging.append(True)
    if not _merging:
        return
    with suppress(Exception):
        if not _prctl:
            import ctypes

            _prctl.append(ctypes.CDLL(None, use_errno=True).prctl)
        _prctl[0](_PR_SET_MEMORY_MERGE, 1, 0, 0, 0)


def main(path: str = SOCKET_PATH) -> None:
    """Serve forever on ``path`` (another path is for running the keeper outside a sandbox, in tests)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if path == SOCKET_PATH:  # root's alone: a command run as another account must not reach the keeper (root)
        os.chmod(SOCKET_DIR, 0o700)
    if path == SOCKET_PATH and not os.path.isdir("/dev/shm"):  # POSIX shared memory lives on /dev's tmpfs
        os.makedirs("/dev/shm")
        os.chmod("/dev/shm", 0o1777)
    if os.path.exists(path):
        os.unlink(path)
    for fd in (0, 1, 2):  # each command's stdio is set up by number: none of them may be a pipe's number
        try:
            os.fstat(fd)
        except OSError:
            os.open("/dev/null", os.O_RDWR)  # the lowest free number: this one
    here = os.path.dirname(path)
    keeper = Keeper(log_dir=os.path.join(here, "proc"), own_dirs=OWN_DIRS if path == SOCKET_PATH else (here,))
    not_dumpable()
    merge_memory()
    # PID 1 of its namespace gets only the signals it handles from inside: handle these, and do nothing.
    # (A handler, not SIG_IGN: handlers are reset by exec, an ignored signal would stay ignored in every
    # command.) The host stops a sandbox with SIGKILL, through runc.
    for sig in (_signal.SIGTERM, _signal.SIGINT, _signal.SIGHUP):
        _signal.signal(sig, _ignore)
    server = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    server.bind(path)
    keeper.socket_path = path
    server.listen(128)
    _thread.start_new_thread(keeper.reap_forever, ())
    while True:  # nothing a request does may end this loop: the sandbox lives as long as it runs
        try:
            conn = _socket.socket(fileno=server._accept()[0])  # type: ignore[attr-defined]
        except OSError:
            time.sleep(0.01)
            continue
        try:
            with keeper.lock:
                keeper.conns.add(conn)  # before the thread starts: quiesce must never miss a connection
            try:
                _thread.start_new_thread(keeper.serve, (conn,))
            except RuntimeError:  # can't start new thread: out of pids or memory
                conn.settimeout(2.0)
                keeper.serve(conn, starved=True)
        except Exception:  # noqa: BLE001 - e.g. MemoryError: drop this connection, keep serving
            with suppress(Exception):
                conn.close()
            time.sleep(0.01)


def _ignore(signum: int, frame: Any) -> None:
    """The keeper's answer to SIGTERM, SIGINT and SIGHUP from inside the sandbox: none."""


if __name__ == "__main__":
    main(*sys.argv[1:2])
