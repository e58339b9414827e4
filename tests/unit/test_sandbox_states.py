"""The states a sandbox's record goes through, as one table (``agentenv.sandbox.record.TRANSITIONS``): each change
the table does not list is refused, and no lifecycle module writes a state except through ``Record.transition``."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path
from typing import get_args

import pytest

from agentenv.api import State
from agentenv.errors import SandboxStateError
from agentenv.sandbox.record import TRANSITIONS, Record, SandboxRecord, check_transition

ROOT = Path(__file__).resolve().parents[2]
STATES: tuple[State, ...] = get_args(State)
ILLEGAL = [(a, b) for a, b in itertools.permutations(STATES, 2) if b not in TRANSITIONS[a]]


def _rec(state: State, owner: list[int] | None) -> SandboxRecord:
    return SandboxRecord(id="sb-x", image="img", spec={}, state=state, created_at=0.0, owner=owner)


def test_the_table_names_every_state_and_only_states():
    assert set(TRANSITIONS) == set(STATES)
    assert all(set(to) <= set(STATES) for to in TRANSITIONS.values())
    assert not TRANSITIONS["closed"] and not TRANSITIONS["lost"]  # the ends: nothing comes back
    assert all("lost" not in to for to in TRANSITIONS.values())  # observed, never recorded


@pytest.mark.parametrize(("old", "new"), ILLEGAL, ids=[f"{a}-to-{b}" for a, b in ILLEGAL])
def test_an_illegal_transition_is_refused_and_changes_nothing(old, new):
    with pytest.raises(SandboxStateError, match=f"from {old} to {new}"):
        check_transition("sb-x", old, new)
    rec = Record()
    rec.id, rec._rec = "sb-x", _rec(old, [1])
    with pytest.raises(SandboxStateError):
        rec.transition(new, owner=None)
    assert rec.record == _rec(old, [1])


def test_a_listed_transition_or_staying_put_moves_the_record_with_its_fields():
    for old in STATES:
        for new in (old, *TRANSITIONS[old]):
            rec = Record()
            rec.id, rec._rec = "sb-x", _rec(old, [1])
            rec.transition(new, owner=None)
            assert rec.record == _rec(new, None)


def _state_writes(path: Path) -> list[int]:
    """Lines of ``path`` that write a record's state other than through ``transition``: ``x["state"] = ...``,
    ``x.state = ...``, or ``x.update(..., state=...)`` / ``replace(x, ..., state=...)``."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            lines += [node.lineno for t in targets if (isinstance(t, ast.Subscript)
                      and isinstance(t.slice, ast.Constant) and t.slice.value == "state")
                      or (isinstance(t, ast.Attribute) and t.attr == "state")]
        elif (isinstance(node, ast.Call) and any(k.arg == "state" for k in node.keywords)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr in ("update", "replace"))
                   or (isinstance(node.func, ast.Name) and node.func.id == "replace"))):
            lines.append(node.lineno)
    return lines


def test_every_state_change_of_a_sandbox_goes_through_the_table():
    found = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / "agentenv" / "sandbox").rglob("*.py"))
             if (n := _state_writes(p))}
    assert found == {"agentenv/sandbox/record.py": found.get("agentenv/sandbox/record.py", [])}, found
    assert len(found.get("agentenv/sandbox/record.py", [])) == 1  # transition's own update
