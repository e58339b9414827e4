"""Tokens never travel in argv (issue 40, finding 11): every local user reads a process's command line
(``ps``, ``/proc/<pid>/cmdline``), so a command takes a token from a file or an environment variable only.

- no option of any ``agentenv`` command (the plugins' included) takes a token's value: ``--...-token`` is refused;
- ``agentenv rollout cleanup`` run for real with ``--env-token-file`` sends the file's token to the env server, and
  the token is nowhere in its command line while it waits for the server's answer.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import typer

from agentenv.cli import app as agentenv_app

SECRET = "s3cret-token-in-a-file"


def _commands() -> dict[str, Any]:
    """Every command of the ``agentenv`` CLI by its full name, the plugins' (``agentenv.commands``) included, as the
    command line resolves them."""
    found: dict[str, Any] = {}
    todo: list[tuple[str, Any]] = [("agentenv", typer.main.get_command(agentenv_app))]
    while todo:
        name, cmd = todo.pop()
        found[name] = cmd
        if hasattr(cmd, "list_commands"):  # a group's
            todo += [(f"{name} {sub}", cmd.get_command(None, sub)) for sub in cmd.list_commands(None)]
    return found


def test_the_walk_reaches_every_command_and_each_declares_its_options():
    """Every leaf command is a typer command whose options are its own (none passes unknown words on to a parser of
    its own, as ``agentenv tasks`` did with argparse): what these tests check of options covers them all."""
    found = _commands()
    tasks = {f"agentenv tasks {c}" for c in ("images", "base-commit", "scrub-script", "search", "build", "fixes",
                                             "validate", "prewarm")}
    assert tasks <= found.keys()
    passing_on = [name for name, cmd in found.items() if not hasattr(cmd, "list_commands")
                  and (cmd.ignore_unknown_options or cmd.allow_extra_args)]
    assert passing_on == []
    assert any("--token-file" in p.opts for p in found["agentenv tasks prewarm"].params)


def test_no_command_takes_a_token_on_its_command_line():
    taking = sorted(f"{name} {opt}" for name, cmd in _commands().items() for p in cmd.params
                    if p.param_type_name == "option" for opt in p.opts if re.search(r"token$", opt))
    assert taking == []
    assert any("--env-token-file" in p.opts for p in _commands()["agentenv rollout cleanup"].params)


def test_every_token_is_a_file_flag_with_its_environment_variable():
    """One spelling (issue 45): ``--token-file`` for the server a command serves or talks to, ``--<who>-token-file``
    where it talks to several, and its help names the variable that holds the token otherwise."""
    flags = {(name, opt, p.help or "") for name, cmd in _commands().items() for p in cmd.params
             if p.param_type_name == "option" for opt in p.opts if re.search(r"-token(-|$)", opt)}
    assert len(flags) >= 15
    assert [(n, o) for n, o, _ in flags if not re.fullmatch(r"--([a-z]+-)?token-file", o)] == []
    assert [(n, o) for n, o, h in flags if not re.search(r"\$AGENTENV_[A-Z_]*TOKEN\b", h)] == []


def test_cleanup_sends_the_token_from_its_file_and_keeps_it_off_the_command_line(tmp_path):
    token_file = tmp_path / "env.token"
    token_file.write_text(SECRET + "\n")
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.5)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    exe = Path(sys.executable).parent / "agentenv"
    proc = subprocess.Popen([str(exe), "rollout", "cleanup", "run-x", "--env-url", url, "--env-token-file",
                             str(token_file)], env={**os.environ, "AGENTENV_HOME": str(tmp_path / "home")},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        requests = 0
        while proc.poll() is None:   # every request it sends (it lists sandboxes, then snapshots), until it exits
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            request = b""
            while b"\r\n\r\n" not in request:
                request += conn.recv(65536)
            cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()   # while it waits for the answer
            assert SECRET.encode() not in cmdline
            assert f"authorization: bearer {SECRET}".encode() in request.lower()
            conn.sendall(b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            conn.close()
            requests += 1
        assert requests >= 1, proc.stdout.read().decode() if proc.stdout else ""
    finally:
        proc.kill()
        proc.wait()
        listener.close()
