"""``agentenv ls / rm / exec / shell / snapshots`` against a real ``agentenv serve`` (issue 45): the server named by
``--url`` or ``$AGENTENV_URL``, its token read from ``--token-file`` or ``$AGENTENV_TOKEN``; what a sandbox made
reaches the terminal as visible text (``exec``, the tables), except on ``shell``, a real terminal that says so.
``serve`` itself says where its console is and where its token is."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

import agentenv
from agentenv.cli import app

from .server_fixtures import TOKEN, free_port, start_server_process, write_token_file

pytestmark = pytest.mark.integration
HOSTILE = "\x1b[2J\x1b]0;pwned\x07all tests PASSED[reverse]x"
TERMINAL_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
CLI = "import sys; from agentenv.cli import main; sys.argv[0] = 'agentenv'; main()"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, str]]:
    """A server process; its url, its token file, and what it printed on starting."""
    folder = tmp_path_factory.mktemp("cli-remote")
    token_file, port = write_token_file(folder), free_port()
    proc = start_server_process(port, token_file, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        yield f"http://127.0.0.1:{port}", token_file, proc.stdout.readline().decode()
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.fixture
def sandbox(served: tuple[str, Path, str]) -> Iterator[agentenv.api.SandboxLike]:
    with agentenv.connect(served[0], TOKEN) as client, \
            client.Sandbox.create(memory="128m", labels={"note": HOSTILE}) as sb:
        yield sb


def cli(args: list[str], url: str, token_file: Path | None = None) -> tuple[int, str]:
    """``agentenv ARGS`` in this process, the server given by $AGENTENV_URL and the token as asked."""
    env = {"AGENTENV_URL": url, "COLUMNS": "400"}
    if token_file is None:
        env["AGENTENV_TOKEN"] = TOKEN
    else:
        args = [*args, "--token-file", str(token_file)]
    r = CliRunner().invoke(app, args, env=env)
    return r.exit_code, r.output


def test_serve_says_where_its_console_and_its_token_are(served):
    url, token_file, said = served
    assert f"{url}/console/login" in said and str(token_file) in said
    assert TOKEN not in said


def test_ls_rm_and_snapshots_on_a_server(served, sandbox):
    url, token_file, _ = served
    code, out = cli(["ls", "--url", url], url, token_file)   # --url given, and the token from its file
    assert code == 0, out
    line = next(x for x in out.splitlines() if sandbox.id in x)
    assert TERMINAL_CONTROLS.findall(out) == [] and "all tests PASSED[reverse]x" in line
    snap = sandbox.snapshot(labels={"note": HOSTILE})
    code, out = cli(["snapshots", "ls"], url)                 # $AGENTENV_URL and $AGENTENV_TOKEN
    assert code == 0 and snap.id in out and TERMINAL_CONTROLS.findall(out) == [], out
    assert cli(["snapshots", "rm", snap.id], url)[0] == 0
    assert snap.id not in cli(["snapshots", "ls"], url)[1]
    assert cli(["rm", sandbox.id], url) == (0, f"closed {sandbox.id}\n")
    assert sandbox.state == "closed"


def test_exec_prints_the_output_as_text_and_exits_with_the_command_s_code(served, sandbox):
    url = served[0]
    code, out = cli(["exec", sandbox.id, "--", "printf", "'\\033[2Jcleared\\n'", ";", "echo", "$((6*7))", ";",
                     "exit", "3"], url)
    assert code == 3, out
    assert out == "\\x1b[2Jcleared\n42\n"


def test_a_server_without_its_token_is_refused_with_the_fix(served):
    r = CliRunner().invoke(app, ["ls", "--url", served[0]], env={"AGENTENV_TOKEN": None})
    assert r.exit_code == 2 and "--token-file FILE" in r.output and "$AGENTENV_TOKEN" in r.output


def test_shell_is_a_real_terminal_and_says_so(served, sandbox):
    url, token_file, _ = served
    pid, fd = pty.fork()
    if pid == 0:  # the child: agentenv shell on this pseudo-terminal
        os.execve(sys.executable, [sys.executable, "-c", CLI, "shell", sandbox.id, "--url", url, "--token-file",
                                   str(token_file)], {**os.environ, "TERM": "xterm"})
    seen = b""

    def read_until(what: bytes, limit: float = 60.0) -> None:
        nonlocal seen
        deadline = time.monotonic() + limit
        while what not in seen:
            assert time.monotonic() < deadline, seen.decode(errors="replace")
            if select.select([fd], [], [], 0.5)[0]:
                try:
                    seen += os.read(fd, 65536)
                except OSError:  # the child ended: what it printed is all there is
                    raise AssertionError(seen.decode(errors="replace")) from None

    read_until(b"a real terminal in")
    os.write(fd, b"stty size\n")
    read_until(b"24 80")                          # a terminal that says no size: 24 x 80
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))   # the window resized: SIGWINCH
    deadline = time.monotonic() + 60
    while b"30 100" not in seen:                  # the sandbox's terminal follows (asked again until it has)
        assert time.monotonic() < deadline, seen.decode(errors="replace")
        os.write(fd, b"stty size\n")
        while select.select([fd], [], [], 0.5)[0]:
            seen += os.read(fd, 65536)
    os.write(fd, b"tty; echo ok-$((6*7)); printf '\\033[1mbold\\n'; exit 5\n")
    read_until(b"\x1b[1mbold")                    # escape sequences reach the terminal unchanged
    assert re.search(rb"/dev/pts/\d+", seen) and b"ok-42" in seen
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 5
    os.close(fd)
