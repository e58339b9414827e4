"""The host end of the agent connection: exec, spawn and files over the sandbox's unix socket.

One short-lived connection per call (a connect costs tens of microseconds), so a memory snapshot
only has to close the connections of calls in flight; such a call reconnects through ``gate`` and
resumes its job from the byte offsets it already has.
"""

from __future__ import annotations

import ctypes
import os
import socket
import stat
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from agentenv import agent
from agentenv.api import OutputCallback
from agentenv.errors import ConnectionLost, SandboxError, from_wire

CALL_TIMEOUT = 120.0  # seconds an agent may stay silent on a request (beyond an exec's own timeout)


class Gate:
    """Lets calls through unless a snapshot is closing connections; calls wait while it is shut."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shut = 0

    def wait_open(self) -> None:
        with self._cond:
            while self._shut:
                self._cond.wait()

    def shut(self) -> None:
        with self._cond:
            self._shut += 1

    def open(self) -> None:
        with self._cond:
            self._shut -= 1
            self._cond.notify_all()


class Channel:
    """Calls into one sandbox's agent: the socket at ``path`` inside the root ``root()`` returns
    (``/proc/<init pid>/root`` for a sandbox)."""

    def __init__(self, root: Callable[[], str], gate: Gate, path: str = agent.SOCKET_PATH) -> None:
        self.root, self.path, self.gate = root, path, gate

    def connect(self, wait: float = 0.0, *, through_gate: bool = True) -> socket.socket:
        """Open a connection, retrying for up to ``wait`` seconds (the agent may still be starting)."""
        if through_gate:
            self.gate.wait_open()
        deadline = time.monotonic() + wait
        while True:
            try:
                return connect_in_root(self.root(), self.path)
            except OSError as e:
                if time.monotonic() >= deadline:
                    raise ConnectionLost(f"the sandbox agent does not answer ({e})",
                                         fix="the sandbox may have been closed or paused; check Sandbox.list()") from e
                time.sleep(0.002)

    def call(self, header: dict[str, Any], blob: bytes = b"") -> tuple[dict[str, Any], bytes]:
        """One request and its reply; agent-side errors become exceptions.

        A connection closed under the call (by a snapshot) is retried: every request carries a
        ``key``, and the agent answers a repeated key from memory instead of acting twice.
        """
        header = {**header, "key": uuid.uuid4().hex}
        while True:
            try:
                with self.connect() as s:
                    s.settimeout(CALL_TIMEOUT)
                    agent.send_frame(s, header, blob)
                    reply, data = agent.recv_frame(s)
            except ConnectionLost:
                raise
            except TimeoutError as e:
                raise _silent(header["op"], CALL_TIMEOUT) from e
            except ConnectionError:
                continue
            raise_for(reply)
            return reply, data

    def exec(self, header: dict[str, Any], on_output: OutputCallback | None) -> dict[str, Any]:
        """Run a command to completion; the final header carries 'stdout'/'stderr' as bytes.

        If a snapshot closes the connection, the call reconnects with the same key and resumes from
        the byte offsets it already has; the agent never starts the command twice.
        """
        stream = on_output is not None
        out = [bytearray(), bytearray()]
        request = {**header, "op": "exec", "stream": stream, "key": uuid.uuid4().hex}
        # the agent enforces the command's timeout; this one only catches an agent that went silent
        limit = None if header.get("timeout") is None else float(header["timeout"]) + CALL_TIMEOUT
        while True:
            try:
                with self.connect() as s:
                    s.settimeout(limit)
                    agent.send_frame(s, {**request, "offsets": [len(b) for b in out]})
                    first, _ = agent.recv_frame(s)
                    raise_for(first)
                    while True:
                        h, data = agent.recv_frame(s)
                        raise_for(h)
                        if "fd" in h:
                            out[h["fd"] - 1] += data
                            if on_output:
                                on_output("stdout" if h["fd"] == 1 else "stderr", data)
                            continue
                        n = h["stdout_len"]
                        tail = (data[:n], data[n:])
                        for i, name in ((0, "stdout"), (1, "stderr")):
                            out[i] += tail[i]
                            if on_output and tail[i]:
                                on_output(name, tail[i])
                        h["stdout"], h["stderr"] = bytes(out[0]), bytes(out[1])
                        return h
            except ConnectionLost:
                raise
            except TimeoutError as e:
                raise _silent("exec", limit or 0.0) from e
            except ConnectionError:
                continue  # closed by a snapshot: reconnect once the gate opens, resume from offsets


def _silent(op: str, seconds: float) -> ConnectionLost:
    return ConnectionLost(f"the sandbox agent did not answer {op} within {seconds:g} s",
                          fix="the sandbox may be frozen or out of memory; check its state, or close it")


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_SYS_OPENAT2 = 437  # the same number on x86_64 and aarch64
_RESOLVE_NO_MAGICLINKS, _RESOLVE_IN_ROOT = 0x02, 0x10
_libc = ctypes.CDLL(None, use_errno=True)


def connect_in_root(root: str, path: str) -> socket.socket:
    """Connect to the unix socket at ``path`` as resolved *inside* ``root``.

    The sandbox owns the folders on that path: resolving it with openat2(RESOLVE_IN_ROOT) and
    refusing anything but a socket at the end means a symlink planted there cannot send the host
    to a socket of its own (the Docker socket, say).
    """
    rootfd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
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
            s.connect(f"/proc/self/fd/{fd}")
        except OSError:
            s.close()
            raise
        return s
    finally:
        os.close(fd)


def raise_for(reply: dict[str, Any]) -> None:
    """Raise the exception an agent error reply stands for (an unknown name is a SandboxError)."""
    if reply.get("error") is not None:
        raise from_wire(reply, unknown=SandboxError)
