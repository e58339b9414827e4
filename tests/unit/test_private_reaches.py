"""Private reaches across modules, counted from the source: ``obj._name`` where no ``_name`` is defined in the module
that reads it. A module that reads another module's private state (``parent._rec`` in a lifecycle module, a test's
``sb._container``) cannot be changed without reading both; the goal is none outside the defining class's module.

The table below is exact, not a ceiling: a change that adds a reach fails here, and one that removes reaches lowers
its row, so the count only goes down and the diff shows it. A name counts as defined in a module when the module
defines a function, class or variable of that name, assigns that attribute, takes a parameter of that name or
imports it. ``__dunder__`` names are public protocol, not private state.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("agentenv", "envs", "policy", "rollout", "trainer", "bench")

# module -> private reaches it makes today (173 at b664969, issue 42; goal: 0)
REACHES = {
    "agentenv/harness/harbor.py": 11,
    "agentenv/inside/agent.py": 1,
    "agentenv/inside/kernel.py": 3,
    "agentenv/inside/magics.py": 1,
    "agentenv/inside/users.py": 1,
    "agentenv/remote/pool.py": 1,
    "agentenv/sandbox/core.py": 17,
    "agentenv/sandbox/expiry.py": 2,
    "agentenv/sandbox/forking.py": 24,
    "agentenv/sandbox/jobs.py": 1,
    "agentenv/sandbox/migration.py": 4,
    "agentenv/sandbox/recovery.py": 18,
    "agentenv/sandbox/shared.py": 1,
    "agentenv/sandbox/snapshotting.py": 15,
    "agentenv/sandbox/sweep.py": 1,
    "agentenv/sandbox/usage.py": 6,
    "agentenv/sandbox/warm.py": 5,
    "agentenv/server/routing.py": 1,
    "bench/capacity.py": 1,
    "bench/density.py": 4,
    "bench/docker_ops.py": 9,
    "bench/swe.py": 1,
    "envs/grading/sandbox_guard.py": 4,
    "envs/grading/sandbox_runners.py": 1,
}
TESTS_REACH = 124  # the tests' own reaches, in total (``sb._container``, ``sb._rec``, ...): a named test helper instead


def _defined(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
    return names


def reaches(path: Path) -> list[str]:
    """The private attribute names ``path`` reads or writes that it does not itself define, one per use."""
    tree = ast.parse(path.read_text(), str(path))
    own = _defined(tree)
    return [node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
            and node.attr not in own]


def count(roots: tuple[str, ...]) -> Counter[str]:
    found: Counter[str] = Counter()
    for pkg in roots:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if n := len(reaches(path)):
                found[str(path.relative_to(ROOT))] = n
    return found


def test_the_scan_sees_a_reach_and_not_a_modules_own_private_state(tmp_path):
    mod = tmp_path / "m.py"
    mod.write_text("class A:\n    def __init__(self):\n        self._mine = 1\n\n"
                   "def f(sb, a: A):\n    return sb._rec, a._mine, sb.__class__, sb.public\n")
    assert reaches(mod) == ["_rec"]


def test_private_reaches_across_modules_only_go_down():
    now = dict(count(PACKAGES))
    grew = {m: (REACHES.get(m, 0), n) for m, n in now.items() if n > REACHES.get(m, 0)}
    fell = {m: (n, now.get(m, 0)) for m, n in REACHES.items() if now.get(m, 0) < n}
    assert not grew, f"new private reaches (module: (allowed, found)); use or add a public method instead: {grew}"
    assert not fell, f"fewer private reaches than the table says: lower REACHES to the new counts: {fell}"


def test_the_tests_reach_into_private_state_no_more_than_before():
    now = sum(count(("tests",)).values())
    assert now <= TESTS_REACH, f"tests reach into private state {now} times (was {TESTS_REACH}): use the public surface"
    assert now == TESTS_REACH, f"tests reach into private state {now} times now: lower TESTS_REACH to {now}"
