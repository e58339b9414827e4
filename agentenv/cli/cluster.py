"""``agentenv cluster``: the env-server fleet on a Ray cluster, one ``agentenv serve`` per node (``up``, ``down``,
``ls``) and images got onto every server before a run (``prewarm``). Printing as the rest of the CLI does
(``agentenv.terminal``); the fleet itself is ``agentenv.server.fleet`` and ``agentenv.remote.fleet``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from agentenv.cli.shared import ImageMirror, ImagePull, ImageTarballs, PullDeadline, console, read_token
from agentenv.terminal import markup, plain

app = typer.Typer(help="The env-server fleet on a Ray cluster: one `agentenv serve` per node.", no_args_is_help=True)

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


@app.command("up")
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


@app.command("down")
def cluster_down(
    ray_address: RayAddress = None,
    close_sandboxes: bool = typer.Option(False, help="close every sandbox on each node too (snapshots stay)"),
) -> None:
    """Stop the fleet's env servers and remove their actors."""
    from agentenv.server import fleet

    for row in fleet.down(address=ray_address, close_sandboxes=close_sandboxes):
        console.print(f"stopped {markup(row['url'] or '(not answering)')} on node {markup(row['node_id'][:12])}"
                      + (f", closed {len(row['closed'])} sandboxes" if row["closed"] else ""))


@app.command("ls")
def cluster_ls(ray_address: RayAddress = None) -> None:
    """The fleet's env servers that answer, with their free capacity."""
    from agentenv.remote import fleet

    console.print(_fleet_table(list(fleet.servers(address=ray_address))))


@app.command("prewarm")
def cluster_prewarm(
    images: list[str],
    ray_address: Annotated[str | None, typer.Option(help="the Ray cluster (default: the one on this machine)")] = None,
    token_file: Annotated[Path | None, typer.Option(help="file holding the servers' token (else "
                                                         "$AGENTENV_TOKEN)")] = None,
    deadline: float | None = typer.Option(None, help="seconds each pull may take (at most the servers' own)"),
) -> None:
    """Get images onto every fleet server before a run (each server's own sources), a line per image done.
    For a task set: `agentenv tasks prewarm --tasks FILE`."""
    from agentenv.remote.prewarm import Warmed, prewarm_fleet

    token = read_token(token_file, "AGENTENV_TOKEN")
    if not token:
        console.print("[red]error:[/] give --token-file FILE or set $AGENTENV_TOKEN")
        raise typer.Exit(2)

    def show(w: Warmed, done: int, total: int) -> None:
        what = f"{w.source} ({w.seconds:.1f} s)" if w.ok else f"[red]failed:[/] {markup(w.error)}"
        console.print(f"[{done}/{total}] {markup(w.url)} {markup(w.image)}: {what}")

    got = prewarm_fleet(token, images, address=ray_address, deadline=deadline, on_progress=show)
    if not all(w.ok for w in got):
        raise typer.Exit(1)
