"""The layout's rules, read from the source: no import circle between modules, and the packages' one-way order.

Every ``import`` is counted, at module level, inside functions and under ``TYPE_CHECKING`` alike: a circle that
only type checking or a late import keeps apart is still two modules that cannot be read one after the other.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("agentenv", "envs", "policy", "rollout", "trainer")
# what each package may import of the others (docs/architecture.md §1: the sandbox library and the policy stand alone)
MAY_IMPORT = {"agentenv": set(), "policy": set(), "envs": {"agentenv"}, "rollout": {"agentenv", "envs", "policy"},
              "trainer": {"agentenv", "envs", "policy", "rollout"}}
# the modules of another package that a package outside the order may import, because each is a leaf (standard
# library only): K3's chat and tool-call format, the contract between the policy and the envs' text actions; and the
# budget of failed authentication that the env server and the policy server share (one implementation of a security
# check, kept in policy because importing it there starts nothing else, where agentenv's import starts its sandboxes)
SHARED_LEAVES = {"policy.chat": {"envs"}, "policy.tool_calls": {"envs"}, "policy.pieces": {"envs"},
                 "policy.authlimit": {"agentenv"}}
# inside agentenv, each room imports only the rooms below it (and the contract at the top: api, errors, config, ...)
CONTRACT = {"agentenv", "agentenv.api", "agentenv.values", "agentenv.errors", "agentenv.config", "agentenv.phases",
            "agentenv.netpolicy", "agentenv.wire"}
ROOMS = {"agentenv.inside": set(), "agentenv.host": {"agentenv.inside"},
         # dump, restore, lazy pages, post-copy, the store, export and import: below the sandbox, which calls it
         "agentenv.snapshot": {"agentenv.inside", "agentenv.host"},
         "agentenv.sandbox": {"agentenv.inside", "agentenv.host", "agentenv.snapshot"},
         "agentenv.remote": set(),  # a client of servers: no host stack (test_light_import.py)
         # sandbox providers for agent harnesses: above the sandbox and its remote API, which they use
         "agentenv.harness": {"agentenv.remote", "agentenv.sandbox", "agentenv.snapshot", "agentenv.inside",
                              "agentenv.host"}}


def modules(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    out = {}
    for pkg in packages:
        for p in sorted((root / pkg).rglob("*.py")):
            name = ".".join(p.relative_to(root).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = p
    return out


def imports(mods: Mapping[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports (``from pkg import name`` counts ``pkg.name`` when a module)."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    graph[name].add(t)
    return graph


def circles(graph: Mapping[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(frozenset(comp))
    return found


GRAPH = imports(modules(ROOT, PACKAGES))


def test_no_import_circle_between_modules():
    assert [sorted(c) for c in circles(GRAPH)] == []


def test_the_packages_import_one_way():
    wrong = sorted((m, t) for m, ts in GRAPH.items() for t in ts
                   if t.split(".")[0] != m.split(".")[0] and t.split(".")[0] not in MAY_IMPORT[m.split(".")[0]])
    assert [(m, t) for m, t in wrong if m.split(".")[0] not in SHARED_LEAVES.get(t, set())] == []


def test_a_shared_leaf_imports_nothing_of_the_project():
    """``policy.chat`` (with the tool-call section and the pieces it renders to) and ``policy.authlimit`` are read by
    other packages too, so they stand on the standard library and each other alone."""
    for leaf in SHARED_LEAVES:
        assert GRAPH[leaf] <= set(SHARED_LEAVES), f"{leaf} imports {sorted(GRAPH[leaf] - set(SHARED_LEAVES))}"


def test_an_added_circle_is_found_at_any_depth(tmp_path):
    """The checker itself: a circle through a function-level and a TYPE_CHECKING import, three modules long."""
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from p.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import g\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import p.a\ndef g(): pass\n")
    (pkg / "d.py").write_text("from p import c\n")
    graph = imports(modules(tmp_path, ["p"]))
    assert circles(graph) == [frozenset({"p.a", "p.sub.b", "p.c"})]
    (pkg / "c.py").write_text("def g(): pass\n")
    assert circles(imports(modules(tmp_path, ["p"]))) == []


def room(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_each_room_of_agentenv_imports_only_the_rooms_below_it():
    wrong = sorted((m, t) for m, ts in GRAPH.items() if room(m) in ROOMS for t in ts
                   if t.startswith("agentenv") and room(t) != room(m) and room(t) not in ROOMS[room(m)]
                   and t not in CONTRACT)
    assert wrong == []



# the snapshot room's layers, bottom up (agentenv/snapshot/__init__.py): each imports only its own and those below
SNAPSHOT_LAYERS = (("criu", "restore", "criu_images"), ("page_channel", "postcopy", "lazy_pages"), ("container",),
                   ("store",), ("trust", "tarcheck", "unpack", "imported", "transfer", "shared"))


def test_the_snapshot_rooms_layers_import_downwards():
    level = {f"agentenv.snapshot.{m}": i for i, layer in enumerate(SNAPSHOT_LAYERS) for m in layer}
    room_modules = {m for m in GRAPH if m.startswith("agentenv.snapshot.")}
    assert room_modules == set(level), "a module of agentenv/snapshot/ missing from SNAPSHOT_LAYERS, or one gone"
    wrong = sorted((m, t) for m in room_modules for t in GRAPH[m] if t in level and level[t] > level[m])
    assert wrong == []

# a server's client stands apart from the host: the remote API and the wire format its bodies travel in import neither
# the sandbox nor the host room (remote's entry in ROOMS allows neither), so ``agentenv.connect`` loads none of them
# (``test_light_import.py``); a server pulling a snapshot from another (``agentenv.server.pull``) lives on the server
HOSTLESS = ("agentenv.remote", "agentenv.wire")


def test_the_remote_api_and_the_wire_import_neither_the_sandbox_nor_the_host():
    wrong = sorted((m, t) for m, ts in GRAPH.items() if room(m) in HOSTLESS for t in ts
                   if room(t) in ("agentenv.sandbox", "agentenv.snapshot", "agentenv.host"))
    assert wrong == []
    assert not ROOMS["agentenv.remote"] & {"agentenv.sandbox", "agentenv.snapshot", "agentenv.host"}
    assert GRAPH["agentenv.wire"] <= CONTRACT, "the wire format is the contract's: it stands on the contract alone"


def test_what_runs_inside_a_sandbox_imports_the_standard_library_only():
    """Apart from each other (the keeper's parts, which the host joins into one: ``keeper_start``)."""
    import sys

    for name, path in modules(ROOT, ["agentenv"]).items():
        if room(name) != "agentenv.inside":
            continue
        tops = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                tops |= {a.name.split(".")[0] for a in node.names}
            elif (isinstance(node, ast.ImportFrom) and not node.level and node.module
                  and (room(node.module) != "agentenv.inside" or node.module == "agentenv.inside")):
                tops.add(node.module.split(".")[0])
        assert tops - set(sys.stdlib_module_names) - {"__future__"} == set(), (name, tops)


def test_agentenv_keeps_few_modules_at_its_top():
    top = [p.name for p in (ROOT / "agentenv").glob("*.py")]
    assert len(top) <= 10, sorted(top)


# inside trainer, by concern (docs/architecture.md §1): the training maths, where the training runs, the RL loop;
# each imports only the ones before it (the modules at trainer's top, shared by the SFT run and the loop, are free)
TRAINER_ROOMS = {"trainer.algorithm": set(), "trainer.distributed": {"trainer.algorithm"},
                 "trainer.loop": {"trainer.algorithm", "trainer.distributed"}}


def test_the_trainer_s_sub_packages_import_in_order():
    wrong = sorted((m, t) for m, ts in GRAPH.items() if room(m) in TRAINER_ROOMS for t in ts
                   if room(t) in TRAINER_ROOMS and room(t) != room(m) and room(t) not in TRAINER_ROOMS[room(m)])
    assert wrong == []
    assert all(room(m) in TRAINER_ROOMS for m in GRAPH if m.startswith("trainer.") and m.count(".") > 1
               and room(m) != "trainer.viewer"), "a new sub-package of trainer: give it its place above"


# the LLM gateway (rollout/gateway/, docs/architecture.md §1): an HTTP and token layer over the policy's format; of
# rollout it imports only the trajectory record it exports, and nothing of the sandboxes or the envs, so it serves a
# harness on the host, in a sandbox or on another machine alike
GATEWAY_MAY_IMPORT = ("rollout.gateway", "rollout.trajectory", "policy.chat", "policy.tool_calls", "policy.pieces",
                      "policy.client", "policy.tokenizer",
                      "agentenv.config")


def test_the_gateway_imports_only_the_format_and_the_record():
    wrong = sorted((m, t) for m, ts in GRAPH.items() if m.startswith("rollout.gateway") for t in ts
                   if not t.startswith(GATEWAY_MAY_IMPORT))
    assert wrong == []
    assert any(m.startswith("rollout.gateway.") for m in GRAPH), "the gateway moved: give it its place again"
