"""Jobs made by ``start`` on real sandboxes: output buffered until read, stdin, signals, and jobs that go on across
pause/resume, a memory snapshot and a fork. (The file system ops, and the job calls through a server too, are in
``test_api_contract``.)"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import pytest

import agentenv
import agentenv.errors
from agentenv.api import JobEnd, JobOutput

from .server_fixtures import wait_for

pytestmark = pytest.mark.integration

COUNT = "i=0; while true; do i=$((i+1)); echo $i; sleep 0.02; done"


@pytest.fixture
def sb() -> Iterator[agentenv.Sandbox]:
    with agentenv.Sandbox.create(memory="512m") as s:
        yield s


def drain(sb: agentenv.Sandbox, pid: int, offsets=None) -> tuple[bytes, bytes, JobEnd]:
    out = {"stdout": b"", "stderr": b""}
    for item in sb.output(pid, offsets):
        if isinstance(item, JobOutput):
            out[item.stream] += item.data
        elif isinstance(item, JobEnd):
            return out["stdout"], out["stderr"], item
    raise AssertionError("no JobEnd")


def read_until(sb: agentenv.Sandbox, pid: int, offsets: tuple[int, int], want: int) -> tuple[bytes, tuple[int, int]]:
    """At least ``want`` more stdout bytes from ``offsets`` (the generator is closed: the job goes on)."""
    got = b""
    pos = list(offsets)
    gen = sb.output(pid, offsets)
    for item in gen:
        if isinstance(item, JobOutput):
            assert item.offset == pos[0 if item.stream == "stdout" else 1]
            pos[0 if item.stream == "stdout" else 1] += len(item.data)
            if item.stream == "stdout":
                got += item.data
            if len(got) >= want:
                break
    gen.close()
    return got, (pos[0], pos[1])


def counted(data: bytes) -> list[int]:
    return [int(x) for x in data.split(b"\n")[:-1]]  # whole lines only


def test_background_jobs_stdin_signals_and_listing(sb):
    pid = sb.start("echo hi; echo err >&2; sleep 0.3; echo later", tag="bg").pid
    slow = sb.start("sleep 300 & sleep 301", tag="slow").pid
    cat = sb.start("cat", stdin=True, env={"X": "1"}).pid
    listed = {j.pid: j for j in sb.jobs()}
    assert listed[pid].tag == "bg" and listed[cat].env == {"X": "1"} and listed[cat].stdin
    assert listed[slow].exit_code is None
    time.sleep(0.6)  # ended meanwhile: its output waited in the sandbox
    assert drain(sb, pid)[:2] == (b"hi\nlater\n", b"err\n")
    sb.send_input(cat, b"ping\n")
    assert read_until(sb, cat, (0, 0), 5)[0] == b"ping\n"
    sb.close_input(cat)
    assert drain(sb, cat, (5, 0))[2].exit_code == 0
    sb.signal(slow, signal.SIGKILL)
    assert drain(sb, slow)[2].exit_code == 137
    assert sb.exec("ps -eo args | grep -c '^sleep 30[01]' || true").stdout.strip() == "0"
    assert sb.jobs() == []
    with pytest.raises(ProcessLookupError):
        sb.signal(pid, signal.SIGTERM)
    with pytest.raises(ProcessLookupError):
        next(sb.output(pid))
    timed = sb.start("sleep 30", timeout=0.5).pid
    end = drain(sb, timed)[2]
    assert end.timed_out and end.exit_code == 137


def test_jobs_go_on_across_pause_snapshot_and_fork(sb):
    counter = sb.start(COUNT).pid
    cat = sb.start("cat", stdin=True).pid
    first, pos = read_until(sb, counter, (0, 0), 20)
    sb.discard(counter, pos)  # read: never needed again

    sb.pause()
    sb.resume()
    assert {j.pid for j in sb.jobs()} == {counter, cat}
    more, pos = read_until(sb, counter, pos, 20)
    assert counted(first + more) == list(range(1, len(counted(first + more)) + 1))  # no gap, no repeat
    sb.send_input(cat, b"after resume\n")
    assert read_until(sb, cat, (0, 0), 13)[0] == b"after resume\n"

    seen: list[bytes] = []  # a reader in flight while a memory snapshot closes its connection

    def follow() -> None:
        for item in sb.output(counter, pos):
            if isinstance(item, JobOutput):
                seen.append(item.data)
            if len(b"".join(seen)) > 400:
                return

    t = threading.Thread(target=follow)
    t.start()
    time.sleep(0.2)
    snap = sb.snapshot(memory=True)
    t.join(30)
    snap.delete()
    assert not t.is_alive()
    last = counted(first + more)[-1]
    after = counted(b"".join(seen))
    assert after[: 5] == list(range(last + 1, last + 6)) and after == list(range(last + 1, last + 1 + len(after)))

    kids = sb.fork(2, memory=True)
    try:
        for n, kid in enumerate(kids):
            assert {j.pid for j in kid.jobs()} == {counter, cat}  # the same pids in every child
            kid.send_input(cat, f"kid {n}\n".encode())
        for n, kid in enumerate(kids):
            kid.close_input(cat)
            out = drain(kid, cat, (13, 0))
            assert out[0] == f"kid {n}\n".encode() and out[2].exit_code == 0  # each its own pipe
            got, _ = read_until(kid, counter, pos, 100)
            values = counted(got)
            assert values[0] == last + 1 and values == list(range(last + 1, last + 1 + len(values)))
            kid.signal(counter, signal.SIGTERM)
            assert drain(kid, counter, pos)[2].exit_code == 128 + signal.SIGTERM
            assert kid.jobs() == []
        assert {j.pid for j in sb.jobs()} == {counter, cat}  # the parent's jobs are its own
        sb.signal(counter, signal.SIGKILL)
    finally:
        for kid in kids:
            kid.close()



def screen(sb: agentenv.Sandbox, pid: int, want: bytes, limit: float = 20.0) -> bytes:
    """A terminal's output so far, once ``want`` is in it (read without following: the job goes on)."""
    deadline = time.monotonic() + limit
    while True:
        seen = b"".join(i.data for i in sb.output(pid, follow=False) if isinstance(i, JobOutput))
        if want in seen:
            return seen
        assert time.monotonic() < deadline, f"no {want!r} in {seen[-300:]!r}"
        time.sleep(0.05)


def terminal_end(sb: agentenv.Sandbox, pid: int) -> tuple[bytes, JobEnd]:
    """A terminal's whole output (its one stream, "pty") and its end."""
    items = list(sb.output(pid))
    assert {i.stream for i in items if isinstance(i, JobOutput)} <= {"pty"} and isinstance(items[-1], JobEnd)
    return b"".join(i.data for i in items if isinstance(i, JobOutput)), items[-1]


def test_terminals_go_on_across_a_memory_snapshot_restored_elsewhere(sb):
    shell = sb.start_terminal("/bin/bash --norc -i", (20, 70), env={"PS1": "$ "}).pid
    sb.send_input(shell, b"MARK=kept; sleep 1000 &\n")
    ended = sb.start_terminal("echo gone", (10, 10)).pid  # its shell exited: the agent's end has no peer left
    deadline = time.monotonic() + 20
    while [j.exit_code for j in sb.jobs() if j.pid == ended] != [0]:  # ended, its output unread
        assert time.monotonic() < deadline
        time.sleep(0.05)
    screen(sb, shell, b"$ ")
    snap = sb.snapshot(memory=True)
    try:
        with agentenv.Sandbox.restore(snap) as copy:
            copy.send_input(shell, b"echo $MARK; stty size; tty\n")
            screen(copy, shell, b"kept\r\n20 70\r\n/dev/pts/")  # its variable, its size, still a tty
            copy.resize(shell, (33, 99))
            copy.send_input(shell, b"stty size\n")
            screen(copy, shell, b"33 99")
            assert terminal_end(copy, ended)[0] == b"gone\r\n"
            copy.send_input(shell, b"kill %1; exit 4\n")
            assert terminal_end(copy, shell)[1].exit_code == 4
        sb.send_input(shell, b"echo here-$MARK\n")
        screen(sb, shell, b"here-kept\r\n")  # the original's terminal is its own
    finally:
        snap.delete()


def test_a_terminal_criu_cannot_save_fails_the_snapshot_by_name_and_the_sandbox_runs_on(sb):
    shell = sb.start_terminal("/bin/sh -i", (20, 70), env={"PS1": "$ "}).pid  # dash holds /dev/tty open
    sb.send_input(shell, b"ONE=1\n")
    screen(sb, shell, b"$ ")
    for take in (lambda: sb.snapshot(memory=True), sb.pause, lambda: sb.fork(1, memory=True)):
        with pytest.raises(agentenv.errors.CheckpointError, match=f"terminal is open: pid {shell} .*/bin/sh -i"):
            take()
        assert sb.state == "running"
    sb.send_input(shell, b"echo still-$ONE\n")
    screen(sb, shell, b"still-1\r\n")  # the terminal and its shell were left as they were
    sb.signal(shell, signal.SIGKILL)
    assert terminal_end(sb, shell)[1].exit_code == 137
    sb.snapshot(memory=True).delete()  # with the terminal gone, memory snapshots work again


def test_a_tail_looks_at_a_jobs_last_bytes_and_takes_nothing(sb):
    job = sb.start("printf 'abcdefghij'; printf 'E1E2' >&2; exec 1>&-; exec 2>&-; sleep 600")
    wait_for(lambda: sum(len(o.data) for o in sb.tail(job.pid, 4)) == 8, "both streams' bytes in the agent")
    assert sb.tail(job.pid, 4) == [JobOutput("stdout", b"ghij", 6), JobOutput("stderr", b"E1E2", 0)]
    assert sb.tail(job.pid, 1 << 20) == [JobOutput("stdout", b"abcdefghij", 0), JobOutput("stderr", b"E1E2", 0)]
    sb.discard(job.pid, (4, 0))  # what a reader let go of is not in the tail either
    assert sb.tail(job.pid, 1 << 20)[0] == JobOutput("stdout", b"efghij", 4)
    sb.signal(job.pid, signal.SIGKILL)
    wait_for(lambda: sb.jobs()[0].exit_code is not None, "the killed job's end")
    sb.tail(job.pid)  # an ended job's tail leaves its end, for output
    assert [j.pid for j in sb.jobs()] == [job.pid]
    out, err, end = drain(sb, job.pid, (4, 0))
    assert (out, err, end.exit_code) == (b"efghij", b"E1E2", 128 + signal.SIGKILL)
    with pytest.raises(ProcessLookupError):  # delivered: gone, for a tail as for output
        sb.tail(job.pid)
    for bad in (0, -1, True, 1 << 40):
        with pytest.raises(ValueError):
            sb.tail(job.pid, bad)
