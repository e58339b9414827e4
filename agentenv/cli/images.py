"""``agentenv images``: the Docker images on this host, where one comes from (``agentenv.host.image_store``: its
local store, a tarball, a mirror, its registry), the disk they take and their eviction, least recently used first."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from agentenv.cli.shared import ImageMirror, ImagePull, ImageTarballs, PullDeadline, console, when
from agentenv.terminal import markup, plain

app = typer.Typer(help="Docker images: where one comes from, their disk, eviction (least recently used).",
                  no_args_is_help=True)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


@app.command("ls")
def list_images() -> None:
    """Every image: its size, what it shares, its last use through agentenv, how agentenv got it, what holds it."""
    from agentenv.host import image_store

    now = image_store.usage()
    t = Table("image", "GiB", "own GiB", "last used", "fetched", "held by")
    for i in now.images:
        used = when(i.last_used) if i.last_used else "never"
        t.add_row(plain(", ".join(i.tags) or i.id[7:19]), _gib(i.size), _gib(i.unique), used, plain(i.fetched or ""),
                  plain(i.held_by or ""))
    console.print(t)
    console.print(f"images take {_gib(now.total)} GiB (shared layers once); last use: agentenv's record in the "
                  "home's image-uses/ (Docker keeps none)")


@app.command("pull")
def pull_images(
    images: list[str],
    image_mirror: Annotated[list[str] | None, ImageMirror] = None,
    image_tarballs: Annotated[Path | None, ImageTarballs] = None,
    image_pull: Annotated[bool | None, ImagePull] = None,
    pull_deadline: Annotated[float | None, PullDeadline] = None,
) -> None:
    """Make sure each image is on this host: its local store, a tarball, a mirror, its registry (with progress)."""
    import dataclasses

    from agentenv.errors import ImageUnavailable
    from agentenv.host import image_store

    env = image_store.ImageSources.from_env()
    sources = dataclasses.replace(
        env, mirrors=tuple(image_mirror) if image_mirror else env.mirrors,
        tarballs=str(image_tarballs) if image_tarballs else env.tarballs,
        pull=env.pull if image_pull is None else image_pull, deadline=pull_deadline or env.deadline)
    failed = 0
    for name in images:
        try:
            got = image_store.ensure(name, sources, say=lambda line: console.print(markup(line)))
            console.print(f"{markup(name)}: {got.source} {markup(got.detail)} ({got.seconds:.1f} s)")
        except ImageUnavailable as e:
            console.print(f"[red]error:[/] {markup(e)}")
            failed += 1
    if failed:
        raise typer.Exit(1)


@app.command("evict")
def evict_images(
    budget: str = typer.Option(..., help="what the images may take after it, e.g. 500g"),
    all_images: bool = typer.Option(False, "--all", help="also images agentenv did not fetch itself (yours)"),
    dry_run: bool = typer.Option(False, help="say what would go, remove nothing"),
) -> None:
    """Remove images, least recently used first, until they fit the budget; never one a sandbox, a snapshot or a
    container stands on, nor the base image."""
    from agentenv.config import parse_size
    from agentenv.host import image_store

    gone = image_store.evict(parse_size(budget), only_fetched=not all_images, dry_run=dry_run,
                             say=lambda line: console.print(markup(line)))
    after = image_store.usage().total
    console.print(f"{'would remove' if dry_run else 'removed'} {len(gone)} image(s), "
                  f"{_gib(sum(i.unique for i in gone))} GiB; images take {_gib(after)} GiB now")
