"""A sandbox's TCP ports reached through its keeper: the host asks for a port, the keeper connects to it on the
sandbox's own loopback and then splices bytes both ways between that connection and the host's.

The connection is made inside the sandbox's network namespace, so a sandbox with no network at all still serves
its ports, and the host asks nothing of the sandbox's network. Only the host may ask (the keeper's socket is
root's, and the request is refused from any process of the sandbox): a command inside has loopback of its own.
"""

from __future__ import annotations

import _socket
import _thread
import errno

from agentenv.inside.commands import Starved
from agentenv.inside.frames import send_frame, suppress

TUNNEL_CONNECT_TIMEOUT = 5.0  # seconds for the sandbox's listener to accept
TUNNEL_CHUNK = 1 << 16


def open_tunnel(conn: _socket.socket, port: int, active: set[_socket.socket]) -> None:
    """Connect to ``127.0.0.1:port`` in the sandbox, answer ``ok`` on ``conn`` (or the error), then relay both
    ways until both ends are done; returns once they are (the caller closes ``conn``). The sandbox-side socket is
    in ``active`` meanwhile, for a snapshot to shut (CRIU must find no connection to the host)."""
    if not 0 < port < 65536:
        raise ValueError(f"port {port} is out of range")
    tcp = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
    try:
        tcp.settimeout(TUNNEL_CONNECT_TIMEOUT)
        try:
            tcp.connect(("127.0.0.1", port))
        except OSError as e:  # answered here: raised, a ConnectionError would end the connection without a word
            why = f"did not accept within {TUNNEL_CONNECT_TIMEOUT:g} s" if isinstance(e, TimeoutError) else e.strerror
            send_frame(conn, {"error": "OSError", "errno": e.errno or errno.ETIMEDOUT,
                              "message": f"nothing accepts on port {port} in the sandbox ({why})"})
            return
        tcp.settimeout(None)
        conn.settimeout(None)
        go, done = _thread.allocate_lock(), _thread.allocate_lock()
        go.acquire()
        done.acquire()
        try:  # before the answer, so that a refusal can still be one; it sends nothing until the answer is out
            _thread.start_new_thread(_pump_after, (tcp, conn, go, done))
        except RuntimeError as e:
            raise Starved(f"cannot open the port: the sandbox is out of threads ({e})") from None
        try:
            send_frame(conn, {"ok": True})
            active.add(tcp)
        finally:
            go.release()
        _pump(conn, tcp)
        done.acquire()
    finally:
        active.discard(tcp)
        tcp.close()


def _pump_after(src: _socket.socket, dst: _socket.socket, go: _thread.LockType, done: _thread.LockType) -> None:
    """``_pump`` once ``go`` is released (the answer sent); releases ``done`` at the end."""
    try:
        go.acquire()
        _pump(src, dst)
    finally:
        done.release()


def _pump(src: _socket.socket, dst: _socket.socket) -> None:
    """Copy ``src`` to ``dst`` until ``src`` ends (or either breaks); then end ``dst``'s writing half."""
    with suppress(OSError):
        while True:
            data = src.recv(TUNNEL_CHUNK)
            if not data:
                break
            dst.sendall(data)
    with suppress(OSError):
        dst.shutdown(_socket.SHUT_WR)
