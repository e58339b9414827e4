"""``agentenv view RUN``: the trajectory viewer as a server of its own on 127.0.0.1 (its pages: ``trainer.viewer.web``).

    agentenv view runs/NAME [--port 8701] [--token-file FILE]

This module imports only typer, so that every ``agentenv ... --help`` (which lists this command) stays quick; the
viewer's FastAPI app is imported when the command runs.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Annotated

import typer

DEFAULT_PORT = 8701

app = typer.Typer(help="The trajectory viewer: a run's episodes, groups, search trees and metrics in a browser.",
                  invoke_without_command=True, no_args_is_help=True,
                  context_settings={"allow_interspersed_args": True})  # RUN before or after the options


@app.callback(invoke_without_command=True)
def view(
    run: Annotated[Path, typer.Argument(help="a run folder (train or rollout), or a folder of runs")],
    port: Annotated[int, typer.Option(help="TCP port on 127.0.0.1")] = DEFAULT_PORT,
    token_file: Annotated[Path | None, typer.Option(help="file holding the token (made if missing); else "
                                                         "$AGENTENV_VIEW_TOKEN, else a new token, printed in the "
                                                         "URL")] = None,
) -> None:
    """Serve the viewer on 127.0.0.1 and print the URL that logs in."""
    import uvicorn

    from agentenv.server import load_token, uvicorn_config
    from agentenv.server.console_auth import PREFIX
    from trainer.viewer.web import create_app

    if not run.is_dir():
        typer.echo(f"error: {run} is not a folder (give a run folder or a folder of runs)", err=True)
        raise typer.Exit(2)
    try:
        token = (load_token(token_file) if token_file is not None else
                 os.environ.get("AGENTENV_VIEW_TOKEN", "").strip() or secrets.token_urlsafe(24))
    except (ValueError, OSError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    server = uvicorn.Server(uvicorn_config(create_app(run, token), "127.0.0.1", port, "warning"))
    typer.echo(f"trajectory viewer of {run}: http://127.0.0.1:{port}{PREFIX}/login#token={token}")
    server.run()


if __name__ == "__main__":  # python -m trainer.viewer.cli RUN: agentenv view before the package is installed
    app()
