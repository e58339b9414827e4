"""TCP between a sandbox and the host through its keeper, both ways, with no network asked of the sandbox.

- The sandbox's ports, reached from the host (``open_tunnel``): the host asks for a port, the keeper connects to it
  on the sandbox's own loopback and then splices bytes both ways between that connection and the host's.
- A host endpoint forwarded into the sandbox (``listen``, ``accept_forward``; the host side is
  ``agentenv.sandbox.forward``): the keeper listens on ``127.0.0.1:port`` of the sandbox, and each connection the
  host leaves waiting is answered once a process of the sandbox connects there, then spliced to it. Where the bytes
  go on the host is the host's choice alone: nothing the sandbox sends names it.

Every connection is made inside the sandbox's network namespace, so a sandbox with no network at all serves and
reaches them. Only the host may ask (the keeper's socket is root's, and these requests are refused from any process
of the sandbox). The listeners are the keeper's own sockets: a memory snapshot keeps them, and the connections in
flight are the host's, which a snapshot closes (``Keeper.quiesce``).
"""

from __future__ import annotations

import _socket
import _thread
import errno

from agentenv.inside.commands import Starved
from agentenv.inside.frames import send_frame, suppress

TYPE_CHECKING = False
if TYPE_CHECKING:
    import socket

TUNNEL_CONNECT_TIMEOUT = 5.0  # seconds for the sandbox's listener to accept
TUNNEL_CHUNK = 1 << 16
FORWARD_BACKLOG = 128  # connections of the sandbox to a forwarded port that wait for the host to take them


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
        _relay(conn, tcp, active)
    finally:
        active.discard(tcp)
        tcp.close()


def listen(port: int, listeners: dict[int, socket.socket]) -> None:
    """Listen on ``127.0.0.1:port`` of the sandbox for a forward from the host, unless ``listeners`` has it already
    (the caller holds the keeper's lock). OSError (EADDRINUSE: a process of the sandbox has the port) if it cannot."""
    if not 0 < port < 65536:
        raise ValueError(f"port {port} is out of range")
    if port in listeners:
        return
    import socket  # here, not at the top: every start imports the keeper, and only a forward needs accept()

    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        server.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen(FORWARD_BACKLOG)
        server.setblocking(False)  # several host connections wait on it: the one that accepts first takes it
    except OSError as e:
        server.close()
        raise OSError(e.errno, f"cannot listen on 127.0.0.1:{port} in the sandbox ({e.strerror}): a process of the "
                               "sandbox may hold the port; forward another one") from None
    listeners[port] = server


def accept_forward(conn: _socket.socket, server: socket.socket, active: set[_socket.socket]) -> None:
    """Wait until a process of the sandbox connects to ``server`` (a forward's listener) or the host closes ``conn``;
    then answer ``ok`` on ``conn`` and relay both ways until both ends are done (the caller closes ``conn``)."""
    import select  # here, not at the top, as socket in ``listen``

    poll = select.poll()
    poll.register(server.fileno(), select.POLLIN)
    poll.register(conn.fileno(), select.POLLIN)  # the host sends nothing more: readable is its close (or quiesce)
    while True:
        if any(fd == conn.fileno() for fd, _ in poll.poll()):
            return
        try:
            tcp, _addr = server.accept()
        except (BlockingIOError, InterruptedError):  # another waiting connection took it
            continue
        break
    try:
        tcp.setblocking(True)
        tcp.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_NODELAY, 1)  # each piece relayed goes out as it comes
        _relay(conn, tcp, active)
    finally:
        active.discard(tcp)
        tcp.close()


def _relay(conn: _socket.socket, tcp: _socket.socket, active: set[_socket.socket]) -> None:
    """Answer ``ok`` on the host's ``conn``, then copy both ways between it and the sandbox's ``tcp`` until both are
    done. ``tcp`` is in ``active`` meanwhile, for a snapshot to shut (CRIU must find no connection to the host)."""
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
