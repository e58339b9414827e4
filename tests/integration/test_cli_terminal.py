"""``agentenv ls`` and ``agentenv snapshots ls`` print labels that whoever made the sandbox chose (an E2B
``metadata`` is a label): escape sequences and rich markup in them must reach the terminal as visible text
(issue 40, finding 7), never clear the screen, set the title, move the cursor or turn into styles."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

import agentenv
from agentenv.cli import app

pytestmark = pytest.mark.integration
HOSTILE = {"note": "\x1b[2J\x1b]0;pwned\x07\x1b[1A\x1b[2Kall tests PASSED\u009b7m", "tag": "[reverse]inverted"}
TERMINAL_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def test_ls_and_snapshots_ls_print_hostile_labels_as_visible_text():
    with agentenv.Sandbox.create(memory="128m", labels=HOSTILE) as sb:
        snap = sb.snapshot(labels=HOSTILE)
        try:
            runner = CliRunner()
            for command in (["ls"], ["snapshots", "ls"]):
                r = runner.invoke(app, command, env={"COLUMNS": "400"})
                assert r.exit_code == 0, r.output
                line = next(x for x in r.output.splitlines() if (sb.id if command == ["ls"] else snap.id) in x)
                assert TERMINAL_CONTROLS.findall(r.output) == [], command
                assert "[reverse]inverted" in line and "all tests PASSED" in line, command
        finally:
            snap.delete()
