"""The docs' ``sandbox`` blocks (tests/docblocks.py) run on real Docker and CRIU, as a reader would run them, and
leave no sandbox running: what the docs show is what users copy, closing included."""

from __future__ import annotations

from pathlib import Path

import pytest
from sybil import Example

import agentenv
from tests import docblocks

pytestmark = pytest.mark.integration

SANDBOX_BLOCKS = [pytest.param(ex, id=ex.parsed.id) for ex in docblocks.all_examples()
                  if ex.parsed.needs_mark and ex.parsed.mark == "sandbox"]


@pytest.mark.parametrize("example", SANDBOX_BLOCKS)
def test_sandbox_block(example: Example, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The block runs in a scratch folder, and every sandbox it made is closed when it ends."""
    before = {sb.id for sb in agentenv.Sandbox.list()}
    monkeypatch.chdir(docblocks.scratch(tmp_path))
    try:
        example.evaluate()
    finally:
        left = [sb for sb in agentenv.Sandbox.list() if sb.id not in before]
        for sb in left:
            sb.close()
    assert not left, (f"{example.parsed.id} left {len(left)} sandbox(es) running "
                      f"({[sb.id for sb in left]}): close them in the example (with, or try/finally)")
