"""The subcommands other packages add through the ``agentenv.commands`` entry-point group, loaded on first use.

Loading every plugin at start made each ``agentenv ... --help`` import FastAPI, the server and the trainer's modules
(1.3-1.7 s, issue 45): ``PluginGroup`` lists the plugins' names at once, but imports one only when it is the command
run, or when the top-level help shows its one-line description. A plugin whose package is missing adds no command
(a yellow line says why). ``bench/cli_startup.py`` measures the start; ``agentenv`` imports none of these packages.
"""

from __future__ import annotations

from functools import cache
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup

from agentenv.cli.shared import console
from agentenv.terminal import markup

GROUP = "agentenv.commands"


@cache
def _declared() -> dict[str, EntryPoint]:
    """The entry points of ``agentenv.commands`` by name (the first of a name, should two distributions give it)."""
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=GROUP):
        found.setdefault(ep.name, ep)
    return found


@cache
def _typer(name: str) -> typer.Typer | None:
    """The plugin ``name``'s Typer app; None (said in yellow) where its package cannot be imported."""
    try:
        sub = _declared()[name].load()
    except (ImportError, AttributeError) as e:  # a package not installed (or a stale install) adds no command
        console.print(f"[yellow]agentenv {markup(name)} unavailable: {markup(e)} (in the checkout: pip install -e .)[/]")
        return None
    assert isinstance(sub, typer.Typer), f"entry point {name} of {GROUP} is not a typer.Typer"
    return sub


@cache
def _load(name: str) -> Any:
    """The plugin ``name`` as the command (typer's click) ``app.add_typer`` would make of it; None where it cannot import."""
    sub = _typer(name)
    if sub is None:
        return None
    holder = typer.Typer()
    holder.add_typer(sub, name=name)
    group = typer.main.get_command(holder)
    assert isinstance(group, TyperGroup)
    return group.commands[name]


class PluginGroup(TyperGroup):
    """``agentenv``'s top-level group: its own commands, then the plugins', each imported when first asked for.
    Its help lists a plugin by its Typer's help line alone, without building the plugin's commands."""

    listing = False

    def format_help(self, ctx: Any, formatter: Any) -> None:
        self.listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self.listing = False

    def list_commands(self, ctx: Any) -> list[str]:
        own = super().list_commands(ctx)
        return own + [name for name in _declared() if name not in own]

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        own = super().get_command(ctx, cmd_name)
        if own is not None or cmd_name not in _declared():
            return own
        sub = _typer(cmd_name) if self.listing else None
        if sub is not None and isinstance(sub.info.help, str):
            return TyperCommand(cmd_name, help=sub.info.help)
        return _load(cmd_name)
