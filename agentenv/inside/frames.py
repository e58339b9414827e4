"""The keeper's wire, shared by both ends, and the standard-library pieces it stands on instead of heavier ones.

Wire format, both ways: ``>II`` (header length, blob length), a JSON header, then raw bytes. Every frame is capped
(``MAX_HEADER``, and a blob limit the reader chooses); big blobs move in ``CHUNK``-sized pieces. The host imports
this module as it is; in a sandbox it is the first part of the keeper (``agentenv.host.keeper_start`` joins them).

Every sandbox start waits for the keeper to import, so this imports only C modules (and struct): json, socket,
threading and contextlib cost ~13 ms of each start (enum, re, functools, collections under them), as much as the
interpreter's own start. So locks come from _thread, and JSON goes through _json (see ``_codec``).
"""

from __future__ import annotations

import _json
import _socket
import _thread
import struct
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

MAX_HEADER = 32 << 20  # bytes of one frame's JSON header (an exec's command and env included)
MAX_FILE = 1 << 30  # bytes of one file read or written through the file API
MAX_BLOB = MAX_FILE  # default cap of one frame's raw bytes
CHUNK = 1 << 20  # files and big frames move in pieces of this size
SMALL_BLOB = 1 << 20  # blobs of requests other than write are read into memory only up to this
_HEAD = struct.Struct(">II")


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


# --- framing -----------------------------------------------------------------------------------------


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


HEAD_SIZE = _HEAD.size  # bytes of a frame's lengths, before its header


def lengths(head: bytes, max_blob: int = MAX_BLOB, max_header: int = MAX_HEADER) -> tuple[int, int]:
    """A frame's header and blob lengths, from its first ``HEAD_SIZE`` bytes; FrameError past the caps."""
    hlen, blen = _HEAD.unpack(head)
    if hlen > max_header or blen > max_blob:
        raise FrameError(f"frame of {hlen} + {blen} bytes is over the limit ({max_header} + {max_blob})")
    return int(hlen), int(blen)


def header_of(raw: bytes) -> dict[str, Any]:
    """A frame's header from its bytes; FrameError unless they are a JSON object."""
    try:
        header = _loads(raw.decode())
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise FrameError(f"frame header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise FrameError("frame header is not a JSON object")
    return header


def recv_header(sock: _socket.socket, max_blob: int = MAX_BLOB, deadline: float | None = None,
                max_header: int = MAX_HEADER) -> tuple[dict[str, Any], int]:
    """Receive a frame's header (at most ``max_header`` bytes) and the length of the blob that follows (not read
    yet)."""
    hlen, blen = lengths(_recv_exact(sock, HEAD_SIZE, deadline), max_blob, max_header)
    return header_of(_recv_exact(sock, hlen, deadline)), blen


def recv_frame(sock: _socket.socket, max_blob: int = MAX_BLOB, deadline: float | None = None,
               max_header: int = MAX_HEADER) -> tuple[dict[str, Any], bytes]:
    """Receive one frame; ConnectionError when the peer closed, FrameError past the caps,
    TimeoutError past ``deadline`` (a ``time.monotonic()`` instant)."""
    header, blen = recv_header(sock, max_blob, deadline, max_header)
    return header, _recv_exact(sock, blen, deadline) if blen else b""


def drain(sock: _socket.socket, n: int) -> None:
    """Read and drop ``n`` bytes, a chunk at a time."""
    while n > 0:
        chunk = sock.recv(min(n, CHUNK))
        if not chunk:
            raise ConnectionError("connection closed")
        n -= len(chunk)

