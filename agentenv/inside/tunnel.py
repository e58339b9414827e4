"""A sandbox's TCP ports reached through its agent: the host asks for a port, the agent connects to it on the
sandbox's own loopback and then splices bytes both ways between that connection and the host's.

The connection is made inside the sandbox's network namespace, so a sandbox with no network at all still serves
its ports, and the host asks nothing of the sandbox's network. Only the host may ask (the agent's socket is
root's, and the request is refused from any process of the sandbox): a command inside has loopback of its own.
"""

from __future__ import annotations

import _socket
import _thread
import errno

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
        except TimeoutError as e:
            raise OSError(errno.ETIMEDOUT, f"port {port} did not accept within {TUNNEL_CONNECT_TIMEOUT:g} s") from e
        except OSError as e:  # a plain OSError: a ConnectionError would end the connection without an answer
            raise OSError(e.errno, f"nothing accepts on port {port} in the sandbox ({e.strerror})") from e
        tcp.settimeout(None)
        conn.settimeout(None)
        send_frame(conn, {"ok": True})
        active.add(tcp)
        done = _thread.allocate_lock()
        done.acquire()
        _thread.start_new_thread(_pump_then_release, (tcp, conn, done))
        _pump(conn, tcp)
        done.acquire()
    finally:
        active.discard(tcp)
        tcp.close()


def _pump_then_release(src: _socket.socket, dst: _socket.socket, done: _thread.LockType) -> None:
    try:
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
