"""The connection between a post-copy migration's page server and its receiver, authenticated both ways.

CRIU's page server took the first connection to its port as its one receiver: any local user connecting first read
the sandbox's memory from it (``PS_IOV_GET``) and left the real receiver none; and once it was gone, anyone could
take its port and feed a receiver pages of their own (issue 40). CRIU's TLS (``--tls``) would authenticate the
peer, but its page server still serves only the first connection it accepts: a stranger connecting first would
still fail the move. So agentenv holds the listening socket and hands CRIU a connection only once its peer proved
it holds the migration's key; CRIU serves a socket it is given (``--ps-socket FD``) instead of listening.

- The source (``Listener``) binds its port (the kernel picks it: no window between choosing and binding) before
  its snapshot names it, and runs ``criu dump --lazy-pages --ps-socket`` over one end of a socket pair. Every
  connection must complete the handshake within HANDSHAKE_TIMEOUT; they are handled side by side (one selector
  thread), so one that holds its connection delays nobody, and a stranger reads a random nonce and a MAC at
  most. The first that proves the key is relayed to CRIU's end (``splice``: the pages do not pass through
  Python's memory); the listener closes then, and with ``close`` on every other path (the move finished,
  abandoned, past its deadline; the server's death closes it with the process, and CRIU, its pair closed, ends).
- The receiver (``connect``) checks the source's proof before it hands the connection to ``criu lazy-pages
  --ps-socket``: a stranger on the port feeds it nothing.

The handshake is a mutual challenge-response, HMAC-SHA256 over both sides' nonces, keyed by 32 random bytes made
for one migration (``new_key``), which the source's ``migrate`` reply gives its caller and the caller gives the
receiver's ``receive``: never in the snapshot, its labels or a file. The stream is not encrypted: on loopback no
unprivileged user can read or inject into another's TCP connection; between hosts it needs a tunnel
(docs/transfer.md).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import os
import secrets
import selectors
import socket
import threading
import time
from dataclasses import dataclass

from agentenv.errors import CheckpointError

KEY_BYTES = 32
MAGIC = b"agentenv-pages/1"  # the receiver's first bytes, before its nonce
NONCE = 32
HANDSHAKE_TIMEOUT = 10.0  # seconds a connection has to prove the key (the receiver answers in well under 1 ms)
MAX_PENDING = 128  # connections mid-handshake at once; past that the oldest is dropped
ACCEPTED = b"\x01"
RELAY_CHUNK = 1 << 20  # bytes a splice moves at most (the pipe between is grown to hold it where allowed)


def new_key() -> bytes:
    """A migration's key: random, for one migration alone."""
    return secrets.token_bytes(KEY_BYTES)


@dataclass(frozen=True)
class Endpoint:
    """Where a post-copy migration's pages are served, and the key its page server asks for."""

    address: str
    port: int
    key: bytes

    def __str__(self) -> str:
        return f"{self.address}:{self.port}"


def _mac(key: bytes, side: bytes, nonce_r: bytes, nonce_s: bytes) -> bytes:
    """The proof that ``side`` (b"S" the source, b"R" the receiver) holds ``key``, bound to both nonces."""
    return hmac.new(key, side + nonce_r + nonce_s, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the connection closed mid-handshake")
        data += chunk
    return data


def connect(page_server: Endpoint, timeout: float = HANDSHAKE_TIMEOUT) -> socket.socket:
    """A connection to the migration's page server that proved it holds the key (and to which this side proved
    it), ready for ``criu lazy-pages --ps-socket``; CheckpointError if none can be made or the peer is not it."""
    try:
        sock = socket.create_connection((page_server.address, page_server.port), timeout=timeout)
    except OSError as e:
        raise CheckpointError(f"could not connect to the migration's page server at {page_server}: {e}",
                              fix="the source's page server is gone (the move ended, or passed its deadline): "
                                  "move the sandbox again") from None
    try:
        nonce_r = secrets.token_bytes(NONCE)
        sock.sendall(MAGIC + nonce_r)
        reply = _recv_exact(sock, NONCE + 32)
        nonce_s, proof = reply[:NONCE], reply[NONCE:]
        if not hmac.compare_digest(proof, _mac(page_server.key, b"S", nonce_r, nonce_s)):
            raise ConnectionError("its proof does not match the migration's key")
        sock.sendall(_mac(page_server.key, b"R", nonce_r, nonce_s))
        if _recv_exact(sock, 1) != ACCEPTED:
            raise ConnectionError("it did not accept this side's proof")
        sock.settimeout(None)
        return sock
    except OSError as e:  # ConnectionError and timeouts too
        sock.close()
        raise CheckpointError(f"the page server at {page_server} is not this migration's: {e or 'timed out'}",
                              fix="a post-copy snapshot is received with the key its migrate call returned; if "
                                  "that was given, the source's page server is gone and something else holds its "
                                  "port: move the sandbox again") from None


class _Handshake:
    """The source's side of one connection's handshake, fed as its bytes arrive (non-blocking)."""

    def __init__(self, sock: socket.socket, key: bytes) -> None:
        self.sock, self.key, self.deadline = sock, key, time.monotonic() + HANDSHAKE_TIMEOUT
        self.buf, self.nonce_s = b"", b""

    def feed(self) -> bool | None:
        """Read what arrived: True once the peer proved the key, False if it failed (close it), None: more."""
        want = len(MAGIC) + NONCE if not self.nonce_s else 32
        try:
            chunk = self.sock.recv(want - len(self.buf))
        except BlockingIOError:
            return None
        except OSError:
            return False
        if not chunk:
            return False
        self.buf += chunk
        if not self.nonce_s and self.buf[:len(MAGIC)] != MAGIC[:len(self.buf)]:
            return False  # not a receiver: CRIU's own protocol, say
        if len(self.buf) < want:
            return None
        if not self.nonce_s:
            self.nonce_r, self.nonce_s, self.buf = self.buf[len(MAGIC):], secrets.token_bytes(NONCE), b""
            return None if self._send(self.nonce_s + _mac(self.key, b"S", self.nonce_r, self.nonce_s)) else False
        ok = hmac.compare_digest(self.buf, _mac(self.key, b"R", self.nonce_r, self.nonce_s))
        return ok and self._send(ACCEPTED)

    def _send(self, data: bytes) -> bool:
        try:  # a few bytes into a new connection's empty buffer: all go at once, or the peer is not playing
            return self.sock.send(data) == len(data)
        except OSError:
            return False


class Listener:
    """agentenv's listening socket for one migration's page server (see the module doc): CRIU serves one end of
    ``pair`` (``--ps-socket``), ``serve`` then accepts and relays to the other the first peer that proves ``key``."""

    def __init__(self, address: str, port: int = 0) -> None:
        self.key = new_key()
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self._sock = socket.create_server((address, port), family=family, backlog=MAX_PENDING)
        self.address, self.port = address, int(self._sock.getsockname()[1])
        self._ours: socket.socket | None = None
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._lock = threading.Lock()  # orders close() against the thread that owns the sockets
        self._closed = False
        self._peer: socket.socket | None = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(self.address, self.port, self.key)

    def pair(self) -> socket.socket:
        """A new socket pair (a dump tried again drops the last one's): its end for CRIU, which the caller closes
        once CRIU holds it (or failed to start)."""
        if self._ours is not None:
            self._ours.close()
        self._ours, theirs = socket.socketpair()
        return theirs

    def serve(self) -> None:
        """Accept connections (in a thread) until one proves the key, and relay it to CRIU's end of ``pair``."""
        self._thread = threading.Thread(target=self._accept, name="agentenv-page-channel", daemon=True)
        self._thread.start()

    def listening(self) -> bool:
        """True while it waits for the receiver (the listening socket is open and nobody proved the key yet)."""
        with self._lock:
            return not self._closed and self._peer is None

    def close(self) -> None:
        """Close the listener, the connections mid-handshake and the relay: CRIU reads the end of its socket.
        Once, from any thread but the channel's own; returns when all are closed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            relayed = [s for s in (self._peer, self._ours) if s is not None] if self._peer is not None else []
            for s in relayed:
                with contextlib.suppress(OSError):  # (closed already if the relay ended: the lock orders them)
                    s.shutdown(socket.SHUT_RDWR)  # wakes the relay's splices
        if self._thread is None:  # never served
            self._close_all([])
        else:
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")  # wakes the accept loop, if it still runs
            self._thread.join()
        os.close(self._wake_w)

    def _close_all(self, pending: list[socket.socket]) -> None:
        for s in (self._sock, *pending):
            s.close()
        with contextlib.suppress(OSError):
            os.close(self._wake_r)
        if self._peer is None and self._ours is not None:
            self._ours.close()

    def _accept(self) -> None:
        sel = selectors.DefaultSelector()
        self._sock.setblocking(False)
        sel.register(self._sock, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        pending: dict[socket.socket, _Handshake] = {}  # oldest first
        peer = None
        try:
            while peer is None:
                now = time.monotonic()
                for s in [s for s, h in pending.items() if h.deadline <= now]:
                    sel.unregister(s)
                    pending.pop(s).sock.close()
                wait = min((h.deadline for h in pending.values()), default=now + HANDSHAKE_TIMEOUT) - now
                for key, _ in sel.select(max(wait, 0.0)):
                    if key.fileobj == self._wake_r:
                        return
                    if key.fileobj is self._sock:
                        self._take(sel, pending)
                        continue
                    hs: _Handshake = key.data
                    done = hs.feed()
                    if done is None:
                        continue
                    sel.unregister(hs.sock)
                    del pending[hs.sock]
                    if done:
                        peer = hs.sock
                        break
                    hs.sock.close()
        finally:
            sel.close()
            with self._lock:
                if peer is not None and not self._closed:
                    self._peer = peer
                elif peer is not None:
                    peer.close()
                    peer = None
            self._close_all(list(pending))
        if peer is not None:
            self._relay(peer)

    def _take(self, sel: selectors.BaseSelector, pending: dict[socket.socket, _Handshake]) -> None:
        try:
            s, _ = self._sock.accept()
        except OSError:
            return
        s.setblocking(False)
        if len(pending) >= MAX_PENDING:  # a flood: the oldest goes (a receiver answers at once, a flood's never)
            oldest = next(iter(pending))
            sel.unregister(oldest)
            pending.pop(oldest).sock.close()
        pending[s] = _Handshake(s, self.key)
        sel.register(s, selectors.EVENT_READ, pending[s])

    def _relay(self, peer: socket.socket) -> None:
        """Move bytes both ways between the receiver and CRIU until either side ends, then close both."""
        ours = self._ours
        assert ours is not None, "serve() before pair()"
        peer.setblocking(True)
        # CRIU sends each answer as a head and then its pages, and sets TCP_NODELAY on its socket for that: with
        # Nagle's algorithm on ours, a head waited for the receiver's delayed ACK (~40 ms a fault)
        peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        back = threading.Thread(target=_pump, args=(ours, peer), name="agentenv-page-relay", daemon=True)
        back.start()
        _pump(peer, ours)
        back.join()
        with self._lock:
            peer.close()
            ours.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Splice ``src`` into ``dst`` through a pipe until ``src`` ends or either fails; then end ``dst``'s writing
    (and ``src``'s reading: the other direction's pump ends too once its peer ends)."""
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        with contextlib.suppress(OSError):
            fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, RELAY_CHUNK)
        while n := os.splice(src.fileno(), w, RELAY_CHUNK):
            while n:
                n -= os.splice(r, dst.fileno(), n)
    except OSError:
        pass
    finally:
        os.close(r)
        os.close(w)
        for s, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
            with contextlib.suppress(OSError):
                s.shutdown(how)
