"""The keeper's lean start: what it uses instead of json, threading, contextlib and subprocess (whose imports
would cost every sandbox start) behaves as they do. The keeper runs as a plain process (no container)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentenv.host.keeper_start import keeper_file
from agentenv.inside import frames
from agentenv.sandbox.channel import Channel, Gate

HEAVY = ("json", "re", "subprocess", "threading", "socket", "signal", "selectors", "contextlib", "enum",
         "collections", "typing", "functools")


def test_the_keeper_imports_none_of_the_heavy_modules(tmp_path):
    """The property the start time rests on, checked where it can fail: a fresh interpreter runs the joined
    keeper as the sandbox gets it."""
    probe = (f"import sys; exec(compile(open({str(keeper_file(tmp_path))!r}).read(), 'keeper', 'exec'), "
             f"{{'__name__': 'keeper'}}); "
             f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-I", "-S", "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4), max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_the_codec_writes_and_reads_what_json_does(value):
    text = frames._dumps(value)
    assert text == json.dumps(value, separators=(",", ":"))
    assert frames._loads(text) == value
    assert frames._loads(json.dumps(value, indent=1)) == value  # whitespace anywhere, as json.loads takes


@pytest.mark.parametrize("text", ["", " ", "{", "{}x", "[1,]", '"\x01"', "nul", "{'a': 1}", "[1] [2]"])
def test_the_codec_refuses_what_json_refuses(text):
    with pytest.raises(ValueError):
        json.loads(text)
    with pytest.raises(ValueError):
        frames._loads(text)


def test_a_header_nested_past_the_recursion_limit_is_a_frame_error():
    import socket

    a, b = socket.socketpair()
    head = b"[" * 100_000
    a.sendall(frames._HEAD.pack(len(head), 0) + head)
    with pytest.raises(frames.FrameError):
        frames.recv_frame(b)
    a.close()
    b.close()


def test_the_codec_falls_back_to_json_where_the_c_encoder_differs(monkeypatch):
    def refuse(*args):
        raise TypeError("make_encoder() takes other arguments here")

    monkeypatch.setattr(frames._json, "make_encoder", refuse)
    dumps, loads = frames._codec()
    assert dumps({"a": [1, "é"]}) == '{"a":[1,"\\u00e9"]}'
    assert loads(' {"a": [1]} ') == {"a": [1]}
    assert loads is json.loads


def test_condition_wakes_every_waiter_and_times_out_alone():
    cond = frames.Condition()
    woken: list[int] = []

    def waiter(i: int) -> None:
        with cond:
            cond.wait(60)
            woken.append(i)

    threads = [threading.Thread(target=waiter, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    while True:  # every waiter is waiting (it let go of the lock) before the notify
        with cond:
            if len(cond.waiters) == 3:
                cond.notify_all()
                break
    for t in threads:
        t.join(30)
    assert sorted(woken) == [0, 1, 2] and not any(t.is_alive() for t in threads)
    with cond:
        cond.wait(0.01)  # nobody notifies: it returns, holding the lock, and leaves no waiter behind
        assert cond.waiters == [] and cond.lock.locked()


def test_suppress_stops_the_exceptions_given_only():
    with frames.suppress(KeyError, OSError):
        raise FileNotFoundError
    with pytest.raises(ValueError), frames.suppress(KeyError):
        raise ValueError


@contextmanager
def serving(tmp_path: Path, prelude: str = "", shell: str = "") -> Iterator[Channel]:
    path = str(tmp_path / "keeper" / "agent.sock")
    code = "\n".join(["import runpy, sys", prelude, f"sys.argv = ['keeper', {path!r}]",
                      f"runpy.run_path({str(keeper_file(tmp_path))!r}, run_name='__main__')"])
    argv = [sys.executable, "-c", code]
    if shell:  # the keeper started with the shell's redirections (its own stdio closed, say)
        argv = ["/bin/sh", "-c", 'exec "$@" ' + shell, "sh", *argv]
    proc = subprocess.Popen(argv)
    try:
        channel = Channel(lambda: "/", Gate(), path)
        channel.connect(wait=10).close()
        yield channel
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def channel(tmp_path: Path) -> Iterator[Channel]:
    with serving(tmp_path) as ch:
        yield ch


def run(channel: Channel, cmd: str, **kw) -> tuple[int, str, str]:
    h = channel.exec({"cmd": cmd, "timeout": 20, **kw}, None)
    return h["exit_code"], h["stdout"].decode(), h["stderr"].decode()


def _stat_fields(channel: Channel) -> tuple[str, ...]:
    """pid, process group and session of a command's shell."""
    code, out, _ = run(channel, "cut -d' ' -f1,5,6 /proc/$$/stat")
    assert code == 0
    return tuple(out.split())


def test_a_command_leads_its_own_session_and_group(channel):
    pid, group, session = _stat_fields(channel)
    assert pid == group == session


def test_a_command_runs_with_sigpipe_and_sigxfsz_at_their_defaults(channel):
    code, out, _ = run(channel, "grep SigIgn /proc/self/status")
    ignored = int(out.split()[1], 16)
    assert code == 0 and ignored & (1 << (13 - 1) | 1 << (25 - 1)) == 0  # SIGPIPE 13, SIGXFSZ 25
    assert run(channel, "yes | head -n 1") == (0, "y\n", "")  # yes ends by SIGPIPE, quietly


def test_cwd_is_taken_as_given_and_checked(channel, tmp_path):
    odd = tmp_path / "it's $(here) `too`"
    odd.mkdir()
    assert run(channel, "pwd", cwd=str(odd)) == (0, f"{odd}\n", "")
    with pytest.raises(FileNotFoundError):
        run(channel, "pwd", cwd=str(tmp_path / "missing"))
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError):
        run(channel, "pwd", cwd=str(tmp_path / "file"))
    with pytest.raises(ValueError, match="cwd"):  # a number would be taken for a file descriptor
        run(channel, "pwd", cwd=3)


def test_a_keeper_started_without_stdio_keeps_each_stream_apart(tmp_path):
    """Its commands' pipes must not take numbers 0-2, which the child's own stdio are set up by."""
    with serving(tmp_path, shell="<&- >&- 2>&-") as channel:
        assert run(channel, "echo out; echo err >&2; readlink /proc/self/fd/0") == (0, "out\n/dev/null\n", "err\n")


def test_without_posix_spawn_setsid_a_command_still_leads_its_group(tmp_path):
    prelude = ("import os; real = os.posix_spawn\n"
               "def spawn(*a, **k):\n"
               "    if k.get('setsid'): raise NotImplementedError('setsid')\n"
               "    return real(*a, **k)\n"
               "os.posix_spawn = spawn")
    with serving(tmp_path, prelude=prelude) as channel:
        pid, group, _ = _stat_fields(channel)
        assert pid == group
        h = channel.exec({"cmd": "sleep 30 & sleep 31", "timeout": 0.5}, None)
        assert h["timed_out"] and h["exit_code"] == 137
