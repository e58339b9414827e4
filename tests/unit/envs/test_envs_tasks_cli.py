"""``agentenv tasks`` is the task sets' command line (issue 45), a plugin of ``agentenv`` through its
``agentenv.commands`` entry point, typer commands in its help style; ``python -m envs.tasks`` still runs the same
commands, saying it is deprecated."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from agentenv.cli import app
from envs.task_sandbox import SCRUB
from envs.tasks.__main__ import main

ROOT = Path(__file__).resolve().parents[3]
WIDE = {"COLUMNS": "200"}  # rich wraps at the terminal width: a line per option


def test_agentenv_tasks_runs_the_task_commands_with_their_options():
    r = CliRunner().invoke(app, ["tasks", "scrub-script"])
    assert r.exit_code == 0 and r.output == SCRUB
    r = CliRunner().invoke(app, ["tasks", "validate", "--help"], prog_name="agentenv", env=WIDE)
    assert r.exit_code == 0 and "Usage: agentenv tasks validate [OPTIONS]" in r.output
    for flag in ("--libraries", "--library", "--tasks", "--all", "--sample", "--seed", "--budget", "--no-images",
                 "--dataset", "--workers"):
        assert f"│ {flag} " in r.output, flag   # typer's panel of options, as every agentenv command's
    r = CliRunner().invoke(app, ["tasks", "base-commit"])   # a usage error, said as agentenv's are
    assert r.exit_code == 2 and "Missing argument" in r.output


def test_a_bad_option_or_task_set_is_said_in_one_line(tmp_path, capsys):
    r = CliRunner().invoke(app, ["tasks", "validate", "--dataset", "nope"], env=WIDE)
    assert r.exit_code == 2 and "'nope' is not one of agentenv, swe-bench" in r.output
    r = CliRunner().invoke(app, ["tasks", "validate", "--all", "--sample", "3"], env=WIDE)
    assert r.exit_code == 2 and "not both" in r.output
    assert main(["validate", "--tasks", str(tmp_path / "none.jsonl"), "--no-images"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "none.jsonl" in err and "Traceback" not in err
    assert main(["images", "--library", "no-such-library"]) == 2
    assert "no library no-such-library" in capsys.readouterr().err


def test_python_m_envs_tasks_still_works_and_says_it_is_deprecated():
    r = subprocess.run([sys.executable, "-m", "envs.tasks", "scrub-script"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 0 and r.stdout == SCRUB
    assert "deprecated" in r.stderr and "agentenv tasks" in r.stderr
