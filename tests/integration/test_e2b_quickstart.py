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


def test_the_quickstart_program_runs_as_written(e2b_url: str, tmp_path: Path, monkeypatch) -> None:
    (program,) = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.DOTALL)
    assert os.environ["E2B_API_URL"] == os.environ["E2B_SANDBOX_URL"] == e2b_url   # the page's two variables
    before = {s.id for s in agentenv.Sandbox.list()}
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(program, str(PAGE), "exec"), {"__name__": "__main__"})
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("Python 3.") and lines[1:] == ["sum of squares: 30", "['4', '4']"]
    assert (tmp_path / "squares.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert {s.id for s in agentenv.Sandbox.list()} <= before    # killed, the forks too
