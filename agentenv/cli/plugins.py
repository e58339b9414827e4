"""The subcommands other packages add through the ``agentenv.commands`` entry-point group, loaded on first use.

Loading every plugin at start made each ``agentenv ... --help`` import FastAPI, the server and the trainer's modules
(1.3-1.7 s, issue 45): ``PluginGroup`` lists the plugins' names at once, but imports one only when it is the command
run, or when the top-level help shows its one-line description. A plugin whose package is missing adds no command
(a yellow line says why); a plugin that is one command (a Typer with a single command and no callback) is that
command, ``agentenv NAME ARGS...``, rather than a group of one. ``bench/cli_startup.py`` measures the start; ``agentenv`` imports none of these packages.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from typer.core import TyperCommand, TyperGroup

from agentenv.cli.shared import console
from agentenv.terminal import markup

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

GROUP = "agentenv.commands"


@cache
def _declared() -> dict[str, EntryPoint]:
    """The entry points of ``agentenv.commands`` by name (the first of a name, should two distributions give it);
    importlib.metadata is imported here, as a command of agentenv's own never needs it."""
    from importlib.metadata import entry_points

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
    if len(sub.registered_commands) == 1 and sub.registered_callback is None and not sub.registered_groups:
        command = typer.main.get_command(sub)  # one command: ``agentenv NAME ARGS...`` runs it
        command.name = name
        return command
    holder = typer.Typer()
    holder.add_typer(sub, name=name)
    group = typer.main.get_command(holder)
    assert isinstance(group, TyperGroup)
    return group.commands[name]


def _help_line(name: str) -> str | None:
    """The ``help=`` literal of the ``typer.Typer(...)`` that plugin ``name``'s entry point names, read from its
    module's source without importing it (importing ``envs.tasks.cli`` would import ``envs``, which registers its
    Gymnasium environments: 0.2 s); None where the source does not say it as a literal."""
    import ast
    from importlib.util import find_spec

    module, _, attr = _declared()[name].value.partition(":")
    top, *rest = module.split(".")
    spec = find_spec(top)  # a top-level name: found without importing anything
    if spec is None or not spec.submodule_search_locations:
        return None
    base = Path(next(iter(spec.submodule_search_locations)), *rest)
    source = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    try:
        tree = ast.parse(source.read_text())
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == attr for t in node.targets)
                and isinstance(node.value, ast.Call)):
            for kw in node.value.keywords:
                if kw.arg == "help" and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str):
                    return kw.value.value
    return None


class PluginGroup(TyperGroup):
    """``agentenv``'s top-level group: its own commands, then the plugins', each imported when first asked for.
    Its help lists a plugin by its Typer's help line alone, read from the plugin's source (``_help_line``)."""

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
        line = _help_line(cmd_name) if self.listing else None
        return TyperCommand(cmd_name, help=line) if line is not None else _load(cmd_name)
