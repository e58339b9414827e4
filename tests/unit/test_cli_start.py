"""``agentenv`` starts light (issue 45): its plugins (``agentenv.commands``) are imported when run, and its help lists
them without importing what they run on; ``--version`` reads the installed distribution's metadata.

What a fresh interpreter holds after the command is the state checked here; how long it takes is
``bench/cli_startup.py``'s (a test never asserts a time).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from importlib.metadata import entry_points, version
from pathlib import Path

from typer.testing import CliRunner

from agentenv.cli import DISTRIBUTION, app, plugins

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "ray", "httpx", "fastapi", "uvicorn", "numpy", "agentenv.server", "agentenv.sandbox",
         "agentenv.host", "trainer.viewer.web", "rollout.workers", "envs.datasets", "envs.tasks")
# what the top-level help needs no more than the rest: importlib.metadata (plugins.declared reads the entry points
# itself) and the contract (agentenv.api: the package imports it on first use)
NOT_FOR_HELP = ("importlib.metadata", "agentenv.api")


def heavy_loaded_after(argv: list[str], heavy: tuple[str, ...] = HEAVY) -> tuple[list[str], str]:
    """The ``heavy`` modules a fresh interpreter holds once ``agentenv ARGV`` ran (in-process, as the console script
    runs it), and what it printed."""
    code = (f"import sys, json; sys.argv = ['agentenv', *{argv!r}]\nfrom agentenv.cli import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {[h.split('.')[0] for h in heavy]!r}"
            f" and m.startswith({heavy!r}))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=True, env={"COLUMNS": "200", **dict(__import__("os").environ)})
    *printed, last = out.stdout.strip().splitlines()
    return json.loads(last), "\n".join(printed)


def test_importing_the_cli_loads_nothing_heavy():
    assert heavy_loaded_after([])[0] == []


def test_help_lists_the_plugins_without_importing_what_they_run_on():
    loaded, printed = heavy_loaded_after(["--help"], HEAVY + NOT_FOR_HELP)
    assert loaded == []
    for name in ("serve", "exec", "shell", "policy", "rollout", "train", "view", "tasks"):
        assert f" {name} " in printed, name


def test_the_plugins_read_without_importlib_metadata_are_the_ones_it_finds():
    """``plugins.declared`` reads the entry points' files itself (importlib.metadata was a fifth of ``--help``): the
    same names and targets as ``importlib.metadata.entry_points``, the first of a name kept."""
    expected: dict[str, str] = {}
    for ep in entry_points(group=plugins.GROUP):
        expected.setdefault(ep.name, ep.value)
    assert plugins.declared() == expected
    assert {"policy", "rollout", "train", "tasks", "view"} <= expected.keys()


def test_a_plugin_s_help_loads_that_plugin_s_commands_only():
    loaded, printed = heavy_loaded_after(["view", "--help"])
    assert loaded == [] and "--token-file" in printed


def test_version_is_the_installed_distribution_s():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == DISTRIBUTION
    r = CliRunner().invoke(app, ["--version"])
    assert r.exit_code == 0, r.output
    assert r.output.strip() == f"agentenv {version(DISTRIBUTION)} (distribution {DISTRIBUTION})"
