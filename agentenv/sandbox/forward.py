"""One host endpoint forwarded into a sandbox: a TCP port on the sandbox's own loopback whose connections reach that
endpoint (an LLM gateway on the host's loopback, say) and nothing else of the host (``Sandbox.forward``).

How: the sandbox's keeper listens on ``127.0.0.1:port`` inside (its ``listen`` request), and this process keeps
``PENDING`` connections to the keeper waiting (``forward``), each answered once a process of the sandbox connects
there; then this side connects to the target, which is fixed here when the forward is made and never named by
anything the sandbox sends, and copies bytes both ways without reading them. A sandbox with no network at all
reaches the endpoint so, and the rules that keep the host out of its reach (``agentenv.host.network``) stay as
they are: no route, no rule, no socket of the host enters the sandbox.

Bounds, since the sandbox is hostile: at most ``max_connections`` relays of a forward at once (more connections
wait in the keeper's listen backlog), each closed after ``idle_timeout`` seconds without a byte either way; the
keeper's answer, the connection to the target and every write have deadlines. Every relay of the process runs on
one event-loop thread (``_Relays``), the keeper's answers are read there too, and the few worker threads only open
keeper connections (at once or not at all): neither a flood of connections, a slow sender nor a keeper that accepts
nothing or answers by halves holds a thread or stalls another sandbox's relays.

Lifetime: a forward belongs to this process, where its relays run, until the sandbox closes or the process ends.
A snapshot cuts the relays in flight (the keeper closes the host's connections before CRIU runs; a client inside
sees its connection end) and the forward serves again once the snapshot is done. A pause stops it, and it serves
again when the sandbox runs again (as ``resume`` returns in this process; in another, within ``DORMANT_POLL``).
The children of a ``fork`` made in this process get the same forwards (``Sandbox.fork``). A restore, or a handle
in another process, has none until ``forward`` is called on it: a snapshot taken long ago must not reach whatever
listens on its old target now. Its listener comes back with a memory snapshot, so a connection made inside
meanwhile waits in its backlog and is served once the forward is made again.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from socket import socket

from agentenv.api import State
from agentenv.errors import AgentEnvError
from agentenv.inside import frames
from agentenv.sandbox.channel import Channel, raise_for

log = logging.getLogger("agentenv")

PENDING = 2  # connections to the keeper left waiting for the sandbox's next connection, per forward
MAX_FORWARDS = 8  # forwards of one sandbox at most
CALL_TIMEOUT = 10.0  # seconds for a keeper connection and its request, the rest of an answer begun, a target's connect
DORMANT_POLL = 0.5  # seconds between looks at the record of a sandbox that is not running (paused, or a snapshot)
BACKOFF = (0.05, 2.0)  # seconds before posting again after a keeper connection failed, doubling up to the second
CHUNK = 1 << 16
ANSWER_MAX = 4096  # bytes of the keeper's answer to a post at most: ``ok``, or an error and its message


@dataclass(frozen=True)
class Forward:
    """``127.0.0.1:port`` in the sandbox reaches ``host:host_port`` of the host (and nothing else of it)."""

    port: int  # on the sandbox's loopback
    host: str  # an IP address of the host (no name: nothing is resolved on a relay's path)
    host_port: int
    max_connections: int = 64  # relays at once; more connections of the sandbox wait
    idle_timeout: float = 900.0  # seconds without a byte either way before a relay is closed

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``: the base of an HTTP endpoint as the sandbox's processes reach it."""
        return f"http://127.0.0.1:{self.port}"

    def checked(self) -> Forward:
        """This forward, or ValueError naming what no forward may have."""
        for name, value in (("port", self.port), ("host port", self.host_port)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
                raise ValueError(f"the {name} of a forward must be an integer in 1..65535, got {value!r}")
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            raise ValueError(f"a forward's target must be an IP address of the host, got {self.host!r} (resolve a "
                             "name before: a relay resolves nothing)") from None
        m = self.max_connections
        if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= 4096:
            raise ValueError(f"max_connections must be an integer in 1..4096, got {m!r}")
        if isinstance(self.idle_timeout, bool) or not isinstance(self.idle_timeout, int | float) \
                or not 0 < self.idle_timeout < float("inf"):
            raise ValueError(f"idle_timeout must be a positive number of seconds, got {self.idle_timeout!r}")
        return self


class _Forwarded:
    """One forward of one sandbox in this process: its posts to the keeper and the relays they became."""

    def __init__(self, sandbox_id: str, fwd: Forward, channel: Channel, state: Callable[[], State]) -> None:
        self.sandbox_id, self.fwd, self.channel, self.state = sandbox_id, fwd, channel, state
        self.slots = asyncio.Semaphore(fwd.max_connections)
        self.wake = asyncio.Event()
        self.tasks: set[asyncio.Task[None]] = set()
        self.relays = 0  # relays in flight (``active`` sums them)
        self.target_down = False  # the last connection to the target failed (said once in the log)


class _Relays:
    """The process's relays: one event loop on a thread of its own, and a few threads for keeper connections.
    ``forwards`` changes under ``_lock``; the loop's objects are touched on its thread alone."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="agentenv-forward")
        self.forwards: dict[tuple[str, int], _Forwarded] = {}
        threading.Thread(target=self.loop.run_forever, name="agentenv-forward", daemon=True).start()

    def start(self, f: _Forwarded) -> None:
        """Its posts to the keeper, from now on (on the loop's thread)."""
        def start() -> None:
            for _ in range(PENDING):
                self.spawn(f, self.post(f))

        self.loop.call_soon_threadsafe(start)

    def stop(self, f: _Forwarded) -> None:
        """Its posts and relays end (on the loop's thread)."""
        self.loop.call_soon_threadsafe(lambda: [task.cancel() for task in list(f.tasks)])

    def spawn(self, f: _Forwarded, coro: Coroutine[object, object, None]) -> None:
        task = self.loop.create_task(coro)
        f.tasks.add(task)
        task.add_done_callback(f.tasks.discard)

    async def post(self, f: _Forwarded) -> None:
        """Keep one connection waiting at the keeper for the sandbox's next connection, and relay each it brings."""
        failures = 0
        while True:
            await f.slots.acquire()
            try:
                conn = await self.accepted(f)
            except Exception as e:  # noqa: BLE001 - a snapshot cut it, the sandbox is not running, or its keeper
                f.slots.release()  # answered nonsense (any error name): the post goes on, after a pause
                failures += 1
                if not await self.pause_after(f, e, failures):
                    dropped(f.sandbox_id)
                    return
                continue
            except BaseException:
                f.slots.release()
                raise
            failures = 0
            self.spawn(f, self.relay(f, conn))

    async def pause_after(self, f: _Forwarded, err: Exception, failures: int) -> bool:
        """After a post failed: wait, with backoff, until the sandbox runs again (a snapshot done, a resume); False
        once it is closed or lost."""
        await asyncio.sleep(min(BACKOFF[0] * 2 ** (failures - 1), BACKOFF[1]))
        while (state := await self.loop.run_in_executor(self.pool, self.state_of, f)) != "running":
            if state in ("closed", "lost"):
                return False
            f.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(f.wake.wait(), DORMANT_POLL)
        if failures >= 3:
            log.warning("forward of port %d: the keeper refused %d posts in a row (%s)", f.fwd.port, failures, err)
        return True

    @staticmethod
    def state_of(f: _Forwarded) -> State:
        """Where the forward's sandbox is ('lost' where its record cannot be read any more)."""
        try:
            return f.state()
        except (OSError, AgentEnvError):
            return "lost"

    async def accepted(self, f: _Forwarded) -> socket:
        """A keeper connection answered ``ok``: a process of the sandbox connected to the forwarded port."""
        while not f.channel.gate.wait_open(0):  # a snapshot in this process: it closes keeper connections
            await asyncio.sleep(0.01)
        conn = await self.loop.run_in_executor(self.pool, self.request, f)
        try:
            await self.answer(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    @staticmethod
    def request(f: _Forwarded) -> socket:
        conn = f.channel.connect(through_gate=False, at_once=True)  # a clogged keeper never holds a worker
        try:
            frames.send_frame(conn, {"op": "forward", "port": f.fwd.port}, deadline=time.monotonic() + CALL_TIMEOUT)
        except BaseException:
            conn.close()
            raise
        return conn

    async def answer(self, conn: socket) -> None:
        """The keeper's answer to a post, read on the loop (a keeper that stalls it holds no thread): its first byte
        whenever the sandbox connects, the rest within ``CALL_TIMEOUT``; a frame without a blob, of ``ANSWER_MAX``
        bytes at most; its error raised. Not a byte past it is read: the sandbox's connection follows on ``conn``."""
        conn.setblocking(False)
        first = await self.exactly(conn, 1)
        async with asyncio.timeout(CALL_TIMEOUT):
            hlen, _ = frames.lengths(first + await self.exactly(conn, frames.HEAD_SIZE - 1), 0, ANSWER_MAX)
            raise_for(frames.header_of(await self.exactly(conn, hlen)))

    async def exactly(self, conn: socket, n: int) -> bytes:
        got = b""
        while len(got) < n:
            chunk = await self.loop.sock_recv(conn, n - len(got))
            if not chunk:
                raise ConnectionError("the keeper closed the connection without an answer")
            got += chunk
        return got

    async def relay(self, f: _Forwarded, conn: socket) -> None:
        """Connect to the target and copy both ways until both ends are done, or nothing moved for idle_timeout."""
        f.relays += 1
        ends: list[asyncio.StreamWriter] = []
        try:
            inner, inner_w = await asyncio.open_connection(sock=conn)
            ends.append(inner_w)
            try:
                target, target_w = await asyncio.wait_for(asyncio.open_connection(f.fwd.host, f.fwd.host_port),
                                                          CALL_TIMEOUT)
            except (OSError, TimeoutError) as e:  # the client inside sees its connection closed
                if not f.target_down:  # once until it accepts again: the sandbox's connections cannot flood the log
                    log.warning("forward of port %d: %s:%d does not accept (%s)", f.fwd.port, f.fwd.host,
                                f.fwd.host_port, e)
                f.target_down = True
                return
            f.target_down = False
            ends.append(target_w)
            last = [time.monotonic()]
            try:
                async with asyncio.TaskGroup() as both:  # the first to fail ends the other
                    both.create_task(self.pipe(inner, target_w, last, f.fwd.idle_timeout))
                    both.create_task(self.pipe(target, inner_w, last, f.fwd.idle_timeout))
            except* (OSError, TimeoutError):  # a reset, a broken pipe, idle past the deadline: the relay ends
                pass
        finally:
            for w in ends:
                w.transport.abort()
            if not ends:
                conn.close()
            f.relays -= 1
            f.slots.release()

    @staticmethod
    async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, last: list[float], idle: float) -> None:
        """Copy ``src`` to ``dst`` until ``src`` ends, then end ``dst``'s writing; TimeoutError once neither
        direction moved a byte for ``idle`` seconds (``last``: when one last did, shared by both)."""
        while True:
            try:
                data = await asyncio.wait_for(src.read(CHUNK), max(0.0, last[0] + idle - time.monotonic()))
            except TimeoutError:
                if time.monotonic() - last[0] >= idle:
                    raise
                continue
            if not data:
                break
            last[0] = time.monotonic()
            dst.write(data)
            await asyncio.wait_for(dst.drain(), idle)  # a reader that stopped reading holds the relay idle at most
        if dst.can_write_eof():
            dst.write_eof()


_lock = threading.Lock()
_relays: list[_Relays] = []


def _the_relays() -> _Relays:
    with _lock:
        if not _relays:
            _relays.append(_Relays())
        return _relays[0]


def add(sandbox_id: str, fwd: Forward, channel: Channel, state: Callable[[], State]) -> None:
    """Relay ``fwd`` of sandbox ``sandbox_id`` (whose keeper listens already) from now on, in this process; ``state``
    says where the sandbox is (read anew). ValueError if this process forwards its port elsewhere already."""
    relays = _the_relays()
    with _lock:
        had = relays.forwards.get((sandbox_id, fwd.port))
        if had is not None and had.fwd != fwd:
            raise ValueError(f"port {fwd.port} of sandbox {sandbox_id} is forwarded to {had.fwd.host}:"
                             f"{had.fwd.host_port} already: forward another port")
        if had is None:
            if sum(1 for k in relays.forwards if k[0] == sandbox_id) >= MAX_FORWARDS:
                raise ValueError(f"sandbox {sandbox_id} has {MAX_FORWARDS} forwards, the most it may have")
            relays.forwards[(sandbox_id, fwd.port)] = f = _Forwarded(sandbox_id, fwd, channel, state)
            relays.start(f)
    if had is not None:
        woken(sandbox_id)


def _mine(sandbox_id: str) -> list[_Forwarded]:
    if not _relays:
        return []
    with _lock:
        return [f for k, f in _relays[0].forwards.items() if k[0] == sandbox_id]


def of(sandbox_id: str) -> list[Forward]:
    """The forwards of a sandbox that this process relays."""
    return [f.fwd for f in _mine(sandbox_id)]


def active(sandbox_id: str) -> int:
    """The relays of a sandbox's forwards in flight now."""
    return sum(f.relays for f in _mine(sandbox_id))


def woken(sandbox_id: str) -> None:
    """The sandbox runs again (resumed): its forwards post at once instead of at their next look."""
    for f in _mine(sandbox_id):
        _relays[0].loop.call_soon_threadsafe(f.wake.set)


def dropped(sandbox_id: str) -> None:
    """The sandbox is closed: its forwards end (relays in flight too)."""
    for f in _mine(sandbox_id):
        with _lock:
            _relays[0].forwards.pop((sandbox_id, f.fwd.port), None)
        _relays[0].stop(f)
