"""The keeper and its host channel, run as a plain process on a temporary socket (no container)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from agentenv.host.keeper_start import keeper_file
from agentenv.inside import frames
from agentenv.sandbox.channel import Channel, Gate, raise_for


@pytest.fixture
def channel(tmp_path: Path):
    path = str(tmp_path / "keeper" / "agent.sock")  # the folder is the keeper's own: the file API refuses it
    proc = subprocess.Popen([sys.executable, str(keeper_file(tmp_path)), path])
    ch = Channel(lambda: "/", Gate(), path)
    ch.connect(wait=10).close()
    yield ch
    proc.kill()
    proc.wait()


def test_frames_round_trip_binary_blobs():
    a, b = socket.socketpair()
    blob = bytes(range(256)) * 100  # fits the socket buffer: nobody reads while we send
    frames.send_frame(a, {"op": "x", "n": 1}, blob)
    assert frames.recv_frame(b) == ({"op": "x", "n": 1}, blob)
    a.close()
    with pytest.raises(ConnectionError):
        frames.recv_frame(b)


def test_exec_collects_output_and_exit_code(channel):
    h = channel.exec({"cmd": "echo out; echo err >&2; exit 4", "timeout": 10}, None)
    assert (h["exit_code"], h["stdout"], h["stderr"], h["timed_out"]) == (4, b"out\n", b"err\n", False)


def test_exec_timeout_kills_the_group(channel):
    mark = f"{3000 + os.getpid() % 1000}.125"  # durations no other process of the machine sleeps for
    h = channel.exec({"cmd": f"sleep {mark} & sleep 1{mark}", "timeout": 0.5}, None)
    assert h["timed_out"] and h["exit_code"] == 137
    assert subprocess.run(["pgrep", "-f", f"^sleep 1?{mark}$"], capture_output=True).returncode == 1


def test_exec_resumes_after_the_keeper_closes_connections(channel):
    """A snapshot closes every connection; the call reconnects and loses no output."""
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(channel.exec(
        {"cmd": "for i in $(seq 20); do echo $i; sleep 0.02; done", "timeout": 10}, None)))
    t.start()
    time.sleep(0.15)
    channel.gate.shut()
    s = channel.connect(through_gate=False)
    frames.send_frame(s, {"op": "quiesce"})
    assert frames.recv_frame(s)[0] == {"ok": True}
    with pytest.raises(ConnectionError):
        frames.recv_frame(s)  # the keeper closed the control connection too
    s.close()
    time.sleep(0.1)
    channel.gate.open()
    t.join(10)
    assert result["stdout"].split() == [str(i).encode() for i in range(1, 21)]


def test_streaming_delivers_chunks_in_order(channel):
    seen: list[tuple[str, bytes]] = []
    h = channel.exec({"cmd": "echo a; sleep 0.1; echo b", "timeout": 10}, lambda s, d: seen.append((s, d)))
    assert b"".join(d for s, d in seen if s == "stdout") == b"a\nb\n" == h["stdout"]


def test_files_and_errors(channel, tmp_path):
    target = str(tmp_path / "d" / "f.bin")
    channel.call({"op": "write", "path": target, "mode": 0o600}, b"\x00\x01")
    reply, data = channel.call({"op": "read", "path": target})
    assert data == b"\x00\x01" and reply["mode"] == 0o600
    with pytest.raises(FileNotFoundError):
        channel.call({"op": "read", "path": str(tmp_path / "missing")})
    with pytest.raises(ValueError):
        channel.call({"op": "nonsense"})


def test_spawn_and_process_table(channel):
    reply, _ = channel.call({"op": "spawn", "cmd": "echo bg; exit 3"})
    pid = reply["pid"]
    for _ in range(200):
        procs = channel.call({"op": "procs"})[0]["procs"]
        if procs[str(pid)]["exit_code"] is not None:
            break
        time.sleep(0.01)
    assert procs[str(pid)]["exit_code"] == 3
    assert Path(reply["log"]).read_text() == "bg\n"


def test_a_planted_symlink_cannot_redirect_the_host(tmp_path):
    """The sandbox owns the socket's folder: a symlink there must not lead the host to another socket."""
    from agentenv.sandbox.channel import connect_in_root

    elsewhere = socket.socket(socket.AF_UNIX)
    elsewhere.bind(str(tmp_path / "host-only.sock"))
    elsewhere.listen(1)
    root = tmp_path / "root"
    (root / "dev" / "agentenv").mkdir(parents=True)
    (root / "dev" / "agentenv" / "agent.sock").symlink_to(tmp_path / "host-only.sock")
    with pytest.raises(OSError):
        connect_in_root(str(root), "/dev/agentenv/agent.sock")
    (root / "dev" / "agentenv" / "agent.sock").unlink()
    (root / "dev" / "agentenv").rmdir()
    (root / "dev" / "agentenv").symlink_to("/" + str(tmp_path).lstrip("/"))  # a folder link: resolved in root
    with pytest.raises(OSError):
        connect_in_root(str(root), "/dev/agentenv/host-only.sock")
    elsewhere.close()


def test_raise_for_maps_errors():
    raise_for({"ok": True})
    with pytest.raises(PermissionError):
        raise_for({"error": "PermissionError", "errno": 13, "message": "no"})


def test_a_silent_keeper_is_an_error_not_a_hang(tmp_path, monkeypatch):
    from agentenv.errors import ConnectionLost
    from agentenv.sandbox import channel as channel_mod

    path = str(tmp_path / "mute.sock")
    mute = socket.socket(socket.AF_UNIX)
    mute.bind(path)
    mute.listen(4)  # accepts, never answers (a frozen keeper)
    monkeypatch.setattr(channel_mod, "CALL_TIMEOUT", 0.3)
    ch = Channel(lambda: "/", Gate(), path)
    with pytest.raises(ConnectionLost, match="did not answer"):
        ch.call({"op": "ping"})
    with pytest.raises(ConnectionLost, match="did not answer"):
        ch.exec({"cmd": "true", "timeout": 0.2}, None)
    mute.close()


@pytest.mark.parametrize("op", ["listen", "forward"])
def test_a_forward_is_the_hosts_request_alone(channel, op):
    """A process of the sandbox (here: this test) asking the keeper to listen or forward, whatever target it names,
    is refused: nothing listens on the port afterwards, and the keeper keeps serving."""
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    with pytest.raises(PermissionError, match="host's request alone"):
        channel.call({"op": op, "port": port, "host": "127.0.0.1", "host_port": 22})
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5)
    assert channel.call({"op": "ping"})[0]["ok"] is True


def test_a_tunnel_is_the_hosts_request_alone(channel):
    """A process in the keeper's own pid namespace (here: this test, as a command of the sandbox would be) is refused
    a tunnel to a port; the keeper answers, and keeps serving."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    try:
        with pytest.raises(PermissionError, match="host's request alone"):
            channel.tunnel(listener.getsockname()[1], 5.0)
        listener.settimeout(0.2)
        with pytest.raises(TimeoutError):
            listener.accept()  # nothing was connected to it
    finally:
        listener.close()
    assert channel.call({"op": "ping"})[0]["ok"] is True
