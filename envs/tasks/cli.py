"""``agentenv tasks ...``: the SWE task sets' commands (``envs.tasks.__main__``: images, base-commit, scrub-script,
search, build, fixes, validate, prewarm), added to ``agentenv`` through the ``agentenv.commands`` entry point.

This module imports only typer, so that ``agentenv --help`` (which lists it) stays quick; the commands and their
options (``agentenv tasks --help``, ``agentenv tasks validate --help``) are ``envs.tasks.__main__``'s, given every
word after ``tasks``.
"""

from __future__ import annotations

import typer

app = typer.Typer(help="SWE task sets: build their images, validate them, prewarm a fleet (agentenv tasks --help).")


@app.command(context_settings={
    "allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []})
def tasks(ctx: typer.Context) -> None:
    """The task sets' commands: images | base-commit | scrub-script | search | build | fixes | validate | prewarm."""
    from envs.tasks.__main__ import main

    raise typer.Exit(main(list(ctx.args)))
