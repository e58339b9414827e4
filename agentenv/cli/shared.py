"""What the command groups of ``agentenv`` share: the console they print on, how a time reads, the options saying
where images come from, which ``serve``, ``cluster up`` and ``images pull`` all take, and how a token is read.

Tokens have one spelling everywhere (docs/operations.md): a file flag, ``--token-file`` for the server a command
serves or talks to (``--<service>-token-file`` where it talks to several: ``--policy-token-file``,
``--env-token-file``), else an environment variable holding the token itself (``$AGENTENV_TOKEN``,
``$AGENTENV_POLICY_TOKEN``, ``$AGENTENV_GATEWAY_TOKEN``); never the value on the command line, which every local
user reads (``ps``)."""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

console = Console()


def when(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


ImageMirror = typer.Option("--image-mirror", help="a registry mirroring the images' namespaces (HOST:PORT, or "
                                                  "HOST:PORT/PATH; "
                                                  "repeatable), tried before the image's own registry "
                                                  "(default: $AGENTENV_IMAGE_MIRRORS)")
ImageTarballs = typer.Option(help="a folder of `docker save` tarballs, each <the image name, any character but "
                                  "letters, digits and ._- made _>.tar "
                                  "(default: $AGENTENV_IMAGE_TARBALLS)")
ImagePull = typer.Option("--image-pull/--no-image-pull", help="pull from registries at all (default: "
                                                              "$AGENTENV_IMAGE_PULL, else yes)")
PullDeadline = typer.Option(help="seconds a pull may take (default: $AGENTENV_PULL_DEADLINE, else 600)")


TokenFile = Annotated[Path | None, typer.Option(help="file holding the server's bearer token (else $AGENTENV_TOKEN)")]


def read_token(path: Path | None, env: str | None) -> str | None:
    """The token in the file ``path`` (stripped), else in ``$env`` (None: left to whoever uses it, e.g. a Ray
    worker's own environment), else None; BadParameter for an empty or unreadable file."""
    if path is None:
        return (os.environ.get(env, "").strip() or None) if env else None
    try:
        token = path.read_text().strip()
    except OSError as e:
        raise typer.BadParameter(f"cannot read the token file {path}: {e.strerror}") from None
    if not token:
        raise typer.BadParameter(f"{path} is empty; write the token into it")
    return token
