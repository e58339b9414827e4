"""What the command groups of ``agentenv`` share: the console they print on, how a time reads, and the options
saying where images come from, which ``serve``, ``cluster up`` and ``images pull`` all take."""

from __future__ import annotations

import datetime

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
