"""E2B's PTYs (``sandbox.pty``) with the official ``e2b`` SDK, unchanged, against a real ``agentenv serve``: a
terminal the sandbox's agent opens, typed at, resized and killed, and carried through pause and fork."""

from __future__ import annotations

import threading
import time

import pytest

e2b = pytest.importorskip("e2b", reason="the E2B SDK is a test extra; bootstrap installs it")

from e2b import CommandExitException, Sandbox  # noqa: E402
from e2b.sandbox.commands.command_handle import PtySize  # noqa: E402


class Screen:
    """What a terminal printed, read by a thread (``handle.wait``) while the test types."""

    def __init__(self, handle: object) -> None:
        self.data = b""
        self.result: object = None
        self.thread = threading.Thread(target=self._read, args=(handle,), daemon=True)
        self.thread.start()

    def _read(self, handle: object) -> None:
        try:
            self.result = handle.wait(on_pty=self._add)  # type: ignore[attr-defined]
        except Exception as e:  # noqa: BLE001 - the test looks at it
            self.result = e

    def _add(self, chunk: bytes) -> None:
        self.data += chunk

    def shows(self, text: bytes, limit: float = 20.0) -> bytes:
        deadline = time.monotonic() + limit
        while text not in self.data:
            assert time.monotonic() < deadline, f"the terminal never showed {text!r}: {self.data[-500:]!r}"
            time.sleep(0.02)
        return self.data

    def end(self, limit: float = 20.0) -> object:
        self.thread.join(limit)
        assert not self.thread.is_alive(), "the terminal did not end"
        return self.result


def test_a_pty_is_a_terminal_typed_at_resized_and_exited(sandbox: Sandbox) -> None:
    term = sandbox.pty.create(PtySize(rows=24, cols=80), envs={"GREETING": "hi"}, cwd="/tmp")
    screen = Screen(term)
    sandbox.pty.send_stdin(term.pid, b"echo $GREETING; tty; pwd; echo $((6*7))\n")
    out = screen.shows(b"42\r\n")  # the last: what came before it is all there
    assert b"hi\r\n/dev/pts/" in out and b"/tmp\r\n42" in out
    sandbox.pty.send_stdin(term.pid, b"stty size; id -u; stat -c owner-%U $(tty); echo by-name > $(tty)\n")
    out = screen.shows(b"by-name\r\n")  # as E2B's user, who owns its terminal and can open it by its name
    assert b"24 80\r\n1000\r\nowner-user\r\n" in out
    sandbox.pty.resize(term.pid, PtySize(rows=40, cols=132))
    sandbox.pty.send_stdin(term.pid, b"stty size; tput cols\n")
    screen.shows(b"40 132")
    listed = {p.pid: p for p in sandbox.commands.list()}
    assert (listed[term.pid].cmd, listed[term.pid].args) == ("/bin/bash", ["-i", "-l"])  # what pty.create runs
    sandbox.pty.send_stdin(term.pid, b"echo shell-$$\n")
    screen.shows(f"shell-{term.pid}\r\n".encode())  # the pid returned is the shell's own
    sandbox.pty.send_stdin(term.pid, b"exit\n")
    assert getattr(screen.end(), "exit_code", None) == 0


def test_a_killed_pty_is_gone_and_a_missing_one_is_not_found(sandbox: Sandbox) -> None:
    term = sandbox.pty.create(PtySize(rows=24, cols=80))
    screen = Screen(term)
    sandbox.pty.send_stdin(term.pid, b"echo ready\n")
    screen.shows(b"ready\r\n")
    assert sandbox.pty.kill(term.pid) is True
    screen.end()
    with pytest.raises(CommandExitException):
        sandbox.commands.run(f"kill -0 {term.pid}")
    assert sandbox.pty.kill(999999) is False
    sleeper = sandbox.commands.run("sleep 30", background=True)
    with pytest.raises(e2b.InvalidArgumentException, match="without a terminal"):  # nothing to resize
        sandbox.pty.resize(sleeper.pid, PtySize(rows=10, cols=10))


def test_a_pty_reconnects_after_a_disconnect(sandbox: Sandbox) -> None:
    term = sandbox.pty.create(PtySize(rows=24, cols=80), envs={"FOO": "bar"})
    sandbox.pty.send_stdin(term.pid, b"echo one-$FOO\n")
    term.disconnect()
    again = Screen(sandbox.pty.connect(term.pid))
    sandbox.pty.send_stdin(term.pid, b"echo two-$FOO\nexit\n")
    out = again.shows(b"two-bar\r\n")
    assert out.index(b"one-bar\r\n") < out.index(b"two-bar\r\n")  # printed unread: kept in the sandbox
    assert getattr(again.end(), "exit_code", None) == 0


def test_a_pty_survives_pause_and_resume(sandbox: Sandbox) -> None:
    term = sandbox.pty.create(PtySize(rows=30, cols=100))
    sandbox.pty.send_stdin(term.pid, b"KEPT=before-pause\n")
    term.disconnect()
    assert sandbox.pause() is True
    again = Sandbox.connect(sandbox.sandbox_id)
    screen = Screen(again.pty.connect(term.pid))
    again.pty.send_stdin(term.pid, b"echo $KEPT-$((1+1)); stty size\n")
    screen.shows(b"before-pause-2\r\n")
    screen.shows(b"30 100")
    again.pty.resize(term.pid, PtySize(rows=12, cols=60))
    again.pty.send_stdin(term.pid, b"stty size; exit\n")
    screen.shows(b"12 60")
    assert getattr(screen.end(), "exit_code", None) == 0


def test_a_pty_is_forked_with_its_shell(sandbox: Sandbox) -> None:
    term = sandbox.pty.create(PtySize(rows=24, cols=80))
    sandbox.pty.send_stdin(term.pid, b"WHO=parent\n")
    term.disconnect()
    kids = sandbox.fork(count=2)
    try:
        for i, kid in enumerate(kids):
            screen = Screen(kid.pty.connect(term.pid))
            kid.pty.send_stdin(term.pid, f"WHO=child{i}; echo was-$WHO; tty\n".encode())
            screen.shows(f"was-child{i}\r\n/dev/pts/".encode())  # its own shell, still on a terminal
            kid.pty.send_stdin(term.pid, b"exit\n")
            assert getattr(screen.end(), "exit_code", None) == 0
        screen = Screen(sandbox.pty.connect(term.pid))
        sandbox.pty.send_stdin(term.pid, b"echo still-$WHO\n")
        screen.shows(b"still-parent\r\n")
    finally:
        for kid in kids:
            kid.kill()


def test_a_pause_criu_cannot_take_names_the_terminal_and_the_sandbox_runs_on(sandbox: Sandbox) -> None:
    term = sandbox.pty.create(PtySize(rows=24, cols=80))
    screen = Screen(term)
    sandbox.pty.send_stdin(term.pid, b"sh -i\n")  # dash in the foreground, /dev/tty held open: CRIU cannot save it
    sandbox.pty.send_stdin(term.pid, b"echo in-$((2+3))\n")
    screen.shows(b"in-5\r\n")
    with pytest.raises(e2b.SandboxException, match=f"terminal is open: pid {term.pid}"):
        sandbox.pause()
    assert sandbox.is_running()
    sandbox.pty.send_stdin(term.pid, b"exit\necho back-$((3+4))\n")  # out of dash: bash alone is carried
    screen.shows(b"back-7\r\n")
    assert sandbox.pause() is True
    again = Sandbox.connect(sandbox.sandbox_id)
    again.pty.send_stdin(term.pid, b"echo resumed-$((4+5)); exit\n")
    assert Screen(again.pty.connect(term.pid)).shows(b"resumed-9\r\n")


def test_a_pty_as_root_is_roots(sandbox: Sandbox) -> None:
    term = sandbox.pty.create(PtySize(rows=24, cols=80), user="root")
    screen = Screen(term)
    sandbox.pty.send_stdin(term.pid, b"echo uid-$(id -u) home-$HOME; stat -c owner-%U $(tty); exit\n")
    assert b"uid-0 home-/root\r\nowner-root\r\n" in screen.shows(b"owner-root\r\n")
    assert getattr(screen.end(), "exit_code", None) == 0
