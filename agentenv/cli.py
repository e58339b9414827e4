"""The ``agentenv`` command line. Other packages add subcommands through the ``agentenv.commands``
entry-point group (e.g. ``agentenv policy serve``), so this package imports none of them.

What it prints of a sandbox (labels, ids a server chose, outputs), of an error or of a log goes through
``agentenv.terminal`` (escape sequences made visible, rich markup escaped); tokens come from files or the
environment, never from the command line, where every local user would read them."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from agentenv.terminal import guard_logs, markup, plain

app = typer.Typer(help="agentenv: sandboxes that snapshot, fork and resume fast.", no_args_is_help=True)
snapshots_app = typer.Typer(help="The snapshot store.", no_args_is_help=True)
app.add_typer(snapshots_app, name="snapshots")
cluster_app = typer.Typer(help="The env-server fleet on a Ray cluster: one `agentenv serve` per node.",
                          no_args_is_help=True)
app.add_typer(cluster_app, name="cluster")

console = Console()


def _when(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


@app.command()
def tour(image: str = typer.Option("agentenv/base", help="image to run the tour in")) -> None:
    """Create, snapshot, fork 4 ways, pause/resume and restore a sandbox, timing each step."""
    from agentenv import tour as tour_mod

    tour_mod.run(image)


@app.command("ls")
def list_sandboxes() -> None:
    """List sandboxes on this host."""
    from agentenv import Sandbox

    t = Table("id", "state", "image", "created")
    t.add_column("labels", overflow="fold")   # shown whole, over several lines if need be
    for sb in Sandbox.list():
        t.add_row(plain(sb.id), plain(sb.state), plain(sb.image), _when(sb.created_at), _labels(sb.labels))
    console.print(t)


def _labels(labels: dict[str, str]) -> Text:
    """A sandbox's or snapshot's labels as one cell (whoever made it chose them: printed as text)."""
    return plain(",".join(f"{k}={v}" for k, v in labels.items()))


@app.command("rm")
def remove_sandbox(ids: list[str]) -> None:
    """Close sandboxes by id."""
    from agentenv import Sandbox

    for sid in ids:
        Sandbox.get(sid).close()
        console.print(f"closed {markup(sid)}")


@app.command("gc")
def collect(
    max_age: float | None = typer.Option(None, help="also delete snapshots older than this many seconds"),
) -> None:
    """Mend what a killed process left (frozen sandboxes, half-made ones, interrupted pauses, fork snapshots),
    pause sandboxes past their TTL and remove leftovers of crashed snapshot writers."""
    from agentenv import Sandbox
    from agentenv.sandbox import sweep
    from agentenv.snapshot import store

    for where, ids in sweep.recover_all().items():
        if where in ("discarded", "lost") and ids:
            console.print(f"{where}: {markup(', '.join(ids))}")
    for sid in Sandbox.reap_expired():
        console.print(f"reaped expired sandbox {markup(sid)} (paused, or closed where it asked to be)")
    for name in store.gc(max_age):
        console.print(f"removed {markup(name)}")


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
    reap_interval: float = typer.Option(5.0, help="seconds between TTL checks (expired sandboxes are paused)"),
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
        console.print(rf"[red]error:[/] the server needs FastAPI and uvicorn ({markup(e)}); pip install 'agentenv\[server]'")
        raise typer.Exit(2) from None

    try:
        token = server.load_token(token_file)
    except (ValueError, OSError) as e:
        console.print(f"[red]error:[/] {markup(e)}")
        raise typer.Exit(2) from None
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
    found = [ep for ep in entry_points(group="agentenv.console") if ep.name == name]
    if not found:
        raise ValueError(f"no console pages named {name!r} are installed (the trajectory viewer comes with the "
                         "trainer package: pip install -e . from the checkout)")
    install = found[0].load()
    return lambda app: install(app, folder)


@snapshots_app.command("ls")
def list_snapshots() -> None:
    """List snapshots in the store."""
    from agentenv import Snapshot

    t = Table("id", "parent", "memory", "size MB", "created", "sandbox")
    t.add_column("labels", overflow="fold")
    for s in Snapshot.list():
        t.add_row(plain(s.id), plain(s.parent_id or "-"), "yes" if s.has_memory else "no", f"{s.size_bytes / 1e6:.1f}",
                  _when(s.created_at), plain(s.sandbox_id or "-"), _labels(s.labels))
    console.print(t)


@snapshots_app.command("rm")
def remove_snapshots(ids: list[str]) -> None:
    """Delete snapshots by id."""
    from agentenv import Snapshot

    for sid in ids:
        Snapshot.get(sid).delete()
        console.print(f"deleted {markup(sid)}")


RayAddress = Annotated[str | None, typer.Option(help="the Ray cluster (default: the one on this machine)")]


def _fleet_table(rows: list[dict[str, object]]) -> Table:
    t = Table("node", "url", "free sandboxes", "free memory GB", "token", "state")
    for i in rows:
        cap = i["capacity"]
        assert isinstance(cap, dict)
        state = ("started" if i["started"] else "kept") if "started" in i else "serving"
        t.add_row(plain(str(i["node_id"])[:12]), plain(i["url"]), plain(cap["free_sandboxes"]),
                  f"{int(cap['free_memory']) / 1e9:.1f}", plain(i["token"]), state)
    return t


@cluster_app.command("up")
def cluster_up(
    ray_address: RayAddress = None,
    token_file: Annotated[Path | None, typer.Option(help="file holding the servers' bearer token (else "
                                                         "$AGENTENV_TOKEN); made with a new token if missing")] = None,
    host: str = typer.Option("127.0.0.1", help="address each server binds: loopback, or 'node' (each node's own "
                                               "address, for clients on other hosts)"),
    port: int = typer.Option(8700, help="TCP port on each node (0: any free port)"),
    cpus: float = typer.Option(0.0, help="CPUs Ray reserves for each server"),
    home: str | None = typer.Option(None, help="agentenv home on each node ({node}: the node id); default: the "
                                               "node's own $AGENTENV_HOME"),
    max_sandboxes: int = typer.Option(64, help="quota per server: live sandboxes"),
    max_memory: str = typer.Option("64g", help="quota per server: memory of the live sandboxes together"),
    max_disk: str = typer.Option("640g", help="quota per server: disk limits of the live sandboxes together"),
    transfer_key: Annotated[Path | None, typer.Option(help="file (0600, at this path on every node) of the key the "
                                                           "servers share to move snapshots between them "
                                                           "(docs/transfer.md); default: each node's own")] = None,
    image_mirror: Annotated[list[str] | None, ImageMirror] = None,
    image_tarballs: Annotated[Path | None, ImageTarballs] = None,
    image_pull: Annotated[bool | None, ImagePull] = None,
    pull_deadline: Annotated[float | None, PullDeadline] = None,
) -> None:
    """Start an env server on every alive Ray node that has none (again: keeps those up); each a detached
    Ray actor pinned to its node, found by `agentenv.Pool.from_ray()` and `agentenv rollout --env-fleet`."""
    from agentenv.server import fleet, load_token

    try:
        token = load_token(token_file)
    except (ValueError, OSError) as e:
        console.print(f"[red]error:[/] {markup(e)}")
        raise typer.Exit(2) from None
    server: dict[str, Any] = {"max_sandboxes": max_sandboxes, "max_memory": max_memory, "max_disk": max_disk}
    if transfer_key is not None:
        server["transfer_key"] = str(transfer_key)
    for key, value in (("image_mirrors", image_mirror), ("image_tarballs", image_tarballs and str(image_tarballs)),
                       ("image_pull", image_pull), ("pull_deadline", pull_deadline)):
        if value is not None:
            server[key] = value
    rows = fleet.up(token, address=ray_address, host=host, port=port, cpus=cpus, home=home, server=server)
    console.print(_fleet_table(list(rows)))


@cluster_app.command("down")
def cluster_down(
    ray_address: RayAddress = None,
    close_sandboxes: bool = typer.Option(False, help="close every sandbox on each node too (snapshots stay)"),
) -> None:
    """Stop the fleet's env servers and remove their actors."""
    from agentenv.server import fleet

    for row in fleet.down(address=ray_address, close_sandboxes=close_sandboxes):
        console.print(f"stopped {markup(row['url'] or '(not answering)')} on node {markup(row['node_id'][:12])}"
                      + (f", closed {len(row['closed'])} sandboxes" if row["closed"] else ""))


@cluster_app.command("ls")
def cluster_ls(ray_address: RayAddress = None) -> None:
    """The fleet's env servers that answer, with their free capacity."""
    from agentenv.remote import fleet

    console.print(_fleet_table(list(fleet.servers(address=ray_address))))


# --- images: where one comes from (agentenv.host.image_store), their disk, eviction ----------------------------

images_app = typer.Typer(help="Docker images: where one comes from, their disk, eviction (least recently used).",
                         no_args_is_help=True)



def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


@images_app.command("ls")
def list_images() -> None:
    """Every image: its size, what it shares, its last use through agentenv, how agentenv got it, what holds it."""
    from agentenv.host import image_store

    now = image_store.usage()
    t = Table("image", "GiB", "own GiB", "last used", "fetched", "held by")
    for i in now.images:
        when = _when(i.last_used) if i.last_used else "never"
        t.add_row(plain(", ".join(i.tags) or i.id[7:19]), _gib(i.size), _gib(i.unique), when, plain(i.fetched or ""),
                  plain(i.held_by or ""))
    console.print(t)
    console.print(f"images take {_gib(now.total)} GiB (shared layers once); last use: agentenv's record in the "
                  "home's image-uses/ (Docker keeps none)")


@images_app.command("pull")
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


@images_app.command("evict")
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


def cluster_prewarm(
    images: list[str],
    ray_address: Annotated[str | None, typer.Option(help="the Ray cluster (default: the one on this machine)")] = None,
    token_file: Annotated[Path | None, typer.Option(help="the servers' token (else $AGENTENV_TOKEN)")] = None,
    deadline: float | None = typer.Option(None, help="seconds each pull may take (at most the servers' own)"),
) -> None:
    """Get images onto every fleet server before a run (each server's own sources), a line per image done.
    For a task set: `python -m envs.tasks prewarm --tasks FILE`."""
    import os

    from agentenv.remote.prewarm import Warmed, prewarm_fleet

    token = (token_file.read_text() if token_file else os.environ.get("AGENTENV_TOKEN", "")).strip()
    if not token:
        console.print("[red]error:[/] give --token-file FILE or set $AGENTENV_TOKEN")
        raise typer.Exit(2)

    def show(w: Warmed, done: int, total: int) -> None:
        what = f"{w.source} ({w.seconds:.1f} s)" if w.ok else f"[red]failed:[/] {markup(w.error)}"
        console.print(f"[{done}/{total}] {markup(w.url)} {markup(w.image)}: {what}")

    got = prewarm_fleet(token, images, address=ray_address, deadline=deadline, on_progress=show)
    if not all(w.ok for w in got):
        raise typer.Exit(1)


app.add_typer(images_app, name="images")
cluster_app.command("prewarm")(cluster_prewarm)


def _mount_plugins() -> None:
    for ep in entry_points(group="agentenv.commands"):
        try:
            sub = ep.load()
        except ImportError as e:  # a package that is not installed adds no command
            console.print(f"[yellow]agentenv {markup(ep.name)} unavailable: {markup(e)}[/]")
            continue
        app.add_typer(sub, name=ep.name)


def main() -> None:
    """Entry point of the console script."""
    guard_logs()
    _mount_plugins()
    from agentenv.errors import AgentEnvError

    try:
        app()
    except AgentEnvError as e:
        console.print(f"[red]error:[/] {markup(e)}")
        raise SystemExit(1) from None
