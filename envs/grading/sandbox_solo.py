"""The isolated run inside the grading sandbox: FAIL_TO_PASS tests and canaries called without pytest's runner.

Part of the grader's guard program (``sandbox_guard.py``), written beside it into the grading folder and run
by it (``python guard.py CONFIG solo``) in the guard's private namespace. Standard library only, Python 3.8+.

The test module is imported as pytest would import it and each test that can be called plainly is called;
it passed when it returned. What can be called is chosen from the test file's *source* before any import,
so nothing at run time can make a test look ineligible: module-level functions and methods of pytest-style
classes without setup methods, without fixtures or decorators other than ``@pytest.mark.parametrize``, no
skip/xfail in their text; methods of ``unittest.TestCase`` classes (their own or inherited, run as unittest
runs them). A parametrized test is called with the parameter set whose pytest id is the one in its node id:
the decorator's expressions are evaluated again in the test module, and the ids derived as pytest derives
them (strings, numbers, ``None``, classes and functions by value, other objects by name and index). A set
whose id would come from the object itself (a ``__name__`` of its own, a ``str`` subclass), carries marks,
or shares its id with another is not called (``UNSUPPORTED``): a patch must not be able to choose which set
an id names.

The verdicts go to a file opened before the repository's code ran, with a secret read (and deleted) from the
grading folder before that: a result without the secret is not the runner's. Everything called once the
repository's code runs is bound before it (this namespace's own builtins, attributes read at load): a patch
can replace a module's attribute (``json.dumps``, ``importlib.import_module``) without an audit event, but
not what is already bound here.
"""

import ast
import json
import os
import sys
from ast import Expression
from contextlib import suppress
from importlib import import_module
from itertools import product
from os import _exit, write
from os.path import isfile
from os.path import join as join_path
from types import CodeType, FunctionType
from typing import Any

quote = json.encoder.encode_basestring_ascii   # the C function: what a patch can rebind in json is not used
SKIPPING = ("skip", "xfail", "fixture", "request", "monkeypatch")
UNPRINTABLE = {**{i: f"\\x{i:02x}" for i in range(128) if not 32 <= i < 127}, 9: "\\t", 10: "\\n", 13: "\\r"}


def _parametrize(dec):
    """(argnames, values expression, ids) of a ``@pytest.mark.parametrize(...)`` decorator; None for another."""
    f = dec.func if isinstance(dec, ast.Call) else None
    if not (isinstance(f, ast.Attribute) and f.attr == "parametrize" and isinstance(f.value, ast.Attribute)
            and f.value.attr == "mark" and isinstance(f.value.value, ast.Name) and f.value.value.id == "pytest"):
        return None
    if len(dec.args) != 2 or any(k.arg != "ids" for k in dec.keywords):
        return None
    try:
        names = ast.literal_eval(dec.args[0])
        ids = ast.literal_eval(dec.keywords[0].value) if dec.keywords else None
    except Exception:  # not a literal
        return None
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    if not (isinstance(names, (list, tuple)) and names and all(isinstance(n, str) for n in names)):
        return None
    if ids is not None and not (isinstance(ids, (list, tuple)) and all(i is None or isinstance(i, str) for i in ids)):
        return None
    return tuple(names), dec.args[1], ids


def plans(test_file, root, runner="pytest"):
    """Tests of ``test_file`` that can be called plainly, read from its source: node id (without parameters)
    -> (class or "", name, first line, kind, the class's own methods, parametrize decorators bottom first).

    ``runner="django"``: the methods of unittest classes are taken with no decorator at all, ``async`` ones too
    (Django's runner runs them), whatever their text says (they take no fixtures)."""
    with open(join_path(root, test_file), "rb") as f:
        source = f.read()
    tree = ast.parse(source)
    text = source.decode("utf-8", "replace").splitlines()
    out: dict = {}
    if any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
           for n in tree.body):
        return out

    def plain(fn, self_arg, kind=""):
        if kind == "unittest" and runner == "django":
            a = fn.args
            simple = not (a.posonlyargs or a.kwonlyargs or a.vararg or a.kwarg or a.defaults) and len(a.args) == 1
            return () if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and simple and not (
                fn.decorator_list) else None
        if not isinstance(fn, ast.FunctionDef):
            return None
        params = [_parametrize(d) for d in fn.decorator_list]
        a = fn.args
        if any(p is None for p in params) or a.posonlyargs or a.kwonlyargs or a.vararg or a.kwarg or a.defaults:
            return None
        wanted = [n for p in params for n in p[0]]
        names = [x.arg for x in a.args]
        if len(names) < self_arg or sorted(names[self_arg:]) != sorted(wanted) or len(set(wanted)) != len(wanted):
            return None
        body = "\n".join(text[fn.lineno - 1:fn.end_lineno])
        return None if any(w in body for w in SKIPPING) else tuple(reversed(params))

    def first_line(fn):
        return min([d.lineno for d in fn.decorator_list] + [fn.lineno])

    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            params = plain(node, 0)
            if params is not None:
                out[f"{test_file}::{node.name}"] = ("", node.name, first_line(node), "function", (), params)
        elif isinstance(node, ast.ClassDef) and (runner == "django" or not node.decorator_list) and not node.keywords:
            # (Django's class decorators, @override_settings and the like, act through setUpClass, which runs)
            methods = [m for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
            if not node.bases:  # a pytest-style class: only without setup methods
                if not node.name.startswith("Test") or any(m.name.startswith(("setup", "teardown", "__init__"))
                                                           for m in methods):
                    continue
                kind = "class"
            else:  # with bases: called only if it turns out to be a unittest.TestCase
                kind = "unittest"
            for m in methods:
                params = plain(m, 1, kind) if m.name.startswith("test") else None
                if params is not None and not (kind == "unittest" and params):
                    out[f"{test_file}::{node.name}::{m.name}"] = (node.name, m.name, first_line(m), kind, (), params)
            if kind == "unittest":  # a test it inherits (from a mixin): its function is checked at run time
                out[f"{test_file}::{node.name}::*"] = (node.name, "*", None, kind, tuple(m.name for m in methods), ())
    return out


def _escape(v):
    s = v.decode("ascii", "backslashreplace") if type(v) is bytes else v.encode("unicode_escape").decode("ascii")
    return s.translate(UNPRINTABLE)


def _idval(v, name, idx):
    """pytest's id for one value, or None where the object itself would choose it."""
    t = type(v)
    if t is str or t is bytes:
        return _escape(v)
    if v is None or t in (int, float, bool, complex):
        return str(v)
    if t is type or t is FunctionType:
        return v.__name__
    if t.__name__ == "Pattern" and t.__module__ == "re":
        return _escape(v.pattern) if type(v.pattern) in (str, bytes) else None
    with suppress(Exception):
        if isinstance(getattr(v, "__name__", None), str):  # named by itself: not called
            return None
    return f"{name}{idx}"


def _sets(names, values, ids, param_set):
    """(id or None, {argname: value}) for each parameter set of one decorator, as pytest ids them."""
    values = list(values)
    if ids is not None and len(ids) != len(values):
        return []
    out: list = []
    for idx, entry in enumerate(values):
        given = ids[idx] if ids is not None else None
        if type(entry) is param_set:
            if entry.marks or (entry.id is not None and type(entry.id) is not str):
                out.append((None, {}))
                continue
            given, entry = (entry.id if entry.id is not None else given), entry.values
        elif len(names) == 1:
            entry = (entry,)
        if type(entry) not in (tuple, list) or len(entry) != len(names):
            out.append((None, {}))
            continue
        parts = [_idval(v, n, idx) for n, v in zip(names, entry)]  # noqa: B905 (Python 3.8)
        pid = _escape(given) if given is not None else (None if None in parts else "-".join(parts))
        out.append((pid, dict(zip(names, entry))))  # noqa: B905
    counts: dict = {}
    for pid, _ in out:
        counts[pid] = counts.get(pid, 0) + 1
    return [(pid if counts[pid] == 1 else None, kw) for pid, kw in out]


def _arguments(params, module, cls, where, param_set):
    """{parameter id: arguments} of a parametrized test, the decorators' expressions evaluated again."""
    per = []
    for names, expr, ids in params:
        code = compile(Expression(expr), where, "eval")
        per.append(_sets(names, eval(code, module.__dict__, dict(vars(cls)) if cls is not None else None), ids,
                         param_set))
    out: dict = {}
    for combo in product(*per):
        if any(pid is None for pid, _ in combo):
            continue
        pid = "-".join(pid for pid, _ in combo)
        kwargs = {k: v for _, kw in combo for k, v in kw.items()}
        out[pid] = None if pid in out else kwargs
    return out


def _watched_state(runner_modules=()):
    """The test machinery a patch could blunt so that a test passes: the function and class attributes of
    ``builtins``, ``unittest`` and pytest's modules, and of their classes (identities, kept alive); with
    ``runner_modules`` (dotted prefixes: ``django.test``), the functions and classes of those modules and the
    callables of their classes instead (their other attributes change as their runner works)."""
    state: dict = {}
    for name, mod in list(sys.modules.items()):
        mine = any(name == p or name.startswith(p + ".") for p in runner_modules)
        if not mine and (runner_modules or not (name == "builtins" or name.split(".", 1)[0] in (
                "unittest", "pytest", "_pytest"))):
            continue
        d = vars(mod)
        for k, v in list(d.items()):
            if callable(v) or (name == "pytest" and not mine):
                state[(name, k, "")] = (d, v)
            if isinstance(v, type) and v.__module__ == name:
                for kk, vv in list(vars(v).items()):
                    if not mine or callable(vv) or isinstance(vv, (classmethod, staticmethod, property)):
                        state[(name, k, kk)] = (vars(v), vv)
    return state


def _changed(state):
    return [f"{name}.{k}" + (f".{kk}" if kk else "") for (name, k, kk), (d, v) in state.items()
            if d.get(kk or k) is not v]


def _defines(path, line, name):
    """The file at ``path`` has ``def name(`` at ``line`` (a test a class inherits, found at run time)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return False
    return 0 < line <= len(lines) and lines[line - 1].lstrip().startswith((f"def {name}(", f"async def {name}("))


def _module_for(test_file, root):
    """(folder to put first on sys.path, dotted module name), as pytest's default import mode finds them."""
    parts = test_file[:-3].split("/")
    base = len(parts) - 1
    while base > 0 and isfile(join_path(root, *parts[:base], "__init__.py")):
        base -= 1
    return join_path(root, *parts[:base]), ".".join(parts[base:])


def _call(tid, found, cfg, test_case, skip_test, param_set):
    """The verdict on one node id: PASSED, FAILED <exception>, ERROR <exception>, SKIPPED, MISMATCH, UNSUPPORTED."""
    root, patched = cfg["root"], cfg["patched"]
    test_file, _, rest = tid.partition("::")
    base, bracket, pid = rest.partition("[")
    plan = found[test_file].get(f"{test_file}::{base}") or found[test_file].get(
        f"{test_file}::{base.rsplit('::', 1)[0]}::*")
    if plan is None or bool(bracket) != bool(plan[5]) or (bracket and not pid.endswith("]")):
        return "UNSUPPORTED"
    cls_name, name, line, kind, own, params = plan
    name = base.rsplit("::", 1)[1] if name == "*" else name
    if name in own:  # defined in the class but not plainly (decorated, arguments): not called
        return "UNSUPPORTED"
    folder, dotted = _module_for(test_file, root)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    where = join_path(root, test_file)
    try:
        module = import_module(dotted)
        cls: Any = module.__dict__[cls_name] if cls_name else None
        if kind == "unittest" and not (issubclass(type(cls), type) and issubclass(cls, test_case)):
            return "UNSUPPORTED"
        holder = next((vars(k) for k in cls.__mro__ if name in vars(k)), {}) if cls else module.__dict__
        fn = holder[name]
        code = fn.__code__ if type(fn) is FunctionType else None
        kwargs = _arguments(params, module, cls, where, param_set).get(pid[:-1]) if bracket else {}
    except BaseException as e:  # the module would not import: as pytest reports it, an error
        return f"ERROR {type(e).__name__}"
    if type(code) is not CodeType or (line is not None and (code.co_filename, code.co_firstlineno) != (where, line)):
        return "MISMATCH"  # not the function the test file defines
    if line is None and (code.co_filename in patched or not code.co_filename.startswith(root + "/")):
        return "MISMATCH" if code.co_filename in patched else "UNSUPPORTED"
    if line is None and not _defines(code.co_filename, code.co_firstlineno, name):
        return "UNSUPPORTED"  # decorated, or not where it says: not called
    if kwargs is None:
        return "UNSUPPORTED"  # no parameter set has that id alone
    try:
        if kind == "unittest" and cfg.get("runner") == "django":
            call_django(cls, name)  # type: ignore[name-defined]  # noqa: F821 (runners.py's, loaded beside)
        elif kind == "unittest":
            cls.setUpClass()
            case = cls(name)
            case.setUp()
            try:
                fn(case)
            finally:
                case.tearDown()
                case.doCleanups()
                cls.tearDownClass()
        elif cls is not None:
            fn(cls(), **kwargs)
        else:
            fn(**kwargs)
        return "PASSED"
    except skip_test:
        return "SKIPPED"
    except BaseException as e:  # a skip or xfail raised from outside the test's text counts as a failure
        return f"FAILED {type(e).__name__}"


def solo(cfg, install):
    """Call ``cfg["solo"]``'s tests after ``install`` (the audit hook); write the verdicts and exit.

    ``cfg["runner"]``: ``pytest`` (node ids), or ``django`` / ``sympy``, whose ids are mapped to node ids from the
    test files' source first (``runners.py``'s ``resolve``); Django is set up as its runner sets it up before the
    tests are called (``django_environment``), and the functions of its ``django.test`` modules are watched too."""
    key_path = join_path(cfg["folder"], "solo.key")
    with open(key_path) as f:
        secret = f.read().strip()
    os.unlink(key_path)
    out = os.open(join_path(cfg["folder"], "solo.json"),
                  os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o600)
    runner = cfg.get("runner", "pytest")
    nodes = {t: t for t in cfg["solo"]} if runner == "pytest" else resolve(cfg)  # type: ignore[name-defined]  # noqa: F821
    found: dict = {}
    uses_pytest = False
    for tid in cfg["solo"]:
        test_file = nodes[tid].split("::", 1)[0]
        if not test_file or test_file in found:
            continue
        try:
            found[test_file] = plans(test_file, cfg["root"], runner)
            with open(join_path(cfg["root"], test_file), encoding="utf-8", errors="replace") as f:
                uses_pytest = uses_pytest or (runner == "pytest" and "pytest" in f.read())
        except (OSError, SyntaxError, ValueError):
            found[test_file] = {}
    import unittest

    param_set: Any = None
    if uses_pytest:  # imported before the repository's code, so that the state watched is pytest's own
        with suppress(ImportError):
            from _pytest.mark.structures import ParameterSet as param_set
    watched = _watched_state()
    test_case, skip_test = unittest.TestCase, unittest.SkipTest
    os.environ.update(cfg.get("env", {}))
    install(cfg)
    os.chdir(cfg["root"])
    results = {}
    teardown: Any = None
    if runner == "django":
        try:
            teardown = django_environment(cfg)  # type: ignore[name-defined]  # noqa: F821 (runners.py's)
        except BaseException as e:  # as Django's runner reports it: every test errors
            results = {tid: f"ERROR {type(e).__name__}" for tid in cfg["solo"]}
        watched.update(_watched_state(("django.test",)))
    for tid in cfg["solo"]:
        if tid in results:
            continue
        if not nodes[tid]:
            results[tid] = "UNSUPPORTED"
            continue
        results[tid] = verdict = _call(nodes[tid], found, cfg, test_case, skip_test, param_set)
        blunted = _changed(watched) if verdict.startswith(("PASSED", "FAILED", "SKIPPED")) else []
        if blunted:
            results[tid] = "MISMATCH " + ",".join(blunted[:3])
    if teardown is not None:
        with suppress(BaseException):
            teardown()
    body = ", ".join(quote(k) + ": " + quote(v) for k, v in results.items())
    write(out, ('{"secret": ' + quote(secret) + ', "results": {' + body + "}}").encode())
    _exit(0)
