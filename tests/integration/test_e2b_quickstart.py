"""docs/e2b-quickstart.md's program, as written on the page, through the official ``e2b_code_interpreter`` SDK
against a real ``agentenv serve`` (the page's two variables set by the ``e2b_url`` fixture): it charts, pauses,
resumes and forks, and leaves no sandbox behind."""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

import pytest

pytest.importorskip("e2b_code_interpreter")

import agentenv  # noqa: E402

PAGE = Path(__file__).resolve().parents[2] / "docs" / "e2b-quickstart.md"


def test_the_quickstart_program_runs_as_written(e2b_url: str, tmp_path: Path) -> None:
    assert os.environ["E2B_API_URL"] == os.environ["E2B_SANDBOX_URL"] == e2b_url   # the page's two variables
    run_the_program(tmp_path)


def run_the_program(folder: Path) -> None:
    """The page's program run in ``folder`` against the server the page's variables name: what it prints, the
    chart it saves (a PNG), and no sandbox of its left (test_newcomer.py runs it too)."""
    (program,) = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.DOTALL)
    before = {s.id for s in agentenv.Sandbox.list()}
    out = io.StringIO()
    with contextlib.chdir(folder), contextlib.redirect_stdout(out):
        exec(compile(program, str(PAGE), "exec"), {"__name__": "__main__"})
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("Python 3.") and lines[1:] == ["sum of squares: 30", "['4', '4']"]
    assert (folder / "squares.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert {s.id for s in agentenv.Sandbox.list()} <= before    # killed, the forks too
