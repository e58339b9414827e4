"""The host end of jobs and file system calls: what ``Sandbox.start``, ``output``, ``stat`` and the rest send.

A job made by ``start`` runs on its own; the keeper buffers its output (both streams, up to its
``max_output``) until ``output`` reads it, from absolute byte offsets, so a reader may stop and come back
later, from another process or after a snapshot, and a reader that will never look back lets the keeper
drop what it read (``discard``). The keeper forgets the job once ``output`` delivered its end; ``tail`` looks at
the last bytes and takes nothing (a console's view).

What the keeper answers is checked like every reply (``agentenv.sandbox.channel``): frames capped, offsets and
results validated, reconnecting bounded.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Generator, Iterator
from typing import Any

from agentenv.api import FileInfo, JobEnd, JobInfo, JobOutput
from agentenv.errors import ConnectionLost
from agentenv.inside import frames
from agentenv.inside.jobs import INPUT_TIMEOUT, MAX_EXEC_BLOB
from agentenv.sandbox.channel import (
    CALL_TIMEOUT,
    Channel,
    _broken,
    _checked_result,
    _soonest,
    raise_for,
    typed_failures,
)

STREAMS = ("stdout", "stderr")


def start(ch: Channel, command: str, *, cwd: str | None, env: dict[str, str] | None, timeout: float | None,
          stdin: bool, tag: str | None, max_output: int, pty: tuple[int, int] | None = None) -> JobInfo:
    """Start a job; with ``pty`` (rows, cols) on a new terminal of that size, whose output comes as one stream,
    "pty", and whose input is typed at it."""
    if timeout is not None and timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    header: dict[str, Any] = {"op": "start", "cmd": command, "cwd": cwd, "env": env or {}, "timeout": timeout,
              "stdin": bool(stdin), "tag": tag, "max_output": max_output}
    if pty is not None:
        header["pty"] = _size(pty)
    reply, _ = ch.call(header)
    return _job(reply)


def _size(size: tuple[int, int]) -> dict[str, int]:
    rows, cols = size
    return {"rows": int(rows), "cols": int(cols)}


def resize(ch: Channel, pid: int, size: tuple[int, int]) -> None:
    """Set the (rows, cols) of the terminal of a job started with ``pty``."""
    ch.call({"op": "resize", "pid": pid, "pty": _size(size)})


def listing(ch: Channel) -> list[JobInfo]:
    reply, _ = ch.call({"op": "jobs"})
    if not isinstance(reply.get("jobs"), list):
        raise _broken(frames.FrameError("a malformed job list"))
    return [_job(j) for j in reply["jobs"]]


def _job(reply: Any) -> JobInfo:
    try:
        info = JobInfo.from_wire(reply)
    except (TypeError, AttributeError) as e:
        raise _broken(frames.FrameError(f"a malformed job ({e})")) from e
    if type(info.pid) is not int:
        raise _broken(frames.FrameError("a malformed job"))
    return info


def output(ch: Channel, pid: int, offsets: tuple[int, int] | None, follow: bool) -> Reading:
    """The job's output from ``offsets`` (None: the oldest byte kept), None for a heartbeat, JobEnd last.

    A connection closed under it (a memory snapshot) is reopened through the gate, from the offsets reached.
    """
    return Reading(ch, pid, offsets, follow)


class Reading(Iterator[JobOutput | JobEnd | None]):
    """What ``output`` returns (it connects when first iterated). ``interrupt`` (from any thread) ends it at once
    by shutting its connection, so an end the keeper has not sent yet stays with the keeper for the next reader
    (a server whose client went away must not swallow it)."""

    def __init__(self, ch: Channel, pid: int, offsets: tuple[int, int] | None, follow: bool) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self.interrupted = False
        self._items = _read(ch, pid, None if offsets is None else [int(offsets[0]), int(offsets[1])], follow, self)

    def __next__(self) -> JobOutput | JobEnd | None:
        return next(self._items)

    def close(self) -> None:
        self._items.close()

    def interrupt(self) -> None:
        with self._lock:
            self.interrupted = True
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)

    @contextlib.contextmanager
    def connected(self, ch: Channel) -> Iterator[socket.socket | None]:
        """A connection to the keeper that ``interrupt`` can shut (never once closed); None once interrupted."""
        s = ch.connect()
        with self._lock:
            self._sock = None if self.interrupted else s
            given = self._sock
        try:
            yield given
        finally:
            with self._lock:
                self._sock = None
                s.close()


def _read(ch: Channel, pid: int, pos: list[int] | None, follow: bool, reading: Reading
          ) -> Generator[JobOutput | JobEnd | None, None, None]:
    failures = 0
    while True:
        epoch = ch.gate.epoch
        try:
            with typed_failures("attach", CALL_TIMEOUT), reading.connected(ch) as s:
                if s is None:
                    return
                frames.send_frame(s, {"op": "attach", "pid": pid, "offsets": pos, "follow": follow},
                                 deadline=_soonest(None))
                first, _ = frames.recv_frame(s, 0, _soonest(None))
                raise_for(first)
                pos = _offsets(first.get("offsets"), pos)
                names = ("pty", "stderr") if first.get("pty") is True else STREAMS
                while True:
                    h, data = frames.recv_frame(s, MAX_EXEC_BLOB, _soonest(None))
                    raise_for(h)
                    if h.get("beat"):
                        yield None
                        continue
                    if "fd" in h:
                        if h["fd"] not in (1, 2):
                            raise frames.FrameError("an output frame for no stream")
                        i = h["fd"] - 1
                        at = h.get("at")
                        if type(at) is not int or at < pos[i]:
                            raise frames.FrameError("an output frame from a wrong offset")
                        pos[i] = at + len(data)
                        if data:
                            failures = 0  # progress: a later close is not the same failure again
                            yield JobOutput(stream=names[i], data=data, offset=at)
                        continue
                    at = _offsets(h.get("at"), pos)
                    if h.get("running"):
                        return
                    n = _checked_result(h, len(data))
                    if not isinstance(h.get("exit_code"), int):
                        raise frames.FrameError("a result without an exit code")
                    for i, tail in ((0, data[:n]), (1, data[n:])):
                        if tail:
                            yield JobOutput(stream=names[i], data=tail, offset=at[i])
                    yield JobEnd(exit_code=h["exit_code"], timed_out=h["timed_out"], duration=float(h["duration"]))
                    return
        except ConnectionLost:
            raise
        except ConnectionError as e:  # closed by a snapshot: reconnect once the gate opens, go on from pos
            if reading.interrupted:  # or shut by interrupt: the reader is gone
                return
            failures = ch.retry(failures, epoch, None, e)


def _offsets(value: Any, floor: list[int] | None) -> list[int]:
    """Two absolute offsets from the keeper, none below what this reader already has (it never goes back)."""
    if not (isinstance(value, list) and len(value) == 2 and all(type(v) is int and v >= 0 for v in value)):
        raise frames.FrameError("malformed offsets")
    if floor is not None and any(v < f for v, f in zip(value, floor, strict=True)):
        raise frames.FrameError("offsets going back")
    return list(value)


def tail(ch: Channel, pid: int, size: int) -> list[JobOutput]:
    """The last ``size`` bytes (at most) of each stream of a job's output, without taking them: they stay for
    ``output``, and so does the job's end (a console's view of a job must not swallow what its owner reads)."""
    if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= MAX_EXEC_BLOB // 2:
        raise ValueError(f"a tail's size must be 1 to {MAX_EXEC_BLOB // 2} bytes, got {size!r}")
    reply, blob = ch.call({"op": "tail", "pid": pid, "size": size}, max_blob=2 * size)
    n = reply.get("stdout_len")
    try:
        at = _offsets(reply.get("at"), None)
        if type(n) is not int or not 0 <= n <= len(blob) or n > size or len(blob) - n > size:
            raise frames.FrameError("a malformed tail")
    except frames.FrameError as e:
        raise _broken(e) from None
    names = ("pty", "stderr") if reply.get("pty") is True else STREAMS
    return [JobOutput(stream=names[i], data=d, offset=at[i]) for i, d in enumerate((blob[:n], blob[n:])) if d]


def discard(ch: Channel, pid: int, offsets: tuple[int, int]) -> None:
    ch.call({"op": "discard", "pid": pid, "offsets": [int(offsets[0]), int(offsets[1])]})


def send_input(ch: Channel, pid: int, data: bytes) -> None:
    """Write ``data`` to the job's stdin, a piece at a time (each one a request the keeper takes once)."""
    view = memoryview(bytes(data))
    for at in range(0, max(len(view), 1), frames.SMALL_BLOB):  # nothing: still one request (is there such a job?)
        ch.call({"op": "input", "pid": pid}, bytes(view[at:at + frames.SMALL_BLOB]),
                timeout=INPUT_TIMEOUT + CALL_TIMEOUT)


def close_input(ch: Channel, pid: int) -> None:
    ch.call({"op": "close_stdin", "pid": pid}, timeout=INPUT_TIMEOUT + CALL_TIMEOUT)


def signal(ch: Channel, pid: int, sig: int) -> None:
    ch.call({"op": "kill", "pid": pid, "signal": int(sig)})


def fs(ch: Channel, do: str, path: str, **extra: Any) -> dict[str, Any]:
    return ch.call({"op": "fs", "do": do, "path": path, **extra})[0]


def file_info(reply: Any) -> FileInfo:
    try:
        return FileInfo.from_wire(reply)
    except (TypeError, AttributeError) as e:
        raise _broken(frames.FrameError(f"a malformed file info ({e})")) from e


def stat(ch: Channel, path: str, resolve: bool = False) -> FileInfo:
    return file_info(fs(ch, "stat", path, **({"resolve": True} if resolve else {})).get("info"))


def list_dir(ch: Channel, path: str, depth: int, resolve: bool = False) -> list[FileInfo]:
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth must be an integer >= 1, got {depth!r}")
    entries = fs(ch, "list", path, depth=depth, **({"resolve": True} if resolve else {})).get("entries")
    if not isinstance(entries, list):
        raise _broken(frames.FrameError("a malformed listing"))
    return [file_info(e) for e in entries]


def make_dir(ch: Channel, path: str) -> bool:
    return bool(fs(ch, "mkdir", path).get("made"))


def move(ch: Channel, src: str, dst: str) -> FileInfo:
    return file_info(fs(ch, "move", src, dst=dst).get("info"))


def remove(ch: Channel, path: str) -> None:
    fs(ch, "remove", path)
