"""``agentenv ls / rm / exec / shell`` and ``agentenv snapshots ls / rm``: on this host's sandboxes, or on a server's
with ``--url`` (else ``$AGENTENV_URL``) and its token from ``--token-file`` (else ``$AGENTENV_TOKEN``): the remote
client (``agentenv.connect``) and the local API keep one contract (``agentenv.api.Backend``), so each command is
written once for both.

What a sandbox made is untrusted: ``exec`` prints its output through ``agentenv.terminal.clean`` (escape
sequences made visible), the tables through ``plain``. ``shell`` is the one exception, and says so: it is a real
terminal (a pty in the sandbox, this terminal in raw mode), whose programs draw with escape sequences.
"""

from __future__ import annotations

import codecs
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from agentenv.cli.shared import TokenFile, console, read_token, when
from agentenv.terminal import clean, markup, plain

URL_ENV = "AGENTENV_URL"
Url = Annotated[str | None, typer.Option("--url", envvar=URL_ENV, show_envvar=False,
                                         help=f"an agentenv server (else ${URL_ENV}); none: this host's sandboxes")]

app = typer.Typer()  # the commands, added to agentenv's own app (``agentenv ls``, not ``agentenv sandboxes ls``)
snapshots_app = typer.Typer(help="The snapshot store (this host's, or a server's with --url).", no_args_is_help=True)


@contextmanager
def backend(url: str | None, token_file: Any) -> Iterator[Any]:
    """The ``agentenv.api.Backend`` the command works on: this host (``agentenv``), or a client of ``url``."""
    import agentenv

    if url is None:
        yield agentenv
        return
    token = read_token(token_file, "AGENTENV_TOKEN")
    if token is None:
        console.print(f"[red]error:[/] {markup(url)} needs its token: --token-file FILE, or set $AGENTENV_TOKEN")
        raise typer.Exit(2)
    with agentenv.connect(url, token) as client:
        yield client


def _labels(labels: dict[str, str]) -> Text:
    """A sandbox's or snapshot's labels as one cell (whoever made it chose them: printed as text)."""
    return plain(",".join(f"{k}={v}" for k, v in labels.items()))


@app.command("ls")
def list_sandboxes(url: Url = None, token_file: TokenFile = None) -> None:
    """List sandboxes (this host's, or a server's with --url)."""
    t = Table("id", "state", "image", "created")
    t.add_column("labels", overflow="fold")   # shown whole, over several lines if need be
    with backend(url, token_file) as on:
        for sb in on.Sandbox.list():
            t.add_row(plain(sb.id), plain(sb.state), plain(sb.image), when(sb.created_at), _labels(sb.labels))
    console.print(t)


@app.command("rm")
def remove_sandbox(ids: list[str], url: Url = None, token_file: TokenFile = None) -> None:
    """Close sandboxes by id."""
    with backend(url, token_file) as on:
        for sid in ids:
            on.Sandbox.get(sid).close()
            console.print(f"closed {markup(sid)}")


@app.command("exec")
def exec_command(
    sandbox_id: Annotated[str, typer.Argument(metavar="ID")],
    command: Annotated[list[str], typer.Argument(help="the command, run with /bin/sh -c (its words joined by "
                                                      "spaces); put -- before it when it has options")],
    url: Url = None, token_file: TokenFile = None,
) -> None:
    """Run a command in a sandbox, printing its output as it comes (escapes made visible); exit with its code."""
    from agentenv.api import JobEnd, JobOutput

    with backend(url, token_file) as on:
        sb = on.Sandbox.get(sandbox_id)
        job = sb.start(" ".join(command))
        decoders = {name: codecs.getincrementaldecoder("utf-8")("replace") for name in ("stdout", "stderr")}
        for item in sb.output(job.pid):
            if isinstance(item, JobOutput):
                out = sys.stderr if item.stream == "stderr" else sys.stdout
                out.write(clean(decoders.get(item.stream, decoders["stdout"]).decode(item.data)))
                out.flush()
            elif isinstance(item, JobEnd):
                if item.timed_out:
                    typer.echo(f"timed out after {item.duration:.1f} s", err=True)
                raise typer.Exit(item.exit_code)


SHELL = "if command -v bash >/dev/null; then exec bash -l; else exec sh -l; fi"


@app.command("shell")
def shell(
    sandbox_id: Annotated[str, typer.Argument(metavar="ID")],
    command: Annotated[str, typer.Option(help="what runs on the terminal (default: bash, else sh)")] = SHELL,
    url: Url = None, token_file: TokenFile = None,
) -> None:
    """A real terminal in a sandbox, as ssh gives: its programs' escape sequences reach your terminal unchanged
    (only exec's output is cleaned). Exit the shell to leave."""
    import os

    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        console.print("[red]error:[/] agentenv shell needs a terminal on stdin and stdout; to run a command and read "
                      "its output, use agentenv exec ID -- COMMAND")
        raise typer.Exit(2)
    with backend(url, token_file) as on:
        sb = on.Sandbox.get(sandbox_id)
        job = sb.start_terminal(command, _size(), env={"TERM": os.environ.get("TERM", "xterm-256color")})
        typer.echo(f"a real terminal in {clean(sandbox_id)}: what runs there draws on this terminal as it would "
                   "over ssh; exit the shell to leave", err=True)
        raise typer.Exit(_relay(sb, job.pid))


def _size() -> tuple[int, int]:
    """This terminal's (rows, cols); 24 x 80 where it says none (a pseudo-terminal nobody sized)."""
    import os

    cols, rows = os.get_terminal_size(sys.stdout.fileno())
    return rows or 24, cols or 80


def _relay(sb: Any, pid: int) -> int:
    """Join this terminal (raw mode: every key goes to the sandbox's) to the job's until it ends; its exit code."""
    import os
    import select
    import signal
    import termios
    import threading
    import tty

    from agentenv.api import JobEnd, JobOutput
    from agentenv.errors import AgentEnvError

    fd, out = sys.stdin.fileno(), sys.stdout.fileno()
    stop = threading.Event()

    def typing() -> None:
        while not stop.is_set():
            if select.select([fd], [], [], 0.2)[0]:
                data = os.read(fd, 4096)
                try:
                    if data:
                        sb.send_input(pid, data)
                except (BrokenPipeError, ProcessLookupError, AgentEnvError):
                    return  # the job ended; the output's end says how
                if not data:
                    return

    saved = termios.tcgetattr(fd)
    was = signal.signal(signal.SIGWINCH, lambda *_: sb.resize(pid, _size()))
    tty.setraw(fd, termios.TCSANOW)  # what was typed already goes too (TCSAFLUSH would drop it)
    threading.Thread(target=typing, name="shell-input", daemon=True).start()
    try:
        for item in sb.output(pid):
            if isinstance(item, JobOutput):
                os.write(out, item.data)
            elif isinstance(item, JobEnd):
                return item.exit_code
        return 1
    finally:
        stop.set()
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
        signal.signal(signal.SIGWINCH, was)


@snapshots_app.command("ls")
def list_snapshots(url: Url = None, token_file: TokenFile = None) -> None:
    """List snapshots in the store."""
    t = Table("id", "parent", "memory", "size MB", "created", "sandbox")
    t.add_column("labels", overflow="fold")
    with backend(url, token_file) as on:
        for s in on.Snapshot.list():
            t.add_row(plain(s.id), plain(s.parent_id or "-"), "yes" if s.has_memory else "no",
                      f"{s.size_bytes / 1e6:.1f}", when(s.created_at), plain(s.sandbox_id or "-"), _labels(s.labels))
    console.print(t)


@snapshots_app.command("rm")
def remove_snapshots(ids: list[str], url: Url = None, token_file: TokenFile = None) -> None:
    """Delete snapshots by id."""
    with backend(url, token_file) as on:
        for sid in ids:
            on.Snapshot.get(sid).delete()
            console.print(f"deleted {markup(sid)}")
