"""``agentenv tasks`` is the task sets' command line (issue 45), a plugin of ``agentenv`` through its
``agentenv.commands`` entry point; ``python -m envs.tasks`` still runs the same commands, saying it is deprecated."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from agentenv.cli import app
from envs.task_sandbox import SCRUB

ROOT = Path(__file__).resolve().parents[3]


def test_agentenv_tasks_runs_the_task_commands_with_their_options():
    r = CliRunner().invoke(app, ["tasks", "scrub-script"])
    assert r.exit_code == 0 and r.output == SCRUB
    r = CliRunner().invoke(app, ["tasks", "validate", "--help"])
    assert r.exit_code == 0 and r.output.startswith("usage: agentenv tasks validate") and "--sample" in r.output
    r = CliRunner().invoke(app, ["tasks", "base-commit"])   # argparse's own refusal, its exit code
    assert r.exit_code == 2 and "the following arguments are required: image" in r.output


def test_python_m_envs_tasks_still_works_and_says_it_is_deprecated():
    r = subprocess.run([sys.executable, "-m", "envs.tasks", "scrub-script"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 0 and r.stdout == SCRUB
    assert "deprecated" in r.stderr and "agentenv tasks" in r.stderr
