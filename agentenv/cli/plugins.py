"""The subcommands other packages add through the ``agentenv.commands`` entry-point group, loaded on first use.

Loading every plugin at start made each ``agentenv ... --help`` import FastAPI, the server and the trainer's modules
(1.3-1.7 s, issue 45): ``PluginGroup`` lists the plugins' names at once, but imports one only when it is the command
run, or when the top-level help shows its one-line description. A plugin whose package is missing adds no command
(a yellow line says why); a plugin that is one command (a Typer with a single command and no callback) is that
command, ``agentenv NAME ARGS...``, rather than a group of one. ``bench/cli_startup.py`` measures the start; ``agentenv`` imports none of these packages.

The entry points are read from each distribution's ``entry_points.txt`` on ``sys.path`` (``declared``), as
``importlib.metadata.entry_points`` finds them (the first distribution of a name, then the first entry point of a name)
but without importing it: importlib.metadata, with the email, zipfile and csv modules it pulls in, and its scan were a
fifth of ``agentenv --help``. ``tests/unit/test_cli_start.py`` checks that both read the same.
"""

from __future__ import annotations

import os
import re
import sys
from functools import cache
from pathlib import Path
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup

from agentenv.cli.shared import console
from agentenv.terminal import markup

GROUP = "agentenv.commands"
_SECTION = re.compile(r"^\[\s*(.+?)\s*\]\s*$")


def _metadata_dirs(folder: str) -> list[str]:
    """The ``*.dist-info`` and ``*.egg-info`` folders in one ``sys.path`` folder, in importlib.metadata's order."""
    try:
        names = sorted(os.listdir(folder or "."))
    except OSError:  # not a folder (a zip, a path hook's name) or gone
        return []
    return [os.path.join(folder or ".", n) for n in names if n.endswith((".dist-info", ".egg-info"))]


def _distribution(meta: str) -> str:
    """A metadata folder's distribution name, normalized as importlib.metadata compares them."""
    stem = os.path.basename(meta).rpartition(".")[0].partition("-")[0]
    return re.sub(r"[-_.]+", "_", stem).lower()


@cache
def declared() -> dict[str, str]:
    """The entry points of ``agentenv.commands`` by name, each its ``module:attr`` (the module doc)."""
    found: dict[str, str] = {}
    seen: set[str] = set()
    for folder in sys.path:
        for meta in _metadata_dirs(folder):
            name = _distribution(meta)
            if name in seen:
                continue
            seen.add(name)
            try:
                with open(os.path.join(meta, "entry_points.txt"), encoding="utf-8") as f:
                    text = f.read()
            except OSError:
                continue
            group = None
            for line in text.splitlines():
                line = line.strip()
                if (head := _SECTION.match(line)) is not None:
                    group = head.group(1)
                elif group == GROUP and "=" in line and not line.startswith(("#", ";")):
                    key, _, value = line.partition("=")
                    found.setdefault(key.strip(), value.split("[", 1)[0].strip())
    return found


@cache
def _typer(name: str) -> typer.Typer | None:
    """The plugin ``name``'s Typer app; None (said in yellow) where its package cannot be imported."""
    from importlib import import_module

    module, _, attr = declared()[name].partition(":")
    try:
        sub: Any = import_module(module.strip())
        for part in filter(None, attr.strip().split(".")):
            sub = getattr(sub, part)
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
    Gymnasium environments: 0.2 s): the assignment alone is parsed, not the module; None where the source does not
    say it as a literal."""
    import ast
    from importlib.util import find_spec

    module, _, attr = declared()[name].partition(":")
    top, *rest = module.strip().split(".")
    spec = find_spec(top)  # a top-level name: found without importing anything
    if spec is None or not spec.submodule_search_locations:
        return None
    base = Path(next(iter(spec.submodule_search_locations)), *rest)
    source = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    try:
        lines = source.read_text().splitlines()
    except OSError:
        return None
    start = re.compile(rf"{re.escape(attr.strip())}\s*(:[^=]*)?=\s*typer\.Typer\(")
    for i, line in enumerate(lines):
        if not start.match(line):
            continue
        for end in range(i + 1, min(i + 40, len(lines)) + 1):  # the statement's lines: the shortest run that parses
            try:
                node = ast.parse("\n".join(lines[i:end])).body[0]
            except SyntaxError:
                continue
            call = getattr(node, "value", None)
            for kw in call.keywords if isinstance(call, ast.Call) else []:
                if kw.arg == "help" and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str):
                    return kw.value.value
            return None
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
        return own + [name for name in declared() if name not in own]

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        own = super().get_command(ctx, cmd_name)
        if own is not None or cmd_name not in declared():
            return own
        line = _help_line(cmd_name) if self.listing else None
        return TyperCommand(cmd_name, help=line) if line is not None else _load(cmd_name)
