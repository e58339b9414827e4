"""The in-sandbox agent: PID 1 of every sandbox, serving exec, spawn and files over a unix socket.

It runs inside the container with the image's own python3 and the standard library only, so any
image with python3 works. The host reaches it at ``/proc/<pid>/root/dev/agentenv/agent.sock``,
which avoids ``docker exec``'s round trip, and because the agent *is* the container's init, a CRIU
snapshot carries every job, its buffered output and the listening socket along.

Wire format, both ways: ``>II`` (header length, blob length), a JSON header, then raw bytes.
A job is addressed by id, so a client whose connection was closed (the host closes every connection
before a memory snapshot) reconnects and resumes from the byte offsets it already has. A job made by
``start`` is addressed by pid instead (``attach``, ``input``, ``discard``, ``kill``) and stays until its
end is delivered; its output waits in the agent, from absolute offsets, until read (or discarded).

Both ends treat the other as untrusted: a process in the sandbox can replace the socket with its own
server, or connect to the agent itself (so ``reroot``, which re-executes the agent with the argv it is
given, is refused unless the peer is outside the sandbox's pid namespace: the host). Every frame is capped
(``MAX_HEADER``, and a blob limit the reader chooses), files are streamed in ``CHUNK``-sized pieces rather
than held in memory, and the agent survives what its sandbox can throw at it: SIGTERM/SIGINT from inside,
running out of pids (it answers an error instead of dying), ptrace (it is not dumpable), memory pressure
(its children get the highest OOM score, so the kernel picks them first).
"""

from __future__ import annotations

import _json
import _socket
import _thread
import errno
import os
import select
import stat
import struct
import sys
import time

# Every sandbox start waits for this module to import, so it imports only C modules (and struct, stat):
# json, socket, signal, subprocess, threading, selectors and contextlib cost ~13 ms of each start (enum, re,
# functools, collections under them), as much as the interpreter's own start. So sockets, signals and locks
# come from their C modules, commands start by posix_spawn, and JSON goes through _json (see _codec).
TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal as _signal  # no stub for _signal: its names are signal's
    from collections.abc import Callable
    from typing import Any
else:
    import _signal

SOCKET_DIR = "/dev/agentenv"  # on the sandbox's private /dev tmpfs: saved with the processes
SOCKET_PATH = SOCKET_DIR + "/agent.sock"
LOG_DIR = SOCKET_DIR + "/proc"
JOB_ENV = "AGENTENV_JOB"
OWN_DIRS = (SOCKET_DIR, "/.agentenv")  # the agent's own files: the file API refuses to write there
MAX_OUTPUT = 64 << 20  # bytes kept per stream of one job (or the request's max_output); the rest is counted
OUTPUT_BUDGET = 4  # all jobs' unread output together: this many times a job's max_output (the sandbox's memory)
OUTPUT_FLOOR = 64 << 10  # bytes per stream a job keeps whatever the others hold: small commands always answer
MAX_HEADER = 32 << 20  # bytes of one frame's JSON header (an exec's command and env included)
MAX_FILE = 1 << 30  # bytes of one file read or written through the file API
MAX_BLOB = MAX_FILE  # default cap of one frame's raw bytes
MAX_EXEC_BLOB = 2 * MAX_OUTPUT  # an exec output frame carries at most both streams' buffers
MAX_UNSIZED = 8 << 20  # bytes read from a file whose size stat does not tell (/proc, /sys): held in memory
CHUNK = 1 << 20  # files and big frames move in pieces of this size
SMALL_BLOB = 1 << 20  # blobs of requests other than write are read into memory only up to this
CHILD_OOM_SCORE = 1000  # every process the agent starts is the OOM killer's first choice, never the agent
_CHILD_PREFIX = f"echo {CHILD_OOM_SCORE} 2>/dev/null >/proc/self/oom_score_adj; "  # before the user's code runs
ABANDONED = 3600.0  # seconds a finished job's result waits for its caller
INPUT_TIMEOUT = 30.0  # seconds at most one write to a job's stdin may wait for the job to read
MAX_ENTRIES = 100_000  # entries of one directory listing
_HEAD = struct.Struct(">II")
_PR_SET_DUMPABLE = 4


def _heartbeat() -> float:
    """Seconds between an exec's "still running" frames: 5, or $AGENTENV_HEARTBEAT (for tests) within 0.05..30."""
    try:
        return min(30.0, max(0.05, float(os.environ.get("AGENTENV_HEARTBEAT", "5"))))
    except ValueError:
        return 5.0


HEARTBEAT = _heartbeat()


# --- what json, threading and contextlib would give ----------------------------------------------


def _codec() -> tuple[Callable[[Any], str], Callable[[str], Any]]:
    """``dumps`` (compact) and ``loads`` for frame headers: what json runs, _json's C encoder and scanner, without
    the json package, which imports re. Where this Python's _json differs, the json package's own."""
    try:
        encoder = _json.make_encoder(None, _not_json, _json.encode_basestring_ascii, None, ":", ",",
                                     False, False, True)

        class Context:  # what the scanner reads of a json.JSONDecoder
            strict = True
            object_hook = object_pairs_hook = None
            parse_float, parse_int = float, int
            parse_constant = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}.__getitem__

        scan = _json.make_scanner(Context)  # type: ignore[arg-type]

        def dumps(obj: Any) -> str:
            return "".join(encoder(obj, 0))

        def loads(text: str) -> Any:
            text = text.strip(" \t\n\r")
            try:
                obj, end = scan(text, 0)
            except StopIteration as e:
                raise ValueError(f"Expecting value: char {e.value}") from None
            if end != len(text):
                raise ValueError(f"Extra data: char {end}")
            return obj

        probe = {"a": [1, -2.5, "\u00e9\n\"", None, True], "b": {}}
        if dumps(probe) != '{"a":[1,-2.5,"\\u00e9\\n\\"",null,true],"b":{}}' or loads(dumps(probe)) != probe:
            raise ValueError("this _json differs")
        return dumps, loads
    except Exception:  # noqa: BLE001 - any surprise: the json package
        import json

        return lambda obj: json.dumps(obj, separators=(",", ":")), json.loads


def _not_json(obj: object) -> object:
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


_dumps, _loads = _codec()


class suppress:  # noqa: N801 - contextlib's name
    """contextlib.suppress: the exceptions given end the ``with`` block quietly."""

    def __init__(self, *exceptions: type[BaseException]) -> None:
        self.exceptions = exceptions

    def __enter__(self) -> None:
        pass

    def __exit__(self, kind: type[BaseException] | None, value: object, tb: object) -> bool:
        return kind is not None and issubclass(kind, self.exceptions)


class Condition:
    """threading.Condition's ``with``, ``wait`` and ``notify_all``, on _thread locks."""

    def __init__(self) -> None:
        self.lock = _thread.allocate_lock()
        self.waiters: list[_thread.LockType] = []

    def __enter__(self) -> None:
        self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()

    def wait(self, timeout: float) -> None:
        """Let go of the lock until notified or ``timeout`` seconds passed, then hold it again."""
        waiter = _thread.allocate_lock()
        waiter.acquire()
        self.waiters.append(waiter)
        self.lock.release()
        try:
            waiter.acquire(True, max(0.0, timeout))
        finally:
            self.lock.acquire()
            if waiter in self.waiters:  # timed out: nobody released it
                self.waiters.remove(waiter)

    def notify_all(self) -> None:
        for waiter in self.waiters:
            waiter.release()
        self.waiters.clear()


# --- framing, shared with the host side ---------------------------------------------------------


class FrameError(ConnectionError):
    """The peer broke the protocol (a frame over its cap, a header that is not a JSON object): not retried."""


def send_frame(sock: _socket.socket, header: dict[str, Any], blob: bytes | bytearray | memoryview = b"",
               deadline: float | None = None) -> None:
    """Send one frame: JSON header plus raw bytes (a big blob is sent as is, never copied)."""
    send_parts(sock, header, [blob], deadline)


def send_parts(sock: _socket.socket, header: dict[str, Any], parts: list[bytes | bytearray | memoryview],
               deadline: float | None = None) -> None:
    """Send one frame whose blob is ``parts`` one after the other."""
    head = _dumps(header).encode()
    if len(head) > MAX_HEADER:
        raise ValueError(f"request header of {len(head)} bytes is over the {MAX_HEADER}-byte limit")
    size = sum(len(p) for p in parts)
    _settimeout(sock, deadline)
    if size <= 1 << 16:
        sock.sendall(b"".join([_HEAD.pack(len(head), size), head, *parts]))
        return
    sock.sendall(_HEAD.pack(len(head), size) + head)
    for p in parts:
        if len(p):
            _settimeout(sock, deadline)
            sock.sendall(p)


def _settimeout(sock: _socket.socket, deadline: float | None) -> None:
    """Make the socket's timeout the time left to ``deadline`` (within 50 ms: each change is a syscall)."""
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        current = sock.gettimeout()
        if current is None or not 0 <= current - left < 0.05:
            sock.settimeout(left)


def _recv_exact(sock: _socket.socket, n: int, deadline: float | None = None) -> bytes:
    """Exactly ``n`` bytes; memory grows with what arrives, never with what the peer announced."""
    chunks: list[bytes] = []
    got = 0
    while got < n:
        _settimeout(sock, deadline)
        chunk = sock.recv(min(n - got, CHUNK))
        if not chunk:
            raise ConnectionError("connection closed")
        chunks.append(chunk)
        got += len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def recv_header(sock: _socket.socket, max_blob: int = MAX_BLOB,
                deadline: float | None = None) -> tuple[dict[str, Any], int]:
    """Receive a frame's header and the length of the blob that follows (not read yet)."""
    hlen, blen = _HEAD.unpack(_recv_exact(sock, _HEAD.size, deadline))
    if hlen > MAX_HEADER or blen > max_blob:
        raise FrameError(f"frame of {hlen} + {blen} bytes is over the limit ({MAX_HEADER} + {max_blob})")
    try:
        header = _loads(_recv_exact(sock, hlen, deadline).decode())
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise FrameError(f"frame header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise FrameError("frame header is not a JSON object")
    return header, blen


def recv_frame(sock: _socket.socket, max_blob: int = MAX_BLOB,
               deadline: float | None = None) -> tuple[dict[str, Any], bytes]:
    """Receive one frame; ConnectionError when the peer closed, FrameError past the caps,
    TimeoutError past ``deadline`` (a ``time.monotonic()`` instant)."""
    header, blen = recv_header(sock, max_blob, deadline)
    return header, _recv_exact(sock, blen, deadline) if blen else b""


def drain(sock: _socket.socket, n: int) -> None:
    """Read and drop ``n`` bytes, a chunk at a time."""
    while n > 0:
        chunk = sock.recv(min(n, CHUNK))
        if not chunk:
            raise ConnectionError("connection closed")
        n -= len(chunk)


class Starved(Exception):
    """The agent cannot start a thread or a process: the sandbox is out of pids (or memory)."""


# --- jobs -------------------------------------------------------------------------------------


class Child:
    """A command the agent started (``sh -c``, leading its own session and process group): its pid, and the
    agent's ends of its pipes, where it has pipes."""

    def __init__(self, pid: int, stdin: Any = None, stdout: Any = None, stderr: Any = None) -> None:
        self.pid = pid
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr


class Job:
    """One command run by exec or start: its process group, buffered output and exit status.

    ``out[i]`` holds stream i from the absolute offset ``base[i]`` on (discard drops a prefix).
    """

    def __init__(self, job_id: int, proc: Child, timeout: float | None,
                 max_output: int = MAX_OUTPUT) -> None:
        self.id = job_id
        self.max_output = max_output
        self.proc = proc
        self.pid = proc.pid
        self.started = time.monotonic()
        self.deadline = self.started + timeout if timeout else None
        self.out = [bytearray(), bytearray()]
        self.base = [0, 0]
        self.dropped = [0, 0]
        self.held = 0  # bytes of out counted in the agent's output budget
        self.info: dict[str, Any] = {}  # a started job's request, for listing
        self.stdin_lock = _thread.allocate_lock()
        self.stdin_done: dict[str, int] = {}  # input request key -> bytes written
        self.exit_code: int | None = None
        self.timed_out = False
        self.duration = 0.0
        self.done = False
        self.handing = 0  # connections delivering its end
        self.key = ""
        self.cond = Condition()

    def result(self) -> dict[str, Any]:
        return {"exit_code": self.exit_code, "timed_out": self.timed_out, "duration": self.duration,
                "dropped": self.dropped}

    def listing(self) -> dict[str, Any]:
        return {**self.info, "pid": self.pid, "exit_code": self.exit_code if self.done else None}


class Agent:
    """Process table, reaper and request handlers of the sandbox's init."""

    def __init__(self, log_dir: str = LOG_DIR, own_dirs: tuple[str, ...] = OWN_DIRS) -> None:
        self.log_dir = log_dir
        self.own_dirs = own_dirs
        self.lock = _thread.allocate_lock()
        self.jobs: dict[int, Job] = {}
        self.spawned: dict[int, dict[str, Any]] = {}  # pid -> {"cmd", "exit_code", "log"}
        self.by_pid: dict[int, Job] = {}
        self.started: dict[int, Job] = {}  # pid -> job made by start, until its end is delivered
        self.buffered = 0  # bytes of output all jobs hold (OUTPUT_BUDGET), under ``budget``: a leaf lock
        self.budget = _thread.allocate_lock()
        self.next_id = 1
        self.child_started = Condition()  # reap_forever sleeps on it while the agent has no child
        self.new_child = False  # a child was started since reap_forever last found none (under child_started)
        self.conns: set[_socket.socket] = set()
        self.closing: set[_socket.socket] = set()
        self.keys: dict[str, int] = {}  # request key -> job id, until the result is delivered
        self.replies: dict[str, dict[str, Any]] = {}  # spawn replies by request key
        self.socket_path = ""  # where main listens

    # reaping: PID 1 collects every exit, its own jobs' and orphans' alike
    def reap_forever(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                with self.child_started:
                    if not self.new_child:
                        self.child_started.wait(1.0)
                    self.new_child = False
                continue
            code = os.waitstatus_to_exitcode(status)
            code = 128 - code if code < 0 else code
            with self.lock:
                job = self.by_pid.pop(pid, None)
                spawned = self.spawned.get(pid)
                if spawned is not None:
                    spawned["exit_code"] = code
            if job is not None:
                with job.cond:
                    job.exit_code = code
                    job.cond.notify_all()

    def _spawn(self, header: dict[str, Any], job_id: int, output: int | None = None) -> Child:
        """Start the request's command: ``sh -c`` in a new session (its group is the job) with the sandbox's
        environment plus the request's; stdin a pipe if asked for, else /dev/null; stdout and stderr two pipes,
        or both the file ``output``. posix_spawn (a vfork) rather than subprocess, whose imports cost every start
        of a sandbox (see the imports); callers hold self.lock."""
        env = dict(os.environ)
        env.pop("AGENTENV_AGENT", None)
        env.update(header.get("env") or {})
        env[JOB_ENV] = str(job_id)
        script = _CHILD_PREFIX + str(header["cmd"])
        cwd = header.get("cwd")
        if cwd:  # posix_spawn cannot chdir: the shell does, once it is checked here (an error, as subprocess's)
            if not isinstance(cwd, str):
                raise TypeError(f"'cwd' must be a path, not {type(cwd).__name__}")
            if not stat.S_ISDIR(os.stat(cwd).st_mode):
                raise NotADirectoryError(errno.ENOTDIR, f"Not a directory: {cwd!r}")
            script = "cd -- '" + cwd.replace("'", "'\\''") + "' || exit 126; " + script
        ends: list[int | None] = [None, None, None]  # the agent's ends of the child's stdin, stdout, stderr
        theirs: list[int] = []  # the child's ends, closed here once it runs
        piped = ((0,) if header.get("stdin") else ()) + ((1, 2) if output is None else ())
        actions: list[tuple[Any, ...]] = [] if 0 in piped else [(os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0)]
        try:
            for fd in piped:
                r, w = os.pipe()
                ends[fd], child_end = (w, r) if fd == 0 else (r, w)
                theirs.append(child_end)
                actions.append((os.POSIX_SPAWN_DUP2, child_end, fd))
            if output is not None:
                actions += [(os.POSIX_SPAWN_DUP2, output, 1), (os.POSIX_SPAWN_DUP2, output, 2)]
            argv = ["/bin/sh", "-c", script]
            default = (_signal.SIGPIPE, _signal.SIGXFSZ)  # Python ignores these: the command must not
            try:
                pid = os.posix_spawn(argv[0], argv, env, file_actions=actions, setsid=True, setsigdef=default)
            except NotImplementedError:  # a C library without POSIX_SPAWN_SETSID: its own group is what matters
                pid = os.posix_spawn(argv[0], argv, env, file_actions=actions, setpgroup=0, setsigdef=default)
        except BaseException as e:
            for end in ends:
                if end is not None:
                    os.close(end)
            if isinstance(e, BlockingIOError):  # EAGAIN from clone: the pids cgroup is full
                raise Starved(f"cannot start the command: the sandbox is out of processes ({e})") from None
            raise
        finally:
            for end in theirs:
                os.close(end)
        with self.child_started:
            self.new_child = True
            self.child_started.notify_all()
        return Child(pid, *(None if end is None else open(end, "wb" if fd == 0 else "rb", buffering=0)
                            for fd, end in enumerate(ends)))

    def start_job(self, header: dict[str, Any], listed: bool = False) -> Job:
        with self.lock:
            self._forget_abandoned()
            key = header.get("key")
            known = self.jobs.get(self.keys.get(key, 0)) if key else None
            if known is not None:  # a retried request: the job it started
                return known
            job_id = self.next_id
            self.next_id += 1
            proc = self._spawn(header, job_id)
            cap = header.get("max_output")
            job = Job(job_id, proc, header.get("timeout"),
                      min(MAX_OUTPUT, max(0, cap)) if isinstance(cap, int) else MAX_OUTPUT)
            self.jobs[job_id] = job
            job.key = header.get("key", "")
            self.keys[job.key] = job_id
            self.by_pid[proc.pid] = job
            if listed:
                env = header.get("env") or {}
                job.info = {"command": str(header["cmd"]), "cwd": header.get("cwd"), "env": dict(env),
                            "tag": header.get("tag"), "stdin": bool(header.get("stdin"))}
                self.started[proc.pid] = job
            if proc.stdin is not None:
                os.set_blocking(proc.stdin.fileno(), False)
        try:
            _thread.start_new_thread(self._pump, (job,))
        except RuntimeError as e:  # no thread to collect its output: undo the job rather than hang its caller
            kill_job(job.id, job.pid)
            with self.lock:
                self._forget(job)
            raise Starved(f"cannot start the command: the sandbox is out of threads ({e})") from None
        return job

    def _forget_abandoned(self) -> None:
        """Drop results nobody came back for (their caller died) an hour after the job ended."""
        now = time.monotonic()
        for job in [j for j in self.jobs.values() if j.done and now - j.started - j.duration > ABANDONED]:
            self._forget(job)

    def _forget(self, job: Job) -> None:
        """Drop a job whose end was delivered (callers hold self.lock)."""
        with self.budget:  # its buffers go with the last reader: the budget has them back now
            self.buffered -= job.held
            job.held = 0
        self.jobs.pop(job.id, None)
        self.keys.pop(job.key, None)
        if self.started.get(job.pid) is job:
            del self.started[job.pid]
        if job.stdin_lock.acquire(blocking=False):  # else the writer holding it closes stdin when done
            close_stdin(job)
            job.stdin_lock.release()

    def _pump(self, job: Job) -> None:
        """Collect a job's output until it exits (or times out), then mark it done."""
        assert job.proc.stdout is not None and job.proc.stderr is not None
        streams = {job.proc.stdout.fileno(): 0, job.proc.stderr.fileno(): 1}  # fd -> index in job.out
        poll = select.poll()
        for fd in streams:
            os.set_blocking(fd, False)
            poll.register(fd, select.POLLIN)
        exited_at: float | None = None
        while streams:
            now = time.monotonic()
            if job.exit_code is not None and exited_at is None:
                exited_at = now
            if exited_at is not None and now - exited_at > 0.2:
                break  # a background child holds the pipe open: do not wait for it
            if job.deadline is not None and now > job.deadline and not job.timed_out:
                job.timed_out = True
                kill_job(job.id, job.pid)
            for fd, _ in poll.poll(50 if exited_at or job.exit_code is not None else 200):
                try:
                    data = os.read(fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not data:
                    poll.unregister(fd)
                    del streams[fd]
                    continue
                idx = streams[fd]
                with job.cond:
                    buf = job.out[idx]
                    room = job.max_output - len(buf)
                    with self.budget:  # past its floor a job draws on a budget shared by all jobs: the unread
                        if len(buf) + len(data) > OUTPUT_FLOOR:  # output of many must not fill the sandbox's memory
                            room = min(room, max(OUTPUT_FLOOR - len(buf),
                                                 OUTPUT_BUDGET * job.max_output - self.buffered))
                        took = max(0, min(room, len(data)))
                        self.buffered += took
                        job.held += took
                    buf += data[:took]
                    job.dropped[idx] += len(data) - took
                    job.cond.notify_all()
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
                proc = self._spawn(header, job_id, f.fileno())
            self.spawned[proc.pid] = {"cmd": header["cmd"], "exit_code": None, "log": log, "job": job_id}
            reply = {"pid": proc.pid, "log": log}
            self.replies[header.get("key", "")] = reply
            while len(self.replies) > 1024:
                del self.replies[next(iter(self.replies))]  # the oldest
        return reply

    # --- connection handling ------------------------------------------------------------------

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
                if starved and header.get("op") in ("exec", "spawn", "start"):
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
                    path = self.check_own(str(h["path"]))
                except BaseException:
                    drain(conn, blen)
                    raise
                write_stream(path, conn, blen, int(h.get("mode", 0o644)))
                send_frame(conn, {"ok": True})
            elif op == "ping":
                not_dumpable()  # again: a restore from a snapshot may have brought the process back dumpable
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
                send_frame(conn, {"job": job.id, "beat": HEARTBEAT, "offsets": at})
                self.wait(conn, job.id, at, True, bool(h.get("follow", True)))
            elif op == "jobs":
                with self.lock:
                    listed = [j.listing() for j in self.started.values() if not j.handing]
                send_frame(conn, {"jobs": listed})
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
                send_frame(conn, self.fs(h))
            elif op == "read":
                send_file(conn, h["path"])
            elif op == "reroot":  # a fork gave this (pooled) sandbox another root: run from it, as a new agent
                if peer_pid(conn) != 0:  # sent from inside: the sandbox's own program would become its agent
                    raise PermissionError(errno.EPERM, "reroot is the host's request alone: refused")
                argv, env = [str(a) for a in h["argv"]], {**os.environ, **{str(k): str(v) for k, v in h["env"].items()}}
                os.makedirs(str(h["cwd"]), exist_ok=True)  # as runc makes a missing working folder
                os.chdir(str(h["cwd"]))
                os.unlink(self.socket_path)  # a connect from now on reaches the new agent, or waits for it
                send_frame(conn, {"ok": True})
                os.execve(sys.executable, argv, env)  # what ran from the old root (interpreter, modules) is gone
            elif op == "quiesce":
                self.quiesce(conn)
                send_frame(conn, {"ok": True})
                raise ConnectionError("quiesced")  # the host waits for this close before CRIU runs
            else:
                send_frame(conn, {"error": "BadRequest", "message": f"unknown op {op!r}"})
        except (ConnectionError, BrokenPipeError):
            raise
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
            send_frame(conn, {"error": "SandboxError", "message": "the agent ran out of memory serving the request",
                              "fix": "free memory in the sandbox (kill processes, delete /dev/shm files)"})

    def check_own(self, path: str, tree: bool = False) -> str:
        """``path``, unless it (or a folder it goes through, symlinks resolved) is one of the agent's own;
        with ``tree``, also unless one of them is inside it (a folder removed or moved whole)."""
        real = os.path.join(os.path.realpath(os.path.dirname(path) or "/"), os.path.basename(path))
        real = os.path.normpath(real)
        for d in self.own_dirs:
            if real == d or real.startswith(d.rstrip("/") + "/") or (tree and (d + "/").startswith(
                    real.rstrip("/") + "/")):
                raise PermissionError(13, f"{path} is or holds the agent's own folder {d}: refused")
        return path

    def fs(self, h: dict[str, Any]) -> dict[str, Any]:
        """The file system ops: stat, list (down to ``depth`` levels), mkdir, move, remove."""
        do, path = h["do"], str(h["path"])
        if do == "stat":
            return {"info": file_info(path)}
        if do == "list":
            depth = int(h.get("depth", 1))
            if depth < 1:
                raise ValueError(f"depth must be at least 1, got {depth}")
            if not stat.S_ISDIR(os.stat(path).st_mode):
                raise NotADirectoryError(errno.ENOTDIR, f"Not a directory: {path!r}")
            return {"entries": _walk(path, depth)}
        if do == "mkdir":
            self.check_own(path)
            if os.path.isdir(path):
                return {"made": False}
            if os.path.lexists(path):
                raise FileExistsError(errno.EEXIST, f"File exists: {path!r}")
            os.makedirs(path)
            return {"made": True}
        if do == "move":
            dst = self.check_own(str(h["dst"]), tree=True)
            move(self.check_own(path, tree=True), dst)
            return {"info": file_info(dst)}
        if do == "remove":
            self.check_own(path, tree=True)
            if stat.S_ISDIR(os.lstat(path).st_mode):
                import shutil

                shutil.rmtree(path)
            else:
                os.unlink(path)
            return {"ok": True}
        raise ValueError(f"unknown fs op {do!r}")

    def wait(self, conn: _socket.socket, job_id: int, offsets: list[int], stream: bool, follow: bool = True) -> None:
        """Send a job's output from the given absolute offsets (as it comes when streaming), then its result.

        Every ``HEARTBEAT`` seconds without anything to send, a ``{"beat": true}`` frame tells the
        host the agent still runs (so that it can tell a long silent command from a stopped agent).
        Output frames say where their bytes start (``at``): past bytes a discard dropped, it goes on from
        the oldest kept. ``follow=False``: what is buffered now, then the result or ``{"running": true}``.
        """
        job = self.jobs.get(job_id)
        if job is None:
            send_frame(conn, {"error": "NotFound", "message": f"no job {job_id}"})
            return
        offsets = [int(offsets[0]), int(offsets[1])]
        last_sent = time.monotonic()
        while True:
            beat = False
            with job.cond:
                offsets = [max(offsets[i], job.base[i]) for i in (0, 1)]
                while follow and not job.done and not (
                        stream and any(job.base[i] + len(job.out[i]) > offsets[i] for i in (0, 1))):
                    if conn in self.closing:
                        raise ConnectionError("quiesced")
                    left = last_sent + HEARTBEAT - time.monotonic()
                    if left <= 0:
                        beat = True
                        break
                    job.cond.wait(left)
                    offsets = [max(offsets[i], job.base[i]) for i in (0, 1)]
                done = job.done and not beat
                start = [offsets[i] - job.base[i] for i in (0, 1)]
                chunks: list[bytes | bytearray | memoryview] = [b"", b""]
                if done:  # finished: nothing appends any more, so send from the buffers themselves
                    chunks = [memoryview(job.out[i])[start[i]:] for i in (0, 1)]
                elif stream and not beat:  # one copy of what is new: the pump may still append
                    chunks = [job.out[i][start[i]:] for i in (0, 1)]
            if beat:
                send_frame(conn, {"beat": True})
                last_sent = time.monotonic()
                continue
            for i in (0, 1):
                if chunks[i] and (stream or not done):
                    send_frame(conn, {"fd": i + 1, "at": offsets[i]}, chunks[i])
                    offsets[i] += len(chunks[i])
                    chunks[i] = b""
                    last_sent = time.monotonic()
            if done:
                header = job.result()
                header["stdout_len"] = len(chunks[0])
                header["at"] = offsets
                with self.lock:
                    job.handing += 1  # not listed while its end may have reached a caller; back if that fails
                try:
                    send_parts(conn, header, chunks)
                except BaseException:
                    with self.lock:
                        job.handing -= 1
                    raise
                with self.lock:
                    self._forget(job)  # delivered: forget it
                return
            if not follow:
                send_frame(conn, {"running": True, "at": offsets})
                return

    def started_job(self, h: dict[str, Any]) -> Job:
        """The job that start made with pid ``h["pid"]`` (ProcessLookupError if none, or delivered)."""
        with self.lock:
            job = self.started.get(int(h["pid"]))
        if job is None:
            raise ProcessLookupError(errno.ESRCH, f"no job with pid {h['pid']}")
        return job

    def discard(self, job: Job, offsets: list[int]) -> None:
        """Drop a job's buffered bytes below the absolute ``offsets`` (kept while a finished job's are sent)."""
        with job.cond:
            for i in (0, 1):
                n = min(max(0, int(offsets[i]) - job.base[i]), len(job.out[i]))
                with suppress(BufferError):
                    del job.out[i][:n]
                    job.base[i] += n
                    with self.budget:
                        self.buffered -= min(n, job.held)
                        job.held -= min(n, job.held)

    def write_input(self, conn: _socket.socket, job: Job, key: str, data: bytes, timeout: float) -> None:
        """Write ``data`` to a job's stdin within ``timeout`` seconds (TimeoutError if it does not read);
        a retried request (same ``key``) goes on from the bytes already written."""
        deadline = time.monotonic() + timeout
        if not job.stdin_lock.acquire(timeout=timeout):
            raise TimeoutError(f"another write to the stdin of job {job.pid} is still blocked")
        try:
            done = job.stdin_done.get(key, 0) if key else 0
            pipe = job.proc.stdin
            while done < len(data):
                if pipe is None or pipe.closed:
                    raise BrokenPipeError(errno.EPIPE, f"the stdin of job {job.pid} is closed")
                if conn in self.closing:
                    raise ConnectionError("quiesced")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"job {job.pid} did not read its stdin within {timeout:g} s "
                                       f"({done} of {len(data)} bytes written)")
                try:
                    done += os.write(pipe.fileno(), data[done:done + (1 << 16)])
                except BlockingIOError:
                    poll = select.poll()
                    poll.register(pipe.fileno(), select.POLLOUT)
                    poll.poll(min(left, 0.1) * 1000)
                if key:
                    job.stdin_done[key] = done
                while len(job.stdin_done) > 64:
                    del job.stdin_done[next(iter(job.stdin_done))]
        finally:
            job.stdin_lock.release()
            if job.id not in self.jobs and job.stdin_lock.acquire(blocking=False):  # forgotten meanwhile
                close_stdin(job)
                job.stdin_lock.release()

    def quiesce(self, keep: _socket.socket) -> None:
        """Close every other host connection, so that CRIU finds no socket with a peer outside."""
        with self.lock:
            others = [c for c in self.conns if c is not keep]
            self.closing.update(others)
            jobs = list(self.jobs.values())
        for c in others:
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


def peer_pid(conn: _socket.socket) -> int:
    """The pid of the process that connected ``conn``, as the agent's pid namespace numbers it: 0 for one outside
    that namespace (the host), which no process of the sandbox can be (it may not make pid namespaces)."""
    return int(struct.unpack("3i", conn.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, 12))[0])


def kill_job(job_id: int, pgid: int) -> None:
    """SIGKILL a job's process group and every process that carries its marker in the environment."""
    with suppress(OSError):
        os.killpg(pgid, _signal.SIGKILL)
    marker = f"{JOB_ENV}={job_id}".encode()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == 1:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    os.kill(int(name), _signal.SIGKILL)
        except OSError:
            continue


def close_stdin(job: Job) -> None:
    """Close a job's stdin (EOF for the job); callers hold its stdin_lock."""
    if job.proc.stdin is not None:
        with suppress(OSError):
            job.proc.stdin.close()


def file_info(path: str, names: dict[str, dict[int, str]] | None = None) -> dict[str, Any]:
    """What a file is: its own stat (a symlink's target decides only its type); owner and group by name
    when the sandbox's /etc/passwd and /etc/group have them."""
    st = os.lstat(path)
    kind, target = st.st_mode, None
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(path)
        with suppress(OSError):
            kind = os.stat(path).st_mode
    names = {} if names is None else names
    for db in ("passwd", "group"):
        if db not in names:
            names[db] = _id_names(f"/etc/{db}")
    return {"name": os.path.basename(path.rstrip("/")) or "/", "path": path,
            "type": "dir" if stat.S_ISDIR(kind) else "file", "size": st.st_size, "mode": st.st_mode & 0o7777,
            "permissions": stat.filemode(st.st_mode), "owner": names["passwd"].get(st.st_uid, str(st.st_uid)),
            "group": names["group"].get(st.st_gid, str(st.st_gid)), "modified": st.st_mtime,
            "symlink_target": target}


def _id_names(path: str) -> dict[int, str]:
    """uid (or gid) -> name from a passwd (group) file: read as a file, never through NSS (whose modules the
    sandbox chooses), and at most 1 MiB of it."""
    found: dict[int, str] = {}
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            data = f.read(1 << 20) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
    except OSError:
        return found
    for line in data.decode(errors="replace").splitlines():
        parts = line.split(":")
        if len(parts) > 2 and parts[2].isdigit():
            found.setdefault(int(parts[2]), parts[0])
    return found


def _walk(top: str, depth: int) -> list[dict[str, Any]]:
    """The entries under ``top`` down to ``depth`` levels, by name, each folder before what is in it
    (symlinks not followed); at most MAX_ENTRIES of them (ValueError past that)."""
    names: dict[str, dict[int, str]] = {}
    found: list[dict[str, Any]] = []
    stack: list[tuple[str, bool, int]] = []

    def scan(folder: str, level: int) -> None:
        room = MAX_ENTRIES - len(found) - len(stack)
        with os.scandir(folder) as it:
            got: list[tuple[str, bool]] = []
            for e in it:
                if len(got) >= room:
                    raise ValueError(f"over {MAX_ENTRIES} entries under {top}: list with a smaller depth")
                got.append((e.name, e.is_dir(follow_symlinks=False)))
        stack.extend((os.path.join(folder, n), d, level) for n, d in sorted(got, reverse=True))

    scan(top, 1)
    while stack:
        path, is_dir, level = stack.pop()
        with suppress(FileNotFoundError):  # gone since the scan
            found.append(file_info(path, names))
            if is_dir and level < depth:
                with suppress(PermissionError, NotADirectoryError):
                    scan(path, level + 1)
    return found


def move(src: str, dst: str) -> None:
    """Rename ``src`` to ``dst`` (creating its parent folders), copying across file systems."""
    os.makedirs(os.path.dirname(dst) or "/", exist_ok=True)
    try:
        os.rename(src, dst)
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
        import shutil

        if stat.S_ISDIR(os.lstat(src).st_mode):
            shutil.copytree(src, dst, symlinks=True)
            shutil.rmtree(src)
        else:
            shutil.copy2(src, dst, follow_symlinks=False)
            os.unlink(src)


def write_stream(path: str, conn: _socket.socket, n: int, mode: int) -> None:
    """Write the next ``n`` bytes of ``conn`` to ``path`` atomically (temporary file and rename), creating
    parent folders, a ``CHUNK`` at a time: an upload never sits in the agent's memory.

    On a failure (disk full, say) the rest of the bytes are read and dropped, so the connection stays
    in step, and the error is raised.
    """
    left = n
    tmp = f"{path}.agentenv-tmp"
    try:
        os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
        try:
            with os.fdopen(fd, "wb", buffering=0) as f:
                buf = bytearray(min(n, CHUNK))
                view = memoryview(buf)
                while left > 0:
                    got = conn.recv_into(view[:min(left, CHUNK)])
                    if not got:
                        raise ConnectionError("connection closed")
                    left -= got
                    done = 0
                    while done < got:
                        done += f.write(view[done:got])
            os.chmod(tmp, mode)
            os.replace(tmp, path)
        except BaseException:
            with suppress(OSError):
                os.unlink(tmp)
            raise
    except ConnectionError:
        raise
    except BaseException:
        drain(conn, left)
        raise


def send_file(conn: _socket.socket, path: str) -> None:
    """Answer a read: the file's bytes, streamed from the file when big (never two copies in memory).

    Only regular files: a device (/dev/zero), a FIFO or a socket could be endless or block forever.
    One whose size stat does not tell (/proc, /sys) is read into memory up to MAX_UNSIZED.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO must not block the open
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        header = {"ok": True, "mode": st.st_mode & 0o7777}
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(21, f"Is a directory: {path!r}")
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} is not a regular file (a device, FIFO or socket): read it with exec")
        if st.st_size > MAX_FILE:
            raise ValueError(f"{path} is {st.st_size} bytes, over read_file's limit of {MAX_FILE}: "
                             "read it in parts (e.g. exec 'split' or 'dd')")
        if st.st_size < CHUNK:  # small, or /proc and /sys (size 0 in stat)
            send_frame(conn, header, _read_capped(f, st.st_size, path, MAX_FILE if st.st_size else MAX_UNSIZED))
            return
        size = st.st_size
        head = _dumps(header).encode()
        conn.sendall(_HEAD.pack(len(head), size) + head)
        sent = _sendfile(conn, fd, size)
        if sent < size:  # the file shrank under us: the frame cannot be completed
            raise ConnectionError(f"{path} shrank while being read")


def _sendfile(conn: _socket.socket, fd: int, size: int) -> int:
    """Send ``size`` bytes of the file ``fd`` by os.sendfile (socket.sendfile's work): how many went before
    the file ended. A connection with a timeout is non-blocking underneath: wait for room within it."""
    sent = 0
    while sent < size:
        try:
            n = os.sendfile(conn.fileno(), fd, sent, min(size - sent, 1 << 30))
        except BlockingIOError:
            poll = select.poll()
            poll.register(conn.fileno(), select.POLLOUT)
            timeout = conn.gettimeout()
            if not poll.poll(None if timeout is None else timeout * 1000):
                raise TimeoutError("timed out") from None
            continue
        if not n:
            break
        sent += n
    return sent


def _read_capped(f: Any, hint: int, path: str, cap: int) -> bytes:
    """The rest of ``f``, at most ``cap`` bytes, reading ``hint`` + 1 bytes first (a small file: one read)."""
    parts = [f.read(min(hint + 1, cap + 1) if hint else min(CHUNK, cap + 1))]
    total = len(parts[0])
    while parts[-1] and total <= cap:
        parts.append(f.read(min(CHUNK, cap + 1 - total)))
        total += len(parts[-1])
    if total > cap:
        raise ValueError(f"{path} is over read_file's limit of {cap} bytes for a file of this kind")
    return parts[0] if len(parts) <= 2 else b"".join(parts)


_prctl: list[Any] = []


def not_dumpable() -> None:
    """PR_SET_DUMPABLE 0: no process of the sandbox can ptrace the agent, read its memory or its /proc files.

    Best effort: an image's python3 without ctypes still runs the agent.
    """
    with suppress(Exception):
        if not _prctl:
            import ctypes

            _prctl.append(ctypes.CDLL(None, use_errno=True).prctl)
        _prctl[0](_PR_SET_DUMPABLE, 0, 0, 0, 0)


def main(path: str = SOCKET_PATH) -> None:
    """Serve forever on ``path`` (another path is for running the agent outside a sandbox, in tests)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
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
    agent = Agent(log_dir=os.path.join(here, "proc"), own_dirs=OWN_DIRS if path == SOCKET_PATH else (here,))
    not_dumpable()
    # PID 1 of its namespace gets only the signals it handles from inside: handle these, and do nothing.
    # (A handler, not SIG_IGN: handlers are reset by exec, an ignored signal would stay ignored in every
    # command.) The host stops a sandbox with SIGKILL, through runc.
    for sig in (_signal.SIGTERM, _signal.SIGINT, _signal.SIGHUP):
        _signal.signal(sig, _ignore)
    server = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    server.bind(path)
    agent.socket_path = path
    server.listen(128)
    _thread.start_new_thread(agent.reap_forever, ())
    while True:  # nothing a request does may end this loop: the sandbox lives as long as it runs
        try:
            conn = _socket.socket(fileno=server._accept()[0])  # type: ignore[attr-defined]
        except OSError:
            time.sleep(0.01)
            continue
        try:
            with agent.lock:
                agent.conns.add(conn)  # before the thread starts: quiesce must never miss a connection
            try:
                _thread.start_new_thread(agent.serve, (conn,))
            except RuntimeError:  # can't start new thread: out of pids or memory
                conn.settimeout(2.0)
                agent.serve(conn, starved=True)
        except Exception:  # noqa: BLE001 - e.g. MemoryError: drop this connection, keep serving
            with suppress(Exception):
                conn.close()
            time.sleep(0.01)


def _ignore(signum: int, frame: Any) -> None:
    """The agent's answer to SIGTERM, SIGINT and SIGHUP from inside the sandbox: none."""


if __name__ == "__main__":
    main(*sys.argv[1:2])
