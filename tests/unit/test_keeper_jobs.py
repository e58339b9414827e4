"""Jobs (start, attach, stdin, discard, signals) and the file system ops of the keeper, run as a plain process
on a temporary socket (no container), driven through the host end (``agentenv.sandbox.jobs``)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from agentenv.api import JobEnd, JobOutput
from agentenv.inside import frames
from agentenv.sandbox import jobs
from agentenv.sandbox.channel import Channel, raise_for


def start(ch: Channel, cmd: str, **kw) -> int:
    args = {"cwd": None, "env": None, "timeout": None, "stdin": False, "tag": None, "max_output": 1 << 20, **kw}
    return jobs.start(ch, cmd, **args).pid


def read_all(ch: Channel, pid: int, offsets=None) -> tuple[bytes, bytes, JobEnd, int]:
    """Everything until the end: stdout, stderr, the end, and how many heartbeats came."""
    out = {"stdout": b"", "stderr": b""}
    beats = 0
    for item in jobs.output(ch, pid, offsets, True):
        if item is None:
            beats += 1
        elif isinstance(item, JobOutput):
            out[item.stream] += item.data
        else:
            return out["stdout"], out["stderr"], item, beats
    raise AssertionError("no JobEnd")


def buffered(ch: Channel, pid: int, offsets=None) -> list[JobOutput | JobEnd]:
    return [i for i in jobs.output(ch, pid, offsets, False) if i is not None]


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def raw(ch: Channel, header: dict, blob: bytes = b"") -> dict:
    """One request with the key the caller chose (Channel.call makes its own)."""
    with ch.connect() as s:
        frames.send_frame(s, header, blob)
        return frames.recv_frame(s)[0]


def test_start_returns_at_once_and_output_waits_to_be_read(ch, tmp_path):
    go = tmp_path / "go"
    pid = start(ch, f"echo out; echo err >&2; while [ ! -e {go} ]; do sleep 0.01; done; exit 3")
    assert [j.exit_code for j in jobs.listing(ch) if j.pid == pid] == [None]  # start returned before it could end
    go.touch()
    wait_for(lambda: [j.exit_code for j in jobs.listing(ch) if j.pid == pid] == [3])  # its output and end wait
    out, err, end, _ = read_all(ch, pid)
    assert (out, err, end.exit_code, end.timed_out) == (b"out\n", b"err\n", 3, False)
    assert end.duration > 0
    assert pid not in [j.pid for j in jobs.listing(ch)]  # delivered: forgotten
    with pytest.raises(ProcessLookupError):
        next(jobs.output(ch, pid, None, True))


def test_offsets_follow_false_and_discard(ch):
    pid = start(ch, "printf abcdef; printf XY >&2; read x; printf ghi", stdin=True)
    wait_for(lambda: sum(len(i.data) for i in buffered(ch, pid) if isinstance(i, JobOutput)) == 8)
    items = buffered(ch, pid, (2, 1))  # still running: what is there, no end
    assert items == [JobOutput("stdout", b"cdef", 2), JobOutput("stderr", b"Y", 1)]
    jobs.discard(ch, pid, (3, 0))
    assert buffered(ch, pid) == [JobOutput("stdout", b"def", 3), JobOutput("stderr", b"XY", 0)]
    assert buffered(ch, pid, (0, 0))[0] == JobOutput("stdout", b"def", 3)  # below the base: from the oldest kept
    jobs.discard(ch, pid, (6, 2))
    assert buffered(ch, pid) == []
    jobs.send_input(ch, pid, b"\n")
    out, err, end, _ = read_all(ch, pid, (6, 2))
    assert (out, err, end.exit_code) == (b"ghi", b"", 0)


def test_stdin_echo_and_close(ch):
    pid = start(ch, "cat", stdin=True, max_output=8 << 20)
    jobs.send_input(ch, pid, b"hello\n")
    got = b""
    gen = jobs.output(ch, pid, None, True)
    for item in gen:
        if isinstance(item, JobOutput):
            got += item.data
            if got == b"hello\n":
                break
    gen.close()  # the connection goes, the job stays
    assert [j.exit_code for j in jobs.listing(ch) if j.pid == pid] == [None]
    big = os.urandom(3 << 20)  # over one request's blob: sent in pieces
    reader = threading.Thread(target=lambda: res.append(read_all(ch, pid, (6, 0))))
    res: list = []
    reader.start()
    jobs.send_input(ch, pid, big)
    jobs.close_input(ch, pid)
    reader.join(20)
    out, _, end, _ = res[0]
    assert out == big and end.exit_code == 0


def test_input_errors(ch):
    with pytest.raises(ProcessLookupError):
        jobs.send_input(ch, 999_999, b"x")
    pid = start(ch, "sleep 30")  # no stdin
    with pytest.raises(BrokenPipeError):
        jobs.send_input(ch, pid, b"x")
    jobs.close_input(ch, pid)
    pid2 = start(ch, "cat", stdin=True)
    jobs.close_input(ch, pid2)
    jobs.close_input(ch, pid2)  # idempotent (nobody delivered its end: the job is still known)
    with pytest.raises(BrokenPipeError):
        jobs.send_input(ch, pid2, b"x")
    jobs.signal(ch, pid, signal.SIGKILL)
    assert read_all(ch, pid)[2].exit_code == 137


def test_input_to_a_job_that_does_not_read_does_not_hang_the_keeper(ch):
    pid = start(ch, "sleep 30", stdin=True)
    answered: list[bool] = []
    replied = threading.Event()

    def ping_meanwhile() -> None:
        time.sleep(0.2)  # the input request goes first (it waits 5 s for a reader that never comes)
        ch.call({"op": "ping"})
        jobs.listing(ch)
        answered.append(not replied.is_set())

    t = threading.Thread(target=ping_meanwhile)
    t.start()
    t0 = time.monotonic()
    reply = raw(ch, {"op": "input", "pid": pid, "key": "k", "timeout": 5.0}, b"x" * frames.SMALL_BLOB)
    replied.set()
    assert reply["error"] == "TimeoutError" and time.monotonic() - t0 >= 5.0
    with pytest.raises(TimeoutError):
        raise_for(reply)
    t.join(30)
    assert answered == [True]  # other requests were answered while the input waited
    jobs.signal(ch, pid, signal.SIGKILL)
    assert read_all(ch, pid)[2].exit_code == 137


def test_input_retried_with_the_same_key_is_written_once(ch):
    pid = start(ch, "cat", stdin=True)
    for _ in range(2):
        assert raw(ch, {"op": "input", "pid": pid, "key": "same"}, b"once\n") == {"ok": True}
    jobs.close_input(ch, pid)
    assert read_all(ch, pid)[0] == b"once\n"


def test_signal_reaches_the_whole_group(ch):
    pid = start(ch, "sleep 4711 & sleep 4712; echo never")
    wait_for(lambda: subprocess.run(["pgrep", "-f", "^sleep 4711$"], capture_output=True).returncode == 0)
    jobs.signal(ch, pid, signal.SIGTERM)
    out, _, end, _ = read_all(ch, pid)
    assert end.exit_code == 128 + signal.SIGTERM and out == b""
    wait_for(lambda: subprocess.run(["pgrep", "-f", "^sleep 471[12]$"], capture_output=True).returncode == 1)
    with pytest.raises(ProcessLookupError):
        jobs.signal(ch, 999_999, signal.SIGTERM)


def test_timeout_kills_and_says_so(ch):
    pid = start(ch, "echo started; sleep 30", timeout=0.3)
    out, _, end, beats = read_all(ch, pid)
    assert out == b"started\n" and end.timed_out and end.exit_code == 137
    assert beats >= 1  # silent for longer than the heartbeat: heartbeats came as None


def test_jobs_listing(ch, tmp_path):
    a = jobs.start(ch, "sleep 30", cwd=str(tmp_path), env={"A": "1"}, timeout=None, stdin=True, tag="one",
                   max_output=1 << 20)
    b = start(ch, "exit 5", tag="two")
    assert (a.command, a.cwd, a.env, a.tag, a.stdin, a.exit_code) == ("sleep 30", str(tmp_path), {"A": "1"}, "one",
                                                                       True, None)
    wait_for(lambda: {j.pid: j.exit_code for j in jobs.listing(ch)}.get(b) == 5)
    listed = {j.pid: j for j in jobs.listing(ch)}
    assert listed[a.pid] == a and listed[b].tag == "two" and not listed[b].stdin
    ch.exec({"cmd": "true", "timeout": 5}, None)
    assert set(j.pid for j in jobs.listing(ch)) == {a.pid, b}  # exec's jobs are not listed
    read_all(ch, b)
    jobs.signal(ch, a.pid, signal.SIGKILL)
    read_all(ch, a.pid)
    assert jobs.listing(ch) == []


def test_start_is_idempotent_by_key(ch):
    first = raw(ch, {"op": "start", "cmd": "sleep 30", "key": "k1", "tag": "t"})
    again = raw(ch, {"op": "start", "cmd": "sleep 30", "key": "k1", "tag": "t"})
    assert first["pid"] == again["pid"] and first == again
    assert [j.pid for j in jobs.listing(ch)] == [first["pid"]]
    jobs.signal(ch, first["pid"], signal.SIGKILL)
    read_all(ch, first["pid"])


def test_output_resumes_after_the_keeper_closes_connections(ch):
    """A memory snapshot closes every connection: output reconnects through the gate and loses nothing."""
    pid = start(ch, "for i in $(seq 30); do echo $i; sleep 0.02; done")
    result: list = []
    t = threading.Thread(target=lambda: result.append(read_all(ch, pid)))
    t.start()
    time.sleep(0.2)
    ch.gate.shut()
    s = ch.connect(through_gate=False)
    frames.send_frame(s, {"op": "quiesce"})
    assert frames.recv_frame(s)[0] == {"ok": True}
    s.close()
    time.sleep(0.1)
    ch.gate.open()
    t.join(10)
    assert result[0][0].split() == [str(i).encode() for i in range(1, 31)]


def test_stat_and_list_dir(ch, tmp_path):
    d = tmp_path / "d"
    (d / "sub" / "deeper").mkdir(parents=True)
    (d / "f.txt").write_bytes(b"12345")
    os.chmod(d / "f.txt", 0o640)
    (d / "sub" / "g").write_bytes(b"")
    (d / "link").symlink_to(d / "sub")
    (d / "broken").symlink_to(d / "nowhere")
    info = jobs.stat(ch, str(d / "f.txt"))
    assert (info.name, info.path, info.type, info.size, info.mode, info.permissions) == (
        "f.txt", str(d / "f.txt"), "file", 5, 0o640, "-rw-r-----")
    assert info.symlink_target is None
    assert abs(info.modified - (d / "f.txt").stat().st_mtime) < 1e-3
    import pwd

    assert info.owner == pwd.getpwuid(os.getuid()).pw_name  # a name, from /etc/passwd
    link = jobs.stat(ch, str(d / "link"))
    assert (link.type, link.symlink_target, link.permissions[0]) == ("dir", str(d / "sub"), "l")
    assert jobs.stat(ch, str(d / "broken")).type == "file"
    assert jobs.stat(ch, str(d)).type == "dir"
    one = jobs.list_dir(ch, str(d), 1)
    assert [e.name for e in one] == ["broken", "f.txt", "link", "sub"]
    two = jobs.list_dir(ch, str(d), 2)
    assert [e.path for e in two] == [str(d / p) for p in ("broken", "f.txt", "link", "sub", "sub/deeper", "sub/g")]
    with pytest.raises(FileNotFoundError):
        jobs.stat(ch, str(d / "missing"))
    with pytest.raises(FileNotFoundError):
        jobs.list_dir(ch, str(d / "missing"), 1)
    with pytest.raises(NotADirectoryError):
        jobs.list_dir(ch, str(d / "f.txt"), 1)
    with pytest.raises(ValueError):
        jobs.list_dir(ch, str(d), 0)


def test_make_dir_move_remove(ch, tmp_path):
    target = tmp_path / "a" / "b"
    assert jobs.make_dir(ch, str(target)) is True and target.is_dir()
    assert jobs.make_dir(ch, str(target)) is False
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError):
        jobs.make_dir(ch, str(tmp_path / "file"))
    moved = jobs.move(ch, str(tmp_path / "file"), str(tmp_path / "new" / "place"))
    assert (moved.path, moved.size) == (str(tmp_path / "new" / "place"), 1) and not (tmp_path / "file").exists()
    with pytest.raises(FileNotFoundError):
        jobs.move(ch, str(tmp_path / "file"), str(tmp_path / "other"))
    shm = Path("/dev/shm") / f"agentenv-test-{os.getpid()}"  # another file system: copied, then removed
    try:
        (tmp_path / "a" / "b" / "x").write_text("deep")
        assert jobs.move(ch, str(tmp_path / "a"), str(shm)).type == "dir"
        assert (shm / "b" / "x").read_text() == "deep" and not (tmp_path / "a").exists()
    finally:
        subprocess.run(["rm", "-rf", str(shm)], check=False)
    (tmp_path / "tree" / "in").mkdir(parents=True)
    (tmp_path / "tree" / "in" / "f").write_text("x")
    (tmp_path / "alink").symlink_to(tmp_path / "tree")
    jobs.remove(ch, str(tmp_path / "alink"))  # the link, not what it points to
    assert (tmp_path / "tree" / "in" / "f").exists() and not (tmp_path / "alink").exists()
    jobs.remove(ch, str(tmp_path / "tree"))
    jobs.remove(ch, str(tmp_path / "new" / "place"))
    assert not (tmp_path / "tree").exists() and not (tmp_path / "new" / "place").exists()
    with pytest.raises(FileNotFoundError):
        jobs.remove(ch, str(tmp_path / "tree"))


def test_writing_ops_refuse_the_keepers_own_folder(ch, tmp_path):
    own = tmp_path / "keeper"
    for call in (lambda: jobs.make_dir(ch, str(own / "x")),
                 lambda: jobs.remove(ch, str(own / "agent.sock")),
                 lambda: jobs.remove(ch, str(tmp_path)),  # holds it
                 lambda: jobs.move(ch, str(own), str(tmp_path / "elsewhere")),
                 lambda: jobs.move(ch, str(tmp_path), "/tmp/agentenv-moved-away")):
        with pytest.raises(PermissionError):
            call()
    (tmp_path / "via").symlink_to(own)  # a symlink does not get around it
    with pytest.raises(PermissionError):
        jobs.remove(ch, str(tmp_path / "via" / "agent.sock"))
    assert (own / "agent.sock").exists()
    ch.call({"op": "ping"})


def test_an_interrupted_reader_stops_at_once_and_leaves_the_end_to_the_next(ch):
    """``interrupt`` from another thread (a server whose client left) shuts the reader's connection while it
    waits: it ends without reconnecting, and the job's end, come later, is still there to read."""
    pid = start(ch, "cat", stdin=True)
    reader = jobs.output(ch, pid, None, True)
    items: list = []
    t = threading.Thread(target=lambda: items.extend(reader))
    t.start()
    time.sleep(0.3)  # attached, and waiting (heartbeats)
    reader.interrupt()
    t.join(5)
    assert not t.is_alive() and not any(isinstance(i, JobEnd) for i in items)
    jobs.close_input(ch, pid)
    assert read_all(ch, pid)[2].exit_code == 0
    again = jobs.output(ch, 999_999, None, True)
    again.interrupt()  # before it ever connected: it asks nothing
    assert list(again) == []
