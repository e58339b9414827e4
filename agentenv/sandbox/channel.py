"""The host end of the keeper connection: exec, spawn and files over the sandbox's unix socket.

One short-lived connection per call (a connect costs tens of microseconds), so a memory snapshot
only has to close the connections of calls in flight; such a call reconnects through ``gate`` and
resumes its job from the byte offsets it already has.

What answers on the socket is not trusted: a process in the sandbox can replace it with a server of
its own. So every call has a deadline, every frame a size cap, reconnecting after a closed connection
is bounded (``RETRIES``, with backoff), and a connection to a sandbox is refused unless the process
serving it is that sandbox's keeper (``SO_PEERCRED`` against the pid the caller pinned, see ``Root``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import stat
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from agentenv.api import OutputCallback
from agentenv.errors import ConnectionLost, SandboxError, from_wire
from agentenv.host.keeper_process import Root
from agentenv.inside import frames, keeper
from agentenv.inside import jobs as keeper_jobs

CALL_TIMEOUT = 120.0  # seconds a keeper may stay silent on a request (beyond an exec's own timeout)
RETRIES = 10  # connections in a row closed before an answer (no snapshot explaining it): the call fails
BACKOFF = (0.004, 0.5)  # seconds slept after the first such close, doubling up to the second figure
START_POLL = 0.005  # seconds at most between attempts to reach a keeper still starting (it answers in tens of ms)


class Gate:
    """Lets calls through unless a snapshot is closing connections; calls wait while it is shut.

    ``epoch`` counts the shuts: a call whose connection closed while it changed knows why.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shut = 0
        self.epoch = 0

    def wait_open(self, timeout: float | None = None) -> bool:
        """Wait until no snapshot holds the gate; False if ``timeout`` seconds passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._shut, timeout)

    def shut(self) -> None:
        with self._cond:
            self._shut += 1
            self.epoch += 1

    def open(self) -> None:
        with self._cond:
            self._shut -= 1
            self._cond.notify_all()


class Channel:
    """Calls into one sandbox's keeper: the socket at ``path`` inside the root ``root()`` returns
    (a ``Root`` pinned to the sandbox's keeper, or a plain folder in tests)."""

    def __init__(self, root: Callable[[], str | Root], gate: Gate, path: str = keeper.SOCKET_PATH) -> None:
        self.root, self.path, self.gate = root, path, gate

    def connect(self, wait: float = 0.0, *, through_gate: bool = True, deadline: float | None = None,
                at_once: bool = False) -> socket.socket:
        """Open a connection, retrying for up to ``wait`` seconds (the keeper may still be starting).

        Through the gate, it waits for a snapshot in progress, until ``deadline`` at most. ``at_once``: a keeper whose
        queue of connections is full (it is frozen, or busy) is an OSError now, never a wait.
        """
        if through_gate and not self.gate.wait_open(None if deadline is None else deadline - time.monotonic()):
            raise ConnectionLost("a snapshot of the sandbox held the call past its deadline",
                                 fix="retry; a snapshot that takes this long is stuck (check the sandbox's state)")
        end = time.monotonic() + wait
        delay = 0.002
        while True:
            try:
                return connect_in_root(self.root(), self.path, at_once)
            except OSError as e:
                left = end - time.monotonic()
                if left <= 0:
                    raise ConnectionLost(f"the sandbox keeper does not answer ({e})",
                                         fix="the sandbox may have been closed or paused; check Sandbox.list()") from e
                time.sleep(min(delay, left))
                delay = min(delay * 2, START_POLL)

    def call(self, header: dict[str, Any], blob: bytes = b"", *, timeout: float | None = None,
             max_blob: int = frames.MAX_BLOB) -> tuple[dict[str, Any], bytes]:
        """One request and its reply within ``timeout`` seconds (``CALL_TIMEOUT``); keeper-side errors
        become exceptions.

        A connection closed under the call (by a snapshot) is retried: every request carries a
        ``key``, and the keeper answers a repeated key from memory instead of acting twice.
        """
        limit = CALL_TIMEOUT if timeout is None else timeout
        deadline = time.monotonic() + limit
        header = {**header, "key": uuid.uuid4().hex}
        failures = 0
        while True:
            epoch = self.gate.epoch
            try:
                with typed_failures(header["op"], limit), self.connect(deadline=deadline) as s:
                    frames.send_frame(s, header, blob, deadline)
                    reply, data = frames.recv_frame(s, max_blob, deadline)
            except ConnectionLost:
                raise
            except ConnectionError as e:
                failures = self.retry(failures, epoch, deadline, e)
                continue
            raise_for(reply)
            return reply, data

    def last_word(self, header: dict[str, Any], timeout: float) -> None:
        """A request the keeper answers and then closes its end on (quiesce; reroot, as it execs itself): returns
        once it has closed. Not retried, and not through the gate (a snapshot shuts it to send a quiesce);
        TimeoutError past ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self.connect(through_gate=False) as s:
            frames.send_frame(s, header, deadline=deadline)
            reply, _ = frames.recv_frame(s, 0, deadline)
            raise_for(reply)
            with contextlib.suppress(ConnectionError):
                frames.recv_frame(s, 0, deadline)  # returns only when the keeper closed its end

    def tunnel(self, port: int, timeout: float) -> socket.socket:
        """A connection to ``127.0.0.1:port`` inside the sandbox, made by its keeper in the sandbox's namespace: once
        this returns, its bytes are the port's both ways (blocking; the caller sets its own deadlines and closes
        it). ``ConnectionRefusedError`` (or another ``OSError``) when nothing accepts there; not retried."""
        deadline = time.monotonic() + timeout
        s = self.connect(deadline=deadline)
        try:
            try:
                with typed_failures("tunnel", timeout):
                    frames.send_frame(s, {"op": "tunnel", "port": port}, deadline=deadline)
                    reply, _ = frames.recv_frame(s, 0, deadline)
            except ConnectionLost:
                raise
            except ConnectionError as e:  # closed without an answer: the keeper's failure, not the port's
                raise ConnectionLost(f"the sandbox keeper closed the connection instead of opening port {port} ({e})",
                                     fix="the sandbox may be out of memory or processes; check its state") from e
            raise_for(reply)  # nothing listens: an OSError (ConnectionRefusedError, mostly)
        except BaseException:
            s.close()
            raise
        s.settimeout(None)
        return s

    def exec(self, header: dict[str, Any], on_output: OutputCallback | None) -> dict[str, Any]:
        """Run a command to completion; the final header carries 'stdout'/'stderr' as bytes.

        If a snapshot closes the connection, the call reconnects with the same key and resumes from
        the byte offsets it already has; the keeper never starts the command twice.
        """
        stream = on_output is not None
        out = [bytearray(), bytearray()]
        request = {**header, "op": "exec", "stream": stream, "key": uuid.uuid4().hex}
        # the keeper enforces the command's timeout; this one only catches a keeper that went silent
        limit = None if header.get("timeout") is None else float(header["timeout"]) + CALL_TIMEOUT
        deadline = None if limit is None else time.monotonic() + limit
        failures = 0
        while True:
            epoch = self.gate.epoch
            try:
                with typed_failures("exec", CALL_TIMEOUT), self.connect(deadline=deadline) as s:
                    frames.send_frame(s, {**request, "offsets": [len(b) for b in out]}, deadline=_soonest(deadline))
                    first, _ = frames.recv_frame(s, 0, _soonest(deadline))
                    raise_for(first)
                    # a keeper that sends heartbeats is silent for CALL_TIMEOUT at most; one from an older
                    # snapshot only answers when the command ends
                    beats = bool(first.get("beat"))
                    while True:
                        h, data = frames.recv_frame(s, keeper_jobs.MAX_EXEC_BLOB, _soonest(deadline) if beats else deadline)
                        raise_for(h)
                        if h.get("beat"):
                            continue
                        if "fd" in h:
                            fd = h["fd"]
                            if fd not in (1, 2) or len(out[fd - 1]) + len(data) > keeper_jobs.MAX_OUTPUT:
                                raise frames.FrameError("an output frame past the keeper's limits")
                            out[fd - 1] += data
                            if data:
                                failures = 0  # progress: a later close is not the same failure again
                            if on_output:
                                on_output("stdout" if fd == 1 else "stderr", data)
                            continue
                        n = _checked_result(h, len(data))
                        tail = (data[:n], data[n:])
                        for i, name in ((0, "stdout"), (1, "stderr")):
                            if len(out[i]) + len(tail[i]) > keeper_jobs.MAX_OUTPUT:
                                raise frames.FrameError("a result frame past the keeper's limits")
                            out[i] += tail[i]
                            if on_output and tail[i]:
                                on_output(name, tail[i])
                        h["stdout"], h["stderr"] = bytes(out[0]), bytes(out[1])
                        return h
            except ConnectionLost:
                raise
            except ConnectionError as e:  # closed by a snapshot: reconnect once the gate opens, resume from offsets
                failures = self.retry(failures, epoch, deadline, e)

    def retry(self, failures: int, epoch: int, deadline: float | None, err: Exception) -> int:
        """After a connection closed before the answer: go on (with backoff) or give up (ConnectionLost).

        A close while a snapshot in this process shut the gate is expected and costs nothing; any other
        counts, and ``RETRIES`` in a row (or the deadline) end the call: a keeper that accepts and closes
        at once (a fake one, or one out of memory) cannot keep a caller spinning.
        """
        if self.gate.epoch != epoch:
            return failures
        failures += 1
        left = None if deadline is None else deadline - time.monotonic()
        if failures >= RETRIES or (left is not None and left <= 0):
            raise ConnectionLost(f"the sandbox keeper closed the connection {failures} times without answering ({err})",
                                 fix="the sandbox may be out of memory or processes, or its keeper's socket was "
                                     "replaced from inside; check its state, or close it") from err
        pause = min(BACKOFF[0] * 2 ** (failures - 1), BACKOFF[1])
        time.sleep(pause if left is None else min(pause, left))
        return failures


def _soonest(deadline: float | None) -> float:
    """The deadline of the next frame: CALL_TIMEOUT from now, or the call's own deadline if sooner."""
    silence = time.monotonic() + CALL_TIMEOUT
    return silence if deadline is None else min(deadline, silence)


def _checked_result(h: dict[str, Any], blob_len: int) -> int:
    """Validate an exec's final frame (the sandbox can forge it); returns the stdout length in its blob."""
    n = h.get("stdout_len")
    dropped = h.get("dropped")
    ok = (isinstance(n, int) and 0 <= n <= blob_len and (h.get("exit_code") is None or isinstance(h["exit_code"], int))
          and isinstance(h.get("duration"), int | float) and isinstance(h.get("timed_out"), bool)
          and isinstance(dropped, list) and len(dropped) == 2 and all(isinstance(d, int) for d in dropped))
    if not ok:
        raise frames.FrameError("a malformed result frame")
    assert isinstance(n, int)
    return n


@contextlib.contextmanager
def typed_failures(op: str, seconds: float) -> Iterator[None]:
    """A call's wire failures as ``ConnectionLost``: a frame that breaks the protocol, or a keeper silent for
    ``seconds`` (what stays a plain ``ConnectionError`` is a close the caller may retry)."""
    try:
        yield
    except frames.FrameError as e:
        raise _broken(e) from e
    except TimeoutError as e:
        raise _silent(op, seconds) from e


def _broken(e: Exception) -> ConnectionLost:
    return ConnectionLost(f"what answers on the sandbox's keeper socket broke the protocol ({e})",
                          fix="a process in the sandbox may have replaced the keeper's socket; close the sandbox")


def _silent(op: str, seconds: float) -> ConnectionLost:
    return ConnectionLost(f"the sandbox keeper did not answer {op} within {seconds:g} s",
                          fix="the sandbox may be frozen or out of memory; check its state, or close it")


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_SYS_OPENAT2 = 437  # the same number on x86_64 and aarch64
_RESOLVE_NO_MAGICLINKS, _RESOLVE_IN_ROOT = 0x02, 0x10
_libc = ctypes.CDLL(None, use_errno=True)


_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def connect_in_root(root: str | Root, path: str, at_once: bool = False) -> socket.socket:
    """Connect to the unix socket at ``path`` as resolved *inside* ``root``.

    The sandbox owns the folders on that path: resolving it with openat2(RESOLVE_IN_ROOT) and
    refusing anything but a socket at the end means a symlink planted there cannot send the host
    to a socket of its own (the Docker socket, say). With a ``Root`` (whose descriptor this closes),
    the socket must also be served by the process ``root.pid``: a server that a process of the
    sandbox put in the keeper's place is refused before a byte is exchanged. ``at_once``: a server whose queue of
    connections is full is a BlockingIOError at once, not a wait for it to accept.
    """
    rootfd = root.fd if isinstance(root, Root) else os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        how = _OpenHow(os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, 0, _RESOLVE_IN_ROOT | _RESOLVE_NO_MAGICLINKS)
        fd = _libc.syscall(_SYS_OPENAT2, rootfd, path.encode(), ctypes.byref(how), ctypes.sizeof(how))
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), path)
    finally:
        os.close(rootfd)
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            raise ConnectionRefusedError(f"{path} in the sandbox is not a socket (replaced by the sandbox?)")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if at_once:  # a unix socket's connect does not block then: a full queue is EAGAIN
                s.setblocking(False)
            s.connect(f"/proc/self/fd/{fd}")
            s.setblocking(True)
            if isinstance(root, Root):
                peer = _PEERCRED.unpack(s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))[0]
                if peer != root.pid:
                    raise ConnectionRefusedError(f"{path} in the sandbox is served by pid {peer}, not by its keeper "
                                                 f"(pid {root.pid}): replaced from inside?")
        except OSError:
            s.close()
            raise
        return s
    finally:
        os.close(fd)


def raise_for(reply: dict[str, Any]) -> None:
    """Raise the exception a keeper error reply stands for (an unknown name is a SandboxError)."""
    if reply.get("error") is not None:
        raise from_wire(reply, unknown=SandboxError)
