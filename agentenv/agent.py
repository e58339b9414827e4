"""The in-sandbox agent: PID 1 of every sandbox, serving exec, spawn and files over a unix socket.

It runs inside the container with the image's own python3 and the standard library only, so any
image with python3 works. The host reaches it at ``/proc/<pid>/root/dev/agentenv/agent.sock``,
which avoids ``docker exec``'s round trip, and because the agent *is* the container's init, a CRIU
snapshot carries every job, its buffered output and the listening socket along.

Wire format, both ways: ``>II`` (header length, blob length), a JSON header, then raw bytes.
A job is addressed by id, so a client whose connection was closed (the host closes every connection
before a memory snapshot) reconnects and resumes from the byte offsets it already has.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from typing import Any

SOCKET_DIR = "/dev/agentenv"  # on the sandbox's private /dev tmpfs: saved with the processes
SOCKET_PATH = SOCKET_DIR + "/agent.sock"
LOG_DIR = SOCKET_DIR + "/proc"
JOB_ENV = "AGENTENV_JOB"
MAX_OUTPUT = 64 << 20  # bytes kept per stream of one job; the rest is counted, not kept
ABANDONED = 3600.0  # seconds a finished job's result waits for its caller
_HEAD = struct.Struct(">II")


# --- framing, shared with the host side ---------------------------------------------------------


def send_frame(sock: socket.socket, header: dict[str, Any], blob: bytes = b"") -> None:
    """Send one frame: JSON header plus raw bytes."""
    head = json.dumps(header, separators=(",", ":")).encode()
    sock.sendall(_HEAD.pack(len(head), len(blob)) + head + blob)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket) -> tuple[dict[str, Any], bytes]:
    """Receive one frame; raises ConnectionError when the peer closed."""
    hlen, blen = _HEAD.unpack(_recv_exact(sock, _HEAD.size))
    header = json.loads(_recv_exact(sock, hlen))
    return header, _recv_exact(sock, blen) if blen else b""


# --- jobs -------------------------------------------------------------------------------------


class Job:
    """One command run by exec: its process group, buffered output and exit status."""

    def __init__(self, job_id: int, proc: subprocess.Popen[bytes], timeout: float | None) -> None:
        self.id = job_id
        self.proc = proc
        self.pid = proc.pid
        self.started = time.monotonic()
        self.deadline = self.started + timeout if timeout else None
        self.out = [bytearray(), bytearray()]
        self.dropped = [0, 0]
        self.exit_code: int | None = None
        self.timed_out = False
        self.duration = 0.0
        self.done = False
        self.key = ""
        self.cond = threading.Condition()

    def result(self) -> dict[str, Any]:
        return {"exit_code": self.exit_code, "timed_out": self.timed_out, "duration": self.duration,
                "dropped": self.dropped}


class Agent:
    """Process table, reaper and request handlers of the sandbox's init."""

    def __init__(self, log_dir: str = LOG_DIR) -> None:
        self.log_dir = log_dir
        self.lock = threading.Lock()
        self.jobs: dict[int, Job] = {}
        self.spawned: dict[int, dict[str, Any]] = {}  # pid -> {"cmd", "exit_code", "log"}
        self.by_pid: dict[int, Job] = {}
        self.children: dict[int, subprocess.Popen[bytes]] = {}  # every child we started, until reaped
        self.next_id = 1
        self.child_started = threading.Event()
        self.conns: set[socket.socket] = set()
        self.closing: set[socket.socket] = set()
        self.keys: dict[str, int] = {}  # request key -> job id, until the result is delivered
        self.replies: OrderedDict[str, dict[str, Any]] = OrderedDict()  # spawn replies by request key

    # reaping: PID 1 collects every exit, its own jobs' and orphans' alike
    def reap_forever(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                self.child_started.wait(1.0)
                self.child_started.clear()
                continue
            code = os.waitstatus_to_exitcode(status)
            code = 128 - code if code < 0 else code
            with self.lock:
                popen = self.children.pop(pid, None)
                if popen is not None:
                    popen.returncode = code  # reaped here: Popen must never waitpid() a recycled pid
                job = self.by_pid.pop(pid, None)
                spawned = self.spawned.get(pid)
                if spawned is not None:
                    spawned["exit_code"] = code
            if job is not None:
                with job.cond:
                    job.exit_code = code
                    job.cond.notify_all()

    def _popen(self, header: dict[str, Any], stdout: Any, stderr: Any, job_id: int) -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        env.pop("AGENTENV_AGENT", None)
        env.update(header.get("env") or {})
        env[JOB_ENV] = str(job_id)
        proc = subprocess.Popen(
            ["/bin/sh", "-c", header["cmd"]], cwd=header.get("cwd") or None, env=env,
            stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, start_new_session=True,
            close_fds=True)
        self.children[proc.pid] = proc  # callers hold self.lock
        self.child_started.set()
        return proc

    def start_job(self, header: dict[str, Any]) -> Job:
        with self.lock:
            self._forget_abandoned()
            job_id = self.next_id
            self.next_id += 1
            proc = self._popen(header, subprocess.PIPE, subprocess.PIPE, job_id)
            job = Job(job_id, proc, header.get("timeout"))
            self.jobs[job_id] = job
            job.key = header.get("key", "")
            self.keys[job.key] = job_id
            self.by_pid[proc.pid] = job
        threading.Thread(target=self._pump, args=(job,), daemon=True).start()
        return job

    def _forget_abandoned(self) -> None:
        """Drop results nobody came back for (their caller died) an hour after the job ended."""
        now = time.monotonic()
        for job in [j for j in self.jobs.values() if j.done and now - j.started - j.duration > ABANDONED]:
            self.jobs.pop(job.id, None)
            self.keys.pop(job.key, None)

    def _pump(self, job: Job) -> None:
        """Collect a job's output until it exits (or times out), then mark it done."""
        assert job.proc.stdout is not None and job.proc.stderr is not None
        sel = selectors.DefaultSelector()
        for idx, stream in enumerate((job.proc.stdout, job.proc.stderr)):
            os.set_blocking(stream.fileno(), False)
            sel.register(stream, selectors.EVENT_READ, idx)
        exited_at: float | None = None
        while sel.get_map():
            now = time.monotonic()
            if job.exit_code is not None and exited_at is None:
                exited_at = now
            if exited_at is not None and now - exited_at > 0.2:
                break  # a background child holds the pipe open: do not wait for it
            if job.deadline is not None and now > job.deadline and not job.timed_out:
                job.timed_out = True
                kill_job(job.id, job.pid)
            for key, _ in sel.select(timeout=0.05 if exited_at or job.exit_code is not None else 0.2):
                try:
                    data = os.read(key.fileobj.fileno(), 1 << 16)  # type: ignore[union-attr]
                except BlockingIOError:
                    continue
                if not data:
                    sel.unregister(key.fileobj)
                    continue
                with job.cond:
                    buf = job.out[key.data]
                    room = MAX_OUTPUT - len(buf)
                    buf += data[:room]
                    job.dropped[key.data] += max(0, len(data) - room)
                    job.cond.notify_all()
        sel.close()
        job.proc.stdout.close()
        job.proc.stderr.close()
        with job.cond:
            while job.exit_code is None:
                if job.deadline is not None and time.monotonic() > job.deadline and not job.timed_out:
                    job.timed_out = True
                    kill_job(job.id, job.pid)
                job.cond.wait(0.05)
            if job.timed_out:
                kill_job(job.id, job.pid)  # stragglers that left the process group
            job.duration = time.monotonic() - job.started
            job.done = True
            job.cond.notify_all()

    def spawn(self, header: dict[str, Any]) -> dict[str, Any]:
        os.makedirs(self.log_dir, exist_ok=True)
        with self.lock:
            job_id = self.next_id
            self.next_id += 1
            log = f"{self.log_dir}/{job_id}.log"
            with open(log, "wb") as f:
                proc = self._popen(header, f, subprocess.STDOUT, job_id)
            self.spawned[proc.pid] = {"cmd": header["cmd"], "exit_code": None, "log": log, "job": job_id}
            reply = {"pid": proc.pid, "log": log}
            self.replies[header.get("key", "")] = reply
            while len(self.replies) > 1024:
                self.replies.popitem(last=False)
        return reply

    # --- connection handling ------------------------------------------------------------------

    def serve(self, conn: socket.socket) -> None:
        """Answer requests on one connection until the host closes it (registered by ``accept``)."""
        try:
            while True:
                header, blob = recv_frame(conn)
                self.handle(conn, header, blob)
        except (ConnectionError, OSError):
            pass
        finally:
            with self.lock:
                self.conns.discard(conn)
                self.closing.discard(conn)
            conn.close()

    def handle(self, conn: socket.socket, h: dict[str, Any], blob: bytes) -> None:
        op = h.get("op")
        try:
            if op == "ping":
                send_frame(conn, {"ok": True, "pid": os.getpid()})
            elif op == "exec":  # start the job, or attach to the one a closed connection left behind
                with self.lock:
                    job_id = self.keys.get(h.get("key", ""))
                if job_id is None:
                    job_id = self.start_job(h).id
                send_frame(conn, {"job": job_id})
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
                pid, sig = int(h["pid"]), int(h.get("signal", signal.SIGTERM))
                if pid in self.spawned:
                    os.killpg(pid, sig)  # spawn made it a group leader: the shell and what it started
                else:
                    os.kill(pid, sig)
                send_frame(conn, {"ok": True})
            elif op == "read":
                with open(h["path"], "rb") as f:
                    data = f.read()
                send_frame(conn, {"ok": True, "mode": os.stat(h["path"]).st_mode & 0o7777}, data)
            elif op == "write":
                write_file(h["path"], blob, int(h.get("mode", 0o644)))
                send_frame(conn, {"ok": True})
            elif op == "quiesce":
                self.quiesce(conn)
                send_frame(conn, {"ok": True})
                raise ConnectionError("quiesced")  # the host waits for this close before CRIU runs
            else:
                send_frame(conn, {"error": "BadRequest", "message": f"unknown op {op!r}"})
        except (ConnectionError, BrokenPipeError):
            raise
        except KeyError as e:
            send_frame(conn, {"error": "BadRequest", "message": f"missing field {e}"})
        except OSError as e:
            send_frame(conn, {"error": type(e).__name__, "errno": e.errno, "message": str(e)})

    def wait(self, conn: socket.socket, job_id: int, offsets: list[int], stream: bool) -> None:
        """Send a job's output from the given offsets (as it comes when streaming), then its result."""
        job = self.jobs.get(job_id)
        if job is None:
            send_frame(conn, {"error": "NotFound", "message": f"no job {job_id}"})
            return
        while True:
            with job.cond:
                while not job.done and not (stream and any(len(job.out[i]) > offsets[i] for i in (0, 1))):
                    if conn in self.closing:
                        raise ConnectionError("quiesced")
                    job.cond.wait()
                chunks = [bytes(job.out[i][offsets[i]:]) if (stream or job.done) else b"" for i in (0, 1)]
                done = job.done
            for i in (0, 1):
                if chunks[i] and (stream or not done):
                    send_frame(conn, {"fd": i + 1}, chunks[i])
                    offsets[i] += len(chunks[i])
                    chunks[i] = b""
            if done:
                header = job.result()
                header["stdout_len"] = len(chunks[0])
                send_frame(conn, header, chunks[0] + chunks[1])
                with self.lock:
                    self.jobs.pop(job_id, None)  # delivered: forget it
                    self.keys.pop(job.key, None)
                return

    def quiesce(self, keep: socket.socket) -> None:
        """Close every other host connection, so that CRIU finds no socket with a peer outside."""
        with self.lock:
            others = [c for c in self.conns if c is not keep]
            self.closing.update(others)
            jobs = list(self.jobs.values())
        for c in others:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        for job in jobs:
            with job.cond:
                job.cond.notify_all()
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            with self.lock:
                if not (self.conns - {keep}):
                    break
            time.sleep(0.001)


def kill_job(job_id: int, pgid: int) -> None:
    """SIGKILL a job's process group and every process that carries its marker in the environment."""
    with contextlib.suppress(OSError):
        os.killpg(pgid, signal.SIGKILL)
    marker = f"{JOB_ENV}={job_id}".encode()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == 1:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    os.kill(int(name), signal.SIGKILL)
        except OSError:
            continue


def write_file(path: str, data: bytes, mode: int) -> None:
    """Write atomically (temporary file and rename), creating parent folders."""
    os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
    tmp = f"{path}.agentenv-tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def main(path: str = SOCKET_PATH) -> None:
    """Serve forever on ``path`` (another path is for running the agent outside a sandbox, in tests)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if path == SOCKET_PATH and not os.path.isdir("/dev/shm"):  # POSIX shared memory lives on /dev's tmpfs
        os.makedirs("/dev/shm")
        os.chmod("/dev/shm", 0o1777)
    if os.path.exists(path):
        os.unlink(path)
    agent = Agent(log_dir=os.path.join(os.path.dirname(path), "proc"))
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: sys.exit(0))
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(128)
    threading.Thread(target=agent.reap_forever, daemon=True).start()
    while True:
        conn, _ = server.accept()
        with agent.lock:
            agent.conns.add(conn)  # before the thread starts: quiesce must never miss a connection
        threading.Thread(target=agent.serve, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    main(*sys.argv[1:2])
