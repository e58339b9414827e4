"""The keeper's jobs: the commands it starts, their buffered output and exit status, and the reaper that
collects every exit (the keeper is PID 1, so orphans' too).

A job is addressed by id, so a client whose connection was closed (the host closes every connection before a
memory snapshot) reconnects and resumes from the byte offsets it already has. A job made by ``start`` is
addressed by pid instead (``attach``, ``input``, ``discard``, ``kill``) and stays until its end is delivered;
its output waits in the keeper, from absolute offsets, until read (or discarded). How a command starts (its
session, pipes or terminal, account) and how a job's processes are killed is ``commands.py``.
"""

from __future__ import annotations

import _socket
import _thread
import errno
import os
import select
import time

from agentenv.inside.commands import Child, Starved, kill_job, start_command
from agentenv.inside.frames import Condition, send_frame, send_parts, suppress

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

MAX_OUTPUT = 64 << 20  # bytes kept per stream of one job (or the request's max_output); the rest is counted
OUTPUT_BUDGET = 4  # all jobs' unread output together: this many times a job's max_output (the sandbox's memory)
OUTPUT_FLOOR = 64 << 10  # bytes per stream a job keeps whatever the others hold: small commands always answer
MAX_EXEC_BLOB = 2 * MAX_OUTPUT  # an exec output frame carries at most both streams' buffers
ABANDONED = 3600.0  # seconds a finished job's result waits for its caller
INPUT_TIMEOUT = 30.0  # seconds at most one write to a job's stdin may wait for the job to read


def _heartbeat() -> float:
    """Seconds between an exec's "still running" frames: 5, or $AGENTENV_HEARTBEAT (for tests) within 0.05..30."""
    try:
        return min(30.0, max(0.05, float(os.environ.get("AGENTENV_HEARTBEAT", "5"))))
    except ValueError:
        return 5.0


HEARTBEAT = _heartbeat()


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
        self.held = 0  # bytes of out counted in the keeper's output budget
        self.info: dict[str, Any] = {}  # a started job's request, for listing
        self.tty: dict[str, int] | None = None  # a job on a terminal (``pty``): its size; one output stream
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

class Jobs:
    """The keeper's process table and reaper, and the job calls the request handlers make (``keeper.Keeper``)."""

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir  # where spawned commands' logs go
        self.lock = _thread.allocate_lock()
        self.jobs: dict[int, Job] = {}
        self.spawned: dict[int, dict[str, Any]] = {}  # pid -> {"cmd", "exit_code", "log"}
        self.by_pid: dict[int, Job] = {}
        self.started: dict[int, Job] = {}  # pid -> job made by start, until its end is delivered
        self.buffered = 0  # bytes of output all jobs hold (OUTPUT_BUDGET), under ``budget``: a leaf lock
        self.budget = _thread.allocate_lock()
        self.next_id = 1
        self.child_started = Condition()  # reap_forever sleeps on it while the keeper has no child
        self.new_child = False  # a child was started since reap_forever last found none (under child_started)
        self.closing: set[_socket.socket] = set()  # connections quiesce is closing: their waits and writes end
        self.keys: dict[str, int] = {}  # request key -> job id, until the result is delivered
        self.replies: dict[str, dict[str, Any]] = {}  # spawn replies by request key

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
        """Start the request's command (``commands.start_command``) and wake the reaper. Callers hold self.lock."""
        child = start_command(header, job_id, output)
        with self.child_started:
            self.new_child = True
            self.child_started.notify_all()
        return child

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
            job.tty = header.get("pty")
            job.key = header.get("key", "")
            self.keys[job.key] = job_id
            self.by_pid[proc.pid] = job
            if listed:
                env = header.get("env") or {}
                job.info = {"command": str(header["cmd"]), "cwd": header.get("cwd"), "env": dict(env),
                            "tag": header.get("tag"), "stdin": bool(header.get("stdin") or job.tty),
                            "pty": job.tty is not None}
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
        ends = [e for e in (job.proc.stdout, job.proc.stderr) if e is not None]
        streams = {e.fileno(): i for i, e in enumerate(ends)}  # fd -> index in job.out
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
                except OSError as e:  # EIO: a terminal's master once the last holder of its slave end is gone
                    if e.errno != errno.EIO:
                        raise
                    data = b""
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
        for end in ends:
            end.close()
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

    def wait(self, conn: _socket.socket, job_id: int, offsets: list[int], stream: bool, follow: bool = True) -> None:
        """Send a job's output from the given absolute offsets (as it comes when streaming), then its result.

        Every ``HEARTBEAT`` seconds without anything to send, a ``{"beat": true}`` frame tells the
        host the keeper still runs (so that it can tell a long silent command from a stopped keeper).
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


def close_stdin(job: Job) -> None:
    """Close a job's stdin (EOF for the job); callers hold its stdin_lock."""
    if job.proc.stdin is not None:
        with suppress(OSError):
            job.proc.stdin.close()


