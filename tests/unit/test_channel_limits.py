"""What answers on the agent socket is untrusted (issue 10, item 2): caps, bounded retries, deadlines.

A fake agent on a temporary unix socket plays each attack against the host end; a real agent (a plain
process, no container) shows the agent end holds too: capped frames, streamed files, ignored signals.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agentenv.errors import ConnectionLost
from agentenv.host.keeper_start import keeper_file
from agentenv.inside import frames
from agentenv.inside import jobs as keeper_jobs
from agentenv.sandbox import channel as channel_mod
from agentenv.sandbox import jobs as host_jobs
from agentenv.sandbox.channel import Channel, Gate

HEAD = struct.Struct(">II")


def rss_peak() -> int:
    """This process's peak resident memory (VmHWM), bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


class FakeAgent:
    """A unix socket server that answers every connection with ``behave(conn)``; counts connections."""

    def __init__(self, path: str, behave: Callable[[socket.socket], None]) -> None:
        self.accepted = 0
        self.server = socket.socket(socket.AF_UNIX)
        self.server.bind(path)
        self.server.listen(64)
        self._behave = behave
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.accepted += 1
            try:
                self._behave(conn)
            except Exception:  # noqa: BLE001 - the host's side is under test, not the fake's
                pass
            finally:
                conn.close()

    def close(self) -> None:
        self.server.shutdown(socket.SHUT_RDWR)
        self.server.close()
        self._thread.join(5)


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Callable[[socket.socket], None]], Channel]]:
    made: list[FakeAgent] = []
    monkeypatch.setattr(channel_mod, "CALL_TIMEOUT", 10.0)  # a failing test fails in seconds, not minutes

    def make(behave: Callable[[socket.socket], None]) -> Channel:
        path = str(tmp_path / f"fake{len(made)}.sock")
        made.append(FakeAgent(path, behave))
        ch = Channel(lambda: "/", Gate(), path)
        ch.fake = made[-1]  # type: ignore[attr-defined]
        return ch

    yield make
    for f in made:
        f.close()


def announce(hlen: int, blen: int, head: bytes = b"") -> Callable[[socket.socket], None]:
    def behave(conn: socket.socket) -> None:
        conn.settimeout(5)
        with_request(conn)
        conn.sendall(HEAD.pack(hlen, blen) + head)
        time.sleep(0.5)  # keep the connection open: the host must not wait for the announced bytes
    return behave


def with_request(conn: socket.socket) -> None:
    """Read the host's request frame (so that the host's send completes)."""
    hlen, blen = HEAD.unpack(conn.recv(8, socket.MSG_WAITALL))
    conn.recv(hlen + blen, socket.MSG_WAITALL)


def test_a_4_gib_blob_is_refused_without_allocating_it(fake):
    head = json.dumps({"ok": True}).encode()
    ch = fake(announce(len(head), 0xFFFFFFFF, head))  # 4 GiB - 1, the most a frame can announce
    before = rss_peak()
    with pytest.raises(ConnectionLost, match="broke the protocol"):
        ch.call({"op": "read", "path": "/x"})
    assert rss_peak() - before < 64 << 20
    assert ch.fake.accepted == 1  # a protocol breach is not retried


def test_a_4_gib_header_is_refused(fake):
    ch = fake(announce(0xFFFFFFFF, 0))
    with pytest.raises(ConnectionLost, match="broke the protocol"):
        ch.call({"op": "ping"})


@pytest.mark.parametrize("garbage", [b"not json", b"[1, 2]", b"\xff\xfe"])
def test_a_header_that_is_not_a_json_object_is_refused(fake, garbage):
    ch = fake(announce(len(garbage), 0, garbage))
    with pytest.raises(ConnectionLost, match="broke the protocol"):
        ch.call({"op": "ping"})


def test_accept_and_close_ends_in_a_bounded_number_of_attempts(fake):
    ch = fake(lambda conn: None)  # accepts, closes at once
    with pytest.raises(ConnectionLost, match="closed the connection"):
        ch.call({"op": "ping"})
    assert ch.fake.accepted == channel_mod.RETRIES
    n = ch.fake.accepted
    with pytest.raises(ConnectionLost, match="closed the connection"):
        ch.exec({"cmd": "true", "timeout": None}, None)
    assert ch.fake.accepted - n == channel_mod.RETRIES


def test_an_exec_that_gets_its_job_id_then_a_close_is_bounded_too(fake):
    def behave(conn: socket.socket) -> None:
        with_request(conn)
        frames.send_frame(conn, {"job": 1, "beat": 5.0})
    ch = fake(behave)
    with pytest.raises(ConnectionLost, match="closed the connection"):
        ch.exec({"cmd": "true", "timeout": None}, None)
    assert ch.fake.accepted == channel_mod.RETRIES


def test_a_dribbling_agent_meets_the_call_deadline(fake, monkeypatch):
    """One byte at a time keeps each recv alive; the call's deadline still ends it."""
    monkeypatch.setattr(channel_mod, "CALL_TIMEOUT", 0.5)

    def behave(conn: socket.socket) -> None:
        with_request(conn)
        conn.sendall(HEAD.pack(2, 100))
        conn.sendall(b"{}")
        for _ in range(100):
            conn.sendall(b"x")
            time.sleep(0.05)
    ch = fake(behave)
    with pytest.raises(ConnectionLost, match="did not answer"):
        ch.call({"op": "read", "path": "/x"})


def test_exec_output_past_the_agents_own_cap_is_refused(fake, monkeypatch):
    monkeypatch.setattr(keeper_jobs, "MAX_OUTPUT", 4096)  # what the host side reads

    def behave(conn: socket.socket) -> None:
        with_request(conn)
        frames.send_frame(conn, {"job": 1, "beat": 5.0})
        for _ in range(100):
            frames.send_frame(conn, {"fd": 1}, b"x" * 1000)
    ch = fake(behave)
    with pytest.raises(ConnectionLost, match="broke the protocol"):
        ch.exec({"cmd": "yes", "timeout": 10}, None)


@pytest.mark.parametrize("final", [{"stdout_len": 99}, {"stdout_len": 0, "exit_code": "x", "duration": 0,
                                                         "timed_out": False, "dropped": [0, 0]}, {"fd": 7}])
def test_a_forged_result_frame_is_refused(fake, final):
    def behave(conn: socket.socket) -> None:
        with_request(conn)
        frames.send_frame(conn, {"job": 1, "beat": 5.0})
        frames.send_frame(conn, final, b"abc")
    ch = fake(behave)
    with pytest.raises(ConnectionLost, match="broke the protocol"):
        ch.exec({"cmd": "true", "timeout": 10}, None)


def test_a_snapshot_held_gate_is_bounded_by_the_call_deadline(fake, monkeypatch):
    monkeypatch.setattr(channel_mod, "CALL_TIMEOUT", 0.3)
    ch = fake(lambda conn: None)
    ch.gate.shut()
    with pytest.raises(ConnectionLost, match="snapshot"):
        ch.call({"op": "ping"})
    assert ch.fake.accepted == 0


# --- the agent end -----------------------------------------------------------------------------


@pytest.fixture
def real(tmp_path: Path) -> Iterator[tuple[Channel, subprocess.Popen[bytes]]]:
    path = str(tmp_path / "agent" / "agent.sock")
    proc = subprocess.Popen([sys.executable, str(keeper_file(tmp_path)), path], env={**os.environ, "AGENTENV_HEARTBEAT": "0.1"})
    ch = Channel(lambda: "/", Gate(), path)
    ch.connect(wait=10).close()
    yield ch, proc
    proc.kill()
    proc.wait()


def agent_peak(proc: subprocess.Popen[bytes]) -> int:
    for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_the_agent_streams_uploads_and_downloads(real, tmp_path):
    """An upload is written a chunk at a time (never held, let alone twice); a download is sent from the file."""
    ch, proc = real
    blob = os.urandom(1 << 20) * 48
    target = str(tmp_path / "big.bin")
    ch.call({"op": "write", "path": target, "mode": 0o600}, blob)
    assert Path(target).read_bytes() == blob
    reply, data = ch.call({"op": "read", "path": target})
    assert data == blob and reply["mode"] == 0o600
    assert agent_peak(proc) < 40 << 20  # 48 MiB went through, both ways
    assert ch.call({"op": "read", "path": "/proc/self/status"})[1].startswith(b"Name:")  # size 0 in stat, read whole


def test_the_agent_survives_frames_over_its_caps(real):
    ch, proc = real
    for hlen, blen in ((0xFFFFFFFF, 0), (2, 0xFFFFFFFF), (8, 0)):
        with ch.connect() as s:
            s.sendall(HEAD.pack(hlen, blen) + b"x" * min(hlen, 8))
            s.settimeout(5)
            with contextlib.suppress(ConnectionResetError):  # a hang-up with our bytes unread
                assert s.recv(1) == b""  # it hangs up on that connection, and only that one
    assert ch.call({"op": "ping"})[0]["ok"]
    with ch.connect() as s:  # a big blob on a request that takes none is read and dropped, not kept
        frames.send_frame(s, {"op": "ping"}, b"x" * (4 << 20))
        assert frames.recv_frame(s)[0]["error"] == "BadRequest"
    assert agent_peak(proc) < 40 << 20


def test_the_agent_ignores_termination_signals(real):
    ch, proc = real
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        proc.send_signal(sig)
    time.sleep(0.2)
    assert proc.poll() is None
    assert ch.call({"op": "ping"})[0]["ok"]
    # its commands still get default signal handling: a handler is reset by exec, SIG_IGN would not be
    h = ch.exec({"cmd": "sleep 30 & kill -TERM $!; wait $!; echo $?", "timeout": 10}, None)
    assert h["stdout"] == b"143\n"


def test_the_output_kept_per_job_is_capped_by_the_request(real):
    ch, _ = real
    h = ch.exec({"cmd": "head -c 100000 /dev/zero; head -c 5 /dev/zero >&2", "timeout": 10, "max_output": 1000}, None)
    assert (len(h["stdout"]), h["dropped"], h["stderr"]) == (1000, [99000, 0], b"\0" * 5)


def test_children_get_the_highest_oom_score(real):
    ch, _ = real
    h = ch.exec({"cmd": "cat /proc/self/oom_score_adj", "timeout": 10}, None)
    assert h["stdout"] == b"1000\n"


def test_the_agent_refuses_to_write_its_own_folder(real, tmp_path):
    ch, _ = real
    own = tmp_path / "agent"
    with pytest.raises(PermissionError):
        ch.call({"op": "write", "path": str(own / "agent.sock")}, b"x")
    (tmp_path / "link").symlink_to(own)
    with pytest.raises(PermissionError):
        ch.call({"op": "write", "path": str(tmp_path / "link" / "agent.sock")}, b"x" * (3 << 20))
    assert (own / "agent.sock").is_socket()
    assert ch.call({"op": "ping"})[0]["ok"]  # the refused upload's bytes were drained: the connection stayed in step


def test_heartbeats_tell_a_silent_command_from_a_stopped_agent(real, monkeypatch):
    ch, proc = real
    monkeypatch.setattr(channel_mod, "CALL_TIMEOUT", 1.0)
    h = ch.exec({"cmd": "sleep 2; echo done", "timeout": None}, None)  # silent for twice the silence limit
    assert h["stdout"] == b"done\n"
    result: dict = {}

    def run() -> None:
        try:
            ch.exec({"cmd": "sleep 3", "timeout": None}, None)
        except ConnectionLost as e:
            result["error"] = e
    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.3)
    proc.send_signal(signal.SIGSTOP)
    try:
        t.join(20)
        assert isinstance(result.get("error"), ConnectionLost)
    finally:
        proc.send_signal(signal.SIGCONT)


@pytest.mark.parametrize("reply, blob", [({"at": [0, 0], "stdout_len": 99}, b"abc"),
                                         ({"at": [0, -1], "stdout_len": 0}, b""),
                                         ({"at": [0, 0], "stdout_len": 0}, b"x" * 9),  # stderr over the size
                                         ({"at": [0, 0], "stdout_len": 0}, b"x" * 99)])  # over the frame's cap
def test_a_forged_tail_is_refused(fake, reply, blob):
    def behave(conn: socket.socket) -> None:
        with_request(conn)
        frames.send_frame(conn, reply, blob)
    ch = fake(behave)
    with pytest.raises(ConnectionLost, match="broke the protocol"):
        host_jobs.tail(ch, 7, 8)
