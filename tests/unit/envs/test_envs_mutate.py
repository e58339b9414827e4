"""Mutation operators: each kind finds its sites, edits only them, and gives valid Python."""

from __future__ import annotations

import ast
import difflib
import json
from pathlib import Path

import pytest

from envs.tasks import build
from envs.tasks.libraries import load_libraries
from envs.tasks.mutate import KINDS, MutationError, MutationSpec, apply, candidates, sites

SOURCE = '''\
import math


def clamp(x, lo, hi):
    """Keep x in [lo, hi]."""
    if x < lo:
        return lo
    if x > hi and hi is not None:
        return hi
    return x


class Window:
    def total(self, items, start=0):
        acc = start
        for i in range(1, len(items)):
            acc += items[i] - items[i - 1]
        print(acc)
        return max(acc, 0) if acc in (1, 2) or acc == 3 else math.floor(acc * 2 // 3)
'''


def changed(before: str, after: str) -> list[tuple[str, str]]:
    diff = [d for d in difflib.ndiff(before.splitlines(), after.splitlines()) if d[:1] in "+-"]
    return [(d[0], d[2:]) for d in diff]


@pytest.mark.parametrize(("spec", "old", "new"), [
    (("clamp", "compare_swap", 0), "    if x < lo:", "    if x <= lo:"),
    (("clamp", "compare_swap", 2), "    if x > hi and hi is not None:", "    if x > hi and hi is None:"),
    (("Window.total", "binop_swap", 0), "            acc += items[i] - items[i - 1]",
     "            acc += items[i] + items[i - 1]"),
    (("Window.total", "off_by_one", 0), "        for i in range(1, len(items)):", "        for i in range(0, len(items)):"),
    (("clamp", "bool_swap", 0), "    if x > hi and hi is not None:", "    if x > hi or hi is not None:"),
    (("clamp", "drop_operand", 0), "    if x > hi and hi is not None:", "    if x > hi:"),
    (("Window.total", "swap_args", 0), "        for i in range(1, len(items)):",
     "        for i in range(len(items), 1):"),
])
def test_each_kind_edits_one_site(spec, old, new):
    out, edit = apply(SOURCE, MutationSpec("m.py", *spec))
    assert changed(SOURCE, out) == [("-", old), ("+", new)]
    assert edit.line == SOURCE[: edit.start].count("\n") + 1
    ast.parse(out)


def test_removing_an_if_and_deleting_statements():
    out, _ = apply(SOURCE, MutationSpec("m.py", "clamp", "remove_if", 0))
    assert changed(SOURCE, out) == [("-", "    if x < lo:"), ("-", "        return lo")]
    out, _ = apply(SOURCE, MutationSpec("m.py", "Window.total", "delete_statement", 2))
    assert changed(SOURCE, out) == [("-", "        print(acc)")]
    out, _ = apply(SOURCE, MutationSpec("m.py", "Window.total", "delete_statement", 1))
    assert changed(SOURCE, out) == [("-", "            acc += items[i] - items[i - 1]"), ("+", "            pass")]


def test_docstrings_and_other_functions_are_not_sites():
    assert all(name != "clamp" for name, _ in sites(SOURCE, "delete_statement"))
    assert {name for name, _ in sites(SOURCE, "compare_swap")} == {"clamp", "Window.total"}


def test_candidates_cover_every_kind_and_all_apply():
    specs = candidates(SOURCE, "m.py")
    assert {s.kind for s in specs} == set(KINDS)
    for s in specs:
        out, _ = apply(SOURCE, s)
        assert out != SOURCE


def test_bad_specs_raise():
    with pytest.raises(MutationError, match="no bool_swap site"):
        apply(SOURCE, MutationSpec("m.py", "nope", "bool_swap", 0))
    with pytest.raises(MutationError, match="out of range"):
        apply(SOURCE, MutationSpec("m.py", "clamp", "compare_swap", 9))
    with pytest.raises(MutationError, match="unknown mutation kind"):
        MutationSpec.from_json({"file": "m.py", "function": "f", "kind": "flip", "index": 0})


def test_pinned_specs_and_libraries_are_consistent():
    libs = {lib.name: lib for lib in load_libraries()}
    assert len(libs) >= 5
    pinned = build.read_mutations()
    assert sum(len(v) for v in pinned.values()) >= 40
    for name, specs in pinned.items():
        assert name in libs
        for s in specs:
            assert s.file in libs[name].mutate and s.kind in KINDS
    raw = json.loads(Path(build.MUTATIONS_FILE).read_text())
    assert raw["max_failing"] == build.MAX_FAILING


def test_setup_commands_reverse_the_gold_patch_in_a_heredoc():
    cmds = build.setup_commands("--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+b")
    assert cmds[0].startswith("git apply -R") and cmds[0].endswith("+b\n" + build.PATCH_EOF)
    assert cmds[1] == build.REINIT
