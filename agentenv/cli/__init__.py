"""The ``agentenv`` command line. Other packages add subcommands through the ``agentenv.commands``
entry-point group (e.g. ``agentenv policy serve``), so this package imports none of them.

What it prints of a sandbox (labels, ids a server chose, outputs), of an error or of a log goes through
``agentenv.terminal`` (escape sequences made visible, rich markup escaped); tokens come from files or the
environment, never from the command line, where every local user would read them.

This module holds the app, the commands on this host's sandboxes and snapshots, and ``serve``; the command groups
of a Ray fleet (``cluster.py``) and of Docker images (``images.py``) are their own modules, what they share
(the console, the image-source options) is ``shared.py``, and ``agentenv tour`` is ``tour.py``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from agentenv.cli import cluster, images, sandboxes
from agentenv.cli.plugins import PluginGroup
from agentenv.cli.shared import ImageMirror, ImagePull, ImageTarballs, PullDeadline, console
from agentenv.terminal import clean, guard_logs, markup

DISTRIBUTION = "agentenv-rl"  # the name pip installs agentenv under (pyproject's [project] name)

app = typer.Typer(cls=PluginGroup, help="agentenv: sandboxes that snapshot, fork and resume fast.",
                  no_args_is_help=True)
app.add_typer(sandboxes.app)  # ls, rm, exec, shell: on this host, or a server's with --url
app.add_typer(sandboxes.snapshots_app, name="snapshots")
app.add_typer(cluster.app, name="cluster")


def _print_version(asked: bool) -> None:
    if not asked:
        return
    from importlib.metadata import PackageNotFoundError, version

    try:
        console.print(f"agentenv {version(DISTRIBUTION)} (distribution {DISTRIBUTION})", highlight=False)
    except PackageNotFoundError:
        console.print(f"[red]error:[/] the distribution {DISTRIBUTION} is not installed; in the checkout: "
                      "pip install -e .")
        raise typer.Exit(1) from None
    raise typer.Exit()


@app.callback()
def _root(
    show_version: Annotated[bool, typer.Option("--version", is_eager=True, callback=_print_version,
                                               help="print the installed version and exit")] = False,
) -> None:
    """agentenv: sandboxes that snapshot, fork and resume fast."""


@app.command("tour")
def run_tour(image: str = typer.Option("agentenv/base", help="image to run the tour in")) -> None:
    """Create, snapshot, fork 4 ways, pause/resume and restore a sandbox, timing each step."""
    from agentenv.cli import tour

    tour.run(image)


@app.command("gc")
def collect(
    max_age: float | None = typer.Option(None, help="also delete snapshots older than this many seconds"),
    dry_run: bool = typer.Option(False, "--dry-run", help="say what is past its deadline and which of the home's "
                                                          "mounts would go; change nothing"),
) -> None:
    """Mend what a killed process left (frozen sandboxes, half-made ones, interrupted pauses, fork snapshots), close
    sandboxes past their deadline (pause those that asked), remove leftovers of crashed snapshot writers, and once
    no sandbox or snapshot is left, unmount the home's volume and kept user namespaces; print each."""
    from agentenv import Sandbox
    from agentenv.config import paths
    from agentenv.sandbox import expiry, sweep
    from agentenv.snapshot import store

    said = []
    if dry_run:
        for sb in Sandbox.list():
            if expiry.due(sb.expires_at, sb.state):
                said.append(f"would {'pause' if expiry.action(sb.labels) == 'pause' else 'close'} sandbox "
                            f"{markup(sb.id)}: past its deadline")
        said += [f"would unmount {markup(m)}" for m in sweep.release_home(dry_run=True)]
    else:
        for where, ids in sweep.recover_all().items():
            if where in ("discarded", "lost") and ids:
                said.append(f"{where}: {markup(', '.join(ids))}")
        asked = {sb.id: expiry.action(sb.labels) for sb in Sandbox.list()}
        for sid in Sandbox.reap_expired():
            said.append(f"{'paused' if asked.get(sid) == 'pause' else 'closed'} sandbox {markup(sid)}: past its deadline")
        said += [f"removed {markup(name)}" for name in store.gc(max_age)]
        said += [f"unmounted {markup(m)}" for m in sweep.release_home()]
    for line in said:
        console.print(line)
    if not said:
        console.print(f"nothing to collect in {markup(paths().home)}")


@app.command("volume")
def show_volume() -> None:
    """Mount (and on first use make) this home's sandbox volume, where disk limits hold; show it."""
    import os

    from agentenv.host import volume
    from agentenv.snapshot import store

    v = volume.ensure()
    if not v.quotas:
        console.print(f"[red]no disk limits at {markup(v.path)}:[/] {markup(v.reason)}")
        raise typer.Exit(1)
    st = os.statvfs(v.path)
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    cap = store.limit()
    mode = "simple" if v.simple else "full"
    console.print(f"{markup(v.path)}: btrfs with {mode} quotas, {size / 2**30:.1f} GiB ({free / 2**30:.1f} free); sandboxes' "
                  f"disk limits hold; snapshot store limit: {'none' if cap is None else f'{cap / 2**30:.1f} GiB'}")


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", help="address to bind (loopback unless you mean otherwise)"),
    port: int = typer.Option(8700, help="TCP port"),
    token_file: Annotated[Path | None, typer.Option(help="file holding the bearer token (else $AGENTENV_TOKEN); "
                                                         "made with a new e2b_ token if missing")] = None,
    max_sandboxes: int = typer.Option(64, help="quota: live sandboxes on this server"),
    max_memory: str = typer.Option("64g", help="quota: memory of the live sandboxes together"),
    max_disk: str = typer.Option("640g", help="quota: disk limits of the live sandboxes together"),
    max_store: str | None = typer.Option(None, help="limit of the snapshot store (e.g. 200g); default: left as set"),
    unlimited_disk: bool = typer.Option(False, help="let clients make sandboxes without a disk limit (disk: null)"),
    reap_interval: float = typer.Option(5.0, help="seconds between deadline checks (expired sandboxes are closed, or paused where they asked)"),
    e2b: Annotated[bool | None, typer.Option("--e2b/--no-e2b", help="serve E2B's API too (default: when the e2b "
                                                                     "package is installed)")] = None,
    warm_pool: int = typer.Option(0, min=0, help="sandboxes of the default image and limits kept started, so "
                                                 "that a burst of creates gets them at once (0: none)"),
    domain: str | None = typer.Option(None, help="the domain E2B's get_host names ({port}-{id}.DOMAIN): requests "
                                                 "with such a Host reach that sandbox port (docs/e2b.md)"),
    shared_store: Annotated[Path | None, typer.Option(help="a folder every server sees (e.g. NFS): each pause and "
                                                           "snapshot is also published there, and a snapshot this "
                                                           "store lacks is imported from it (docs/transfer.md)")] = None,
    transfer_key: Annotated[Path | None, typer.Option(help="file (0600) of the key shared by the servers that "
                                                           "exchange snapshots, directly or through --shared-store: "
                                                           "imports not sealed with it are refused (default: "
                                                           "$AGENTENV_TRANSFER_KEY_FILE, else this home's own key; "
                                                           "docs/transfer.md)")] = None,
    runs: Annotated[Path | None, typer.Option(help="a folder of run folders: the console shows their trajectories "
                                                   "at /console/runs (docs/viewer.md)")] = None,
    image_mirror: Annotated[list[str] | None, ImageMirror] = None,
    image_tarballs: Annotated[Path | None, ImageTarballs] = None,
    image_pull: Annotated[bool | None, ImagePull] = None,
    pull_deadline: Annotated[float | None, PullDeadline] = None,
) -> None:
    """Serve the sandbox API over HTTP (msgpack or JSON); every route but /health and /metrics needs the token.

    E2B's SDKs run against it unchanged: E2B_API_URL=E2B_SANDBOX_URL=http://127.0.0.1:8700, E2B_API_KEY=<token>."""
    try:
        from agentenv import server
    except ImportError as e:
        console.print(rf"[red]error:[/] the server needs FastAPI and uvicorn ({markup(e)}); pip install -e '.\[server]' in the checkout")
        raise typer.Exit(2) from None

    made = token_file is not None and not token_file.exists()
    try:
        token = server.load_token(token_file)
    except (ValueError, OSError) as e:
        console.print(f"[red]error:[/] {markup(e)}")
        raise typer.Exit(2) from None
    where = "$AGENTENV_TOKEN" if token_file is None else f"{token_file.resolve()}{' (made now)' if made else ''}"
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    typer.echo(clean(f"agentenv serve: the API at {url}, the console at {url}/console/login (log in with the "
                     f"token); the token: {where}"))
    try:
        pages = [] if runs is None else [_console_pages("runs", runs)]
        server.serve(token, host, port, max_sandboxes=max_sandboxes, max_memory=max_memory, max_disk=max_disk,
                     max_store=max_store, unlimited_disk=unlimited_disk, reap_interval=reap_interval, e2b=e2b,
                     warm_pool=warm_pool, domain=domain, shared_store=shared_store, transfer_key=transfer_key,
                     pages=pages, image_mirrors=image_mirror, image_pull=image_pull, pull_deadline=pull_deadline,
                     image_tarballs=str(image_tarballs) if image_tarballs else None)
    except ValueError as e:  # an option refused (a shared store, runs, not a directory, a bad --domain or key file)
        console.print(f"[red]error:[/] {markup(e)}")
        raise typer.Exit(2) from None


def _console_pages(name: str, folder: Path) -> Callable[[Any], None]:
    """The console pages another package declares as entry point ``name`` of ``agentenv.console`` (``runs``: the
    trajectory viewer, ``trainer.viewer.web.install``), bound to ``folder``; ValueError when none is installed."""
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group="agentenv.console") if ep.name == name]
    if not found:
        raise ValueError(f"no console pages named {name!r} are installed (the trajectory viewer comes with the "
                         "trainer package: pip install -e . from the checkout)")
    install = found[0].load()
    return lambda app: install(app, folder)


app.add_typer(images.app, name="images")


def main() -> None:
    """Entry point of the console script."""
    guard_logs()
    from agentenv.errors import AgentEnvError

    try:
        app()
    except AgentEnvError as e:
        console.print(f"[red]error:[/] {markup(e)}")
        raise SystemExit(1) from None
