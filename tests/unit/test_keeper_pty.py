"""Jobs on a terminal (``pty``, E2B's PTYs): the keeper run as a plain process on a temporary socket (no
container), driven through the host end (``agentenv.sandbox.jobs``)."""

from __future__ import annotations

import time

import pytest

from agentenv.api import JobEnd, JobOutput
from agentenv.sandbox import jobs
from agentenv.sandbox.channel import Channel


def terminal(ch: Channel, cmd: str = "/bin/sh -i", size: tuple[int, int] = (24, 80)) -> int:
    return jobs.start(ch, cmd, cwd=None, env={"PS1": "$ "}, timeout=30, stdin=True, tag=None, max_output=1 << 20,
                      pty=size).pid


def typed(ch: Channel, pid: int, text: bytes, until: bytes) -> bytes:
    """Type ``text`` at the terminal and read its output (from the start) until ``until`` shows."""
    jobs.send_input(ch, pid, text)
    seen = b""
    deadline = time.monotonic() + 10
    while until not in seen:
        assert time.monotonic() < deadline, f"no {until!r} in {seen!r}"
        seen = b"".join(i.data for i in jobs.output(ch, pid, None, False) if isinstance(i, JobOutput))
        time.sleep(0.02)
    return seen


def test_a_terminal_job_is_the_sessions_tty_with_one_stream_and_its_size(ch):
    pid = terminal(ch)
    out = typed(ch, pid, b"tty; stty size; echo $((6*7))\n", b"42")
    assert b"/dev/pts/" in out and b"24 80" in out
    items = [i for i in jobs.output(ch, pid, None, False) if isinstance(i, JobOutput)]
    assert {i.stream for i in items} == {"pty"}  # stdout and stderr are both the terminal
    assert [j.stdin for j in jobs.listing(ch) if j.pid == pid] == [True]
    jobs.resize(ch, pid, (40, 132))
    assert b"40 132" in typed(ch, pid, b"stty size\n", b"40 132")
    jobs.send_input(ch, pid, b"exit 5\n")
    end = [i for i in jobs.output(ch, pid, None, True) if isinstance(i, JobEnd)]
    assert [e.exit_code for e in end] == [5]


def test_ctrl_c_reaches_the_foreground_and_kill_ends_the_session(ch):
    pid = terminal(ch)
    typed(ch, pid, b"sleep 100\n", b"sleep 100")
    time.sleep(0.3)
    typed(ch, pid, b"\x03echo $((1+2))done\n", b"3done")  # ^C is the terminal's SIGINT: sleep ends, echo runs
    jobs.signal(ch, pid, 9)
    end = [i for i in jobs.output(ch, pid, None, True) if isinstance(i, JobEnd)]
    assert [e.exit_code for e in end] == [137]


def test_a_resize_of_a_job_without_a_terminal_and_bad_sizes_are_refused(ch):
    plain = jobs.start(ch, "sleep 30", cwd=None, env=None, timeout=30, stdin=True, tag=None, max_output=1 << 20).pid
    with pytest.raises(ValueError, match="without a terminal"):
        jobs.resize(ch, plain, (10, 10))
    pid = terminal(ch)
    for size in ((0, 80), (24, 1 << 16)):
        with pytest.raises(ValueError, match="rows and cols"):
            jobs.resize(ch, pid, size)
    with pytest.raises(ValueError, match="rows and cols"):
        terminal(ch, size=(-1, 80))
    for p in (plain, pid):
        jobs.signal(ch, p, 9)
