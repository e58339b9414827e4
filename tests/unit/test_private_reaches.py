"""Private reaches across modules, counted from the source: ``obj._name`` where no ``_name`` is defined in the module
that reads it. A module that reads another module's private state (``parent._rec`` in a lifecycle module, a test's
``sb._container``) cannot be changed without reading both; the goal is none outside the defining class's module.

The table below is exact, not a ceiling: a change that adds a reach fails here, and one that removes reaches lowers
its row, so the count only goes down and the diff shows it. A name counts as defined in a module when the module
defines a function, class or variable of that name, assigns that attribute, takes a parameter of that name or
imports it. ``__dunder__`` names are public protocol, not private state.

Two kinds of underscore name are not another module's private state, and only these, each named in a table below:
- a standard-library function documented under its underscore name (``os._exit``, ``sys._getframe``), read
  from that module by its name: the underscore there says "use with care", not "private";
- a name a class uses on ``self`` when the class's bases are all outside classes of ``OUTSIDE_BASES``, whose
  protected members are their package's documented extension points for subclasses: a name the module does not
  define can then only come from that base.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("agentenv", "envs", "policy", "rollout", "trainer", "bench")

# module -> private reaches it makes today (173 at b664969, issue 42; goal: 0)
REACHES = {
    # the C socket type's accept (``_socket``), which the keeper uses so that its start imports no ``socket`` module
    "agentenv/inside/keeper.py": 1,
    # Starlette caches a request's headers; a msgpack body decoded to JSON drops the cache (``del request._headers``)
    "agentenv/server/routing.py": 1,
}
# (module, name) -> why the standard library's underscore name is public (the Python docs document it)
DOCUMENTED_STDLIB = {
    ("os", "_exit"): "os._exit: exit without cleanup or flushing, documented for a forked child (os docs)",
    ("sys", "_getframe"): "sys._getframe: documented in the sys module (CPython-specific)",
}
# base class, as imported -> why a subclass may use its protected members
OUTSIDE_BASES = {
    "harbor.environments.base.BaseEnvironment": "harbor's environment providers (docker, daytona, modal, ...) are "
    "subclasses calling its protected helpers (_resolve_user, _merge_env, _startup_env, ...): its extension API",
}
TESTS_REACH = 43  # the tests' own reaches, in total (``sb._container``, ``sb._rec``, ...): a named test helper instead


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


def _not_reaches(tree: ast.AST) -> set[int]:
    """The ``id`` of each attribute node of ``tree`` that the two tables of the module doc excuse."""
    imported = {(a.asname or a.name): f"{n.module}.{a.name}" for n in ast.walk(tree)
                if isinstance(n, ast.ImportFrom) and n.module for a in n.names}
    excused = {id(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
               and (n.value.id, n.attr) in DOCUMENTED_STDLIB}
    for cls in ast.walk(tree):
        if (isinstance(cls, ast.ClassDef) and cls.bases
                and all(isinstance(b, ast.Name) and imported.get(b.id) in OUTSIDE_BASES for b in cls.bases)):
            excused |= {id(n) for n in ast.walk(cls) if isinstance(n, ast.Attribute)
                        and isinstance(n.value, ast.Name) and n.value.id == "self"}
    return excused


def reaches(path: Path) -> list[str]:
    """The private attribute names ``path`` reads or writes that it does not itself define, one per use."""
    tree = ast.parse(path.read_text(), str(path))
    own, excused = _defined(tree), _not_reaches(tree)
    return [node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
            and node.attr not in own and id(node) not in excused]


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


def test_documented_stdlib_underscore_names_are_not_reaches_and_nothing_else_is(tmp_path):
    mod = tmp_path / "m.py"
    mod.write_text("import os, sys, subprocess, threading\n"
                   "def f(child, other):\n"
                   "    sys._getframe(1); os._exit(0)\n"  # documented: not reaches
                   "    subprocess._args_from_interpreter_flags(); threading._shutdown()\n"  # internals: reaches
                   "    other._exit(); child.os._exit()\n")  # the same name on something else: reaches
    assert sorted(reaches(mod)) == ["_args_from_interpreter_flags", "_exit", "_exit", "_shutdown"]


def test_a_subclass_of_an_outside_base_uses_its_protected_members_on_self_only(tmp_path):
    mod = tmp_path / "m.py"
    mod.write_text("from harbor.environments.base import BaseEnvironment\n"
                   "from elsewhere import Other\n"
                   "class Env(BaseEnvironment):\n"
                   "    def start(self, peer):\n"
                   "        return self._merge_env(), peer._merge_env()\n"  # the peer's is a reach
                   "class Mixed(BaseEnvironment, Other):\n"
                   "    def start(self):\n"
                   "        return self._resolve_user()\n"  # could come from Other: a reach
                   "class Plain(Other):\n"
                   "    def start(self):\n"
                   "        return self._startup_env()\n"  # not an outside base of the table: a reach
                   "def f(env):\n"
                   "    return env._mount_targets()\n")
    assert sorted(reaches(mod)) == ["_merge_env", "_mount_targets", "_resolve_user", "_startup_env"]


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
