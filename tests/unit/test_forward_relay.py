"""The host side of a forward (``agentenv.sandbox.forward``) against a hostile keeper, played here by a unix socket
server of the test's (no container): one that answers every post at once, and one that begins an answer and
goes silent. The host connects to its one target alone, at most ``max_connections`` at once, and gives up on a
stalled answer at its deadline. The keeper's own side (and the real thing) is ``tests/integration/test_forward.py``."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.inside import frames
from agentenv.sandbox import forward
from agentenv.sandbox.channel import Channel, Gate
from agentenv.sandbox.forward import Forward


def _wait(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.01)


class Target:
    """A TCP server on loopback that holds every connection open and counts them (now, at most, in all)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.lock = threading.Lock()
        self.now = self.most = self.total = 0
        self.received = b""
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                self.now += 1
                self.total += 1
                self.most = max(self.most, self.now)
            threading.Thread(target=self.hold, args=(conn,), daemon=True).start()

    def hold(self, conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(4096):
                with self.lock:
                    self.received += data
        with self.lock:
            self.now -= 1


class HostileKeeper:
    """A keeper that answers each forward post at once: ``ok`` (then sends ``hi`` and stays open), ``stall`` (a
    frame's first bytes only, then silence), ``nonsense`` (an error reply naming an exception of its choice) or
    ``huge`` (a header announced far past what an answer needs)."""

    def __init__(self, path: str, mode: str = "ok") -> None:
        self.server = socket.socket(socket.AF_UNIX)
        self.server.bind(path)
        self.server.listen(256)
        self.mode, self.posts, self.closed = mode, 0, 0
        self.conns: list[socket.socket] = []
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.conns.append(conn)
            try:
                header, _ = frames.recv_frame(conn)
                assert header["op"] == "forward"
                self.posts += 1
                if self.mode == "stall":
                    conn.sendall(b"\0\0")  # the head of a frame, and nothing more
                    threading.Thread(target=self.see_closed, args=(conn,), daemon=True).start()
                elif self.mode == "nonsense":
                    frames.send_frame(conn, {"error": "ValueError", "message": "no"})
                elif self.mode == "huge":  # announces a header of 32 MiB (the wire's own cap), sends none of it
                    conn.sendall(struct.pack(">II", frames.MAX_HEADER, 0))
                    threading.Thread(target=self.see_closed, args=(conn,), daemon=True).start()
                else:
                    frames.send_frame(conn, {"ok": True})
                    conn.sendall(b"hi")
                    threading.Thread(target=self.see_closed, args=(conn,), daemon=True).start()
            except OSError:  # the host gave up on it (the test's forward dropped)
                conn.close()

    def see_closed(self, conn: socket.socket) -> None:
        try:
            ended = conn.recv(1) == b""
        except ConnectionResetError:
            ended = True
        if ended:
            self.closed += 1


@pytest.fixture
def keeper_path(tmp_path: Path) -> Iterator[str]:
    yield str(tmp_path / "agent.sock")


def _forward(sandbox_id: str, path: str, fwd: Forward) -> None:
    forward.add(sandbox_id, fwd, Channel(lambda: "/", Gate(), path), lambda: "running")


def test_a_keeper_that_answers_every_post_gets_max_connections_to_the_one_target(keeper_path: str):
    target, other = Target(), Target()
    keeper = HostileKeeper(keeper_path)
    try:
        _forward("sb-flood", keeper_path, Forward(8000, "127.0.0.1", target.port, max_connections=5))
        _wait(lambda: target.now == 5 and forward.active("sb-flood") == 5, "five relays run")
        time.sleep(0.3)  # were the bound not held, the posts would go on meanwhile
        assert (target.most, keeper.posts, other.total) == (5, 5, 0)
        _wait(lambda: target.received == b"hi" * 5, "the keeper's bytes reach the target")
        for conn in keeper.conns:  # the sandbox's side ends: the relays end, and the slots are posted again
            conn.shutdown(socket.SHUT_RDWR)
        _wait(lambda: keeper.posts == 10 and target.total == 10, "the freed slots are posted again")
        assert target.most == 5
    finally:
        forward.dropped("sb-flood")
    assert forward.of("sb-flood") == []


def test_a_target_that_does_not_accept_closes_the_connection_inside_and_is_logged_once(
        keeper_path: str, caplog: pytest.LogCaptureFixture):
    gone = socket.create_server(("127.0.0.1", 0))
    port = gone.getsockname()[1]
    gone.close()  # nothing accepts there now
    keeper = HostileKeeper(keeper_path)
    try:
        with caplog.at_level("WARNING", logger="agentenv"):
            _forward("sb-down", keeper_path, Forward(8000, "127.0.0.1", port))
            _wait(lambda: keeper.closed >= 20, "the sandbox's connections are closed, one after another")
        said = [r for r in caplog.records if "does not accept" in r.getMessage()]
        assert len(said) == 1, said
    finally:
        forward.dropped("sb-down")


def test_an_answer_begun_and_left_unfinished_is_given_up_at_its_deadline(keeper_path: str,
                                                                        monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(forward, "CALL_TIMEOUT", 0.3)
    target = Target()
    keeper = HostileKeeper(keeper_path, "stall")
    try:
        _forward("sb-stall", keeper_path, Forward(8000, "127.0.0.1", target.port, max_connections=2))
        _wait(lambda: keeper.closed >= 2 and keeper.posts >= 4, "stalled answers are closed and posted again")
        assert target.total == 0
    finally:
        forward.dropped("sb-stall")


def test_a_keeper_answering_errors_of_its_choice_is_posted_to_again_and_reaches_nothing(keeper_path: str):
    target = Target()
    keeper = HostileKeeper(keeper_path, "nonsense")
    try:
        _forward("sb-nonsense", keeper_path, Forward(8000, "127.0.0.1", target.port))
        _wait(lambda: keeper.posts >= 3 * forward.PENDING, "the posts go on after each error")
        assert target.total == 0
    finally:
        forward.dropped("sb-nonsense")


def test_an_answer_announced_past_its_size_is_refused_before_it_is_read(keeper_path: str,
                                                                       monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(forward, "CALL_TIMEOUT", 60.0)  # refused at once: no deadline ends it
    target = Target()
    keeper = HostileKeeper(keeper_path, "huge")
    try:
        _forward("sb-huge", keeper_path, Forward(8000, "127.0.0.1", target.port))
        _wait(lambda: keeper.closed >= 2 and keeper.posts >= 4, "the oversized answers are closed and posted again",
              timeout=20)
        assert target.total == 0
    finally:
        forward.dropped("sb-huge")


def _clogged(path: str, held: list[socket.socket]) -> None:
    """A unix socket at ``path`` whose queue of connections is full: one more connect would wait for an accept that
    never comes (a frozen or flooded keeper)."""
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(0)
    held.append(server)
    while True:
        filler = socket.socket(socket.AF_UNIX)
        filler.setblocking(False)
        try:
            filler.connect(path)
        except BlockingIOError:
            filler.close()
            return
        held.append(filler)


@pytest.mark.parametrize("bad", ["clogged", "stall"])
def test_keepers_that_never_accept_or_never_answer_hold_nothing_of_another_sandboxs_forward(
        tmp_path: Path, bad: str, monkeypatch: pytest.MonkeyPatch):
    """Ten sandboxes whose keepers accept nothing, or answer each post with a frame's first bytes and then nothing
    (twenty posts, more than the relays' worker threads): another sandbox's forward is served meanwhile, long
    before those posts reach their deadline."""
    monkeypatch.setattr(forward, "CALL_TIMEOUT", 120.0)
    held: list[socket.socket] = []
    target = Target()
    try:
        for i in range(10):
            path = str(tmp_path / f"bad-{i}.sock")
            if bad == "clogged":
                _clogged(path, held)
            else:
                HostileKeeper(path, "stall")
            _forward(f"sb-bad-{i}", path, Forward(8000, "127.0.0.1", target.port))
        keeper = HostileKeeper(str(tmp_path / "healthy.sock"))
        _forward("sb-healthy", str(tmp_path / "healthy.sock"), Forward(8000, "127.0.0.1", target.port))
        _wait(lambda: keeper.posts >= forward.PENDING and target.total >= forward.PENDING, "the healthy one is served")
    finally:
        for i in range(10):
            forward.dropped(f"sb-bad-{i}")
        forward.dropped("sb-healthy")
        for s in held:
            s.close()


@pytest.mark.parametrize(("fwd", "message"), [
    (Forward(0, "127.0.0.1", 80), "port of a forward"),
    (Forward(8000, "127.0.0.1", 70000), "host port"),
    (Forward(8000, "localhost", 80), "IP address"),
    (Forward(8000, "127.0.0.1", 80, max_connections=0), "max_connections"),
    (Forward(8000, "127.0.0.1", 80, idle_timeout=float("inf")), "idle_timeout"),
])
def test_a_bad_forward_is_refused_saying_what(fwd: Forward, message: str):
    with pytest.raises(ValueError, match=message):
        fwd.checked()


def test_a_port_forwarded_elsewhere_is_refused(keeper_path: str):
    target = Target()
    HostileKeeper(keeper_path, "stall")
    fwd = Forward(8000, "127.0.0.1", target.port)
    try:
        _forward("sb-twice", keeper_path, fwd)
        _forward("sb-twice", keeper_path, fwd)  # the same again: nothing changes
        with pytest.raises(ValueError, match="forwarded to"):
            _forward("sb-twice", keeper_path, Forward(8000, "127.0.0.1", target.port + 1))
        assert forward.of("sb-twice") == [fwd]
    finally:
        forward.dropped("sb-twice")
