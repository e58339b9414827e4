"""The guard's modes for test runners other than pytest, inside the grading sandbox: unittest runners (Django's
``tests/runtests.py``) and SymPy's ``bin/test``; and what the isolated run needs of them.

Part of the grader's guard program (``sandbox_guard.py``), written beside it into the grading folder and run by it
in the guard's private namespace (it uses ``solo.py``'s ``_watched_state`` / ``_changed``, loaded beside it).
Standard library only, Python 3.8+.

``python guard.py CONFIG unittest SCRIPT ARGS...`` and ``python guard.py CONFIG sympy SCRIPT ARGS...`` run the
runner's own program (``runpy.run_path``, as ``python SCRIPT ARGS`` would: its folder first on ``sys.path``), so it
prints its own log, the one the dataset's official parser reads. Before it starts — after the audit hook — the guard
puts a recorder where the runner reports each outcome, and the statuses come from there, not from the text:

- ``unittest``: the outcome methods of ``unittest.TestResult`` (every result class of a unittest runner calls them,
  Django's too), keyed as the runner prints the test: the docstring's first line when it has one, else ``str(test)``
  (``test_x (module.Class.test_x)`` under Python 3.11) — the key SWE-bench's ``parse_log_django`` reads from the
  `` ... ok`` line — and also by ``test.id()`` (``module.Class.test_x``, what the canaries are named by). A failing
  subtest fails its test;
- ``sympy``: the reporter of SymPy's runner (``sympy.testing.runtests.PyTestReporter``: ``test_pass``,
  ``test_fail``, ``test_exception``, ``test_skip``, ``test_xfail``, ``test_xpass``), wrapped when that module is
  first imported (a ``sys.meta_path`` entry: importing SymPy earlier would read ``SYMPY_USE_CACHE`` before the
  runner's ``-C`` sets it), keyed by the test function's name, as ``parse_log_sympy`` reads ``test_x ok``. SymPy's
  runner starts a second interpreter unless ``PYTHONHASHSEED`` is set: the guard sets a random one before it seals
  and restarts itself, so the tests run in the guarded process.

Once the runner returns, the guard writes ``results.json`` into the grading folder, opened only then (the audit hook
refuses the folder to the patch's code while the tests run): ``{"results": {key: status}, "ids": {test id:
status}, "recorded": bool, "blunted": [...], "exit": code}``; ``blunted`` lists the functions of ``unittest`` (and
pytest's modules, builtins) replaced while the tests ran. It exits with the runner's own exit status.

For the isolated run (``solo.py``), ``resolve`` maps a dataset's test ids to node ids from the test files' source
(before any repository code runs): Django's ``test_x (module.Class.test_x)``, ``test_x (module.Class)`` or a
docstring's first line (among the test modules the command names), and ``module.Class.test_x`` (a canary); SymPy's
function names (among the test files the command names). ``django_environment`` prepares Django as the runner does
(``runtests.py``'s own setup for the modules the command names, the test databases), and ``call_django`` runs one
test as Django's ``debug()`` does — its own setup and teardown, async tests run, nothing caught — so the verdict is
this program's control flow, not a result object's.
"""

import ast
import json
import os
import sys
from contextlib import suppress
from os.path import join as join_path

RESULTS_FILE = "results.json"
_RANK = {"PASSED": 0, "XFAIL": 1, "SKIPPED": 2, "XPASS": 3, "ERROR": 4, "FAILED": 5}
_quote = json.encoder.encode_basestring_ascii


def _keep(table, key, status):
    old = table.get(key)
    if old is None or _RANK[status] > _RANK[old]:
        table[key] = status


def _unittest_recorder(results, ids):
    """Wrap ``unittest.TestResult``'s outcome methods to record each outcome (see the module doc)."""
    import unittest.case
    from unittest.result import TestResult

    TestCase, sub_test = unittest.case.TestCase, vars(unittest.case)["_SubTest"]

    describe, to_str = TestCase.shortDescription, str

    def keys(test):
        if isinstance(test, sub_test):
            test = test.test_case
        doc = describe(test) if isinstance(test, TestCase) else None
        tid = test.id() if isinstance(test, TestCase) else ""
        return (doc or to_str(test)), tid

    def record(test, status):
        key, tid = keys(test)
        _keep(results, key, status)
        if tid:
            _keep(ids, tid, status)

    def wrap(name, status):
        original = TestResult.__dict__[name]

        def outcome(self, test, *rest):
            record(test, status)
            return original(self, test, *rest)
        setattr(TestResult, name, outcome)

    for name, status in (("addSuccess", "PASSED"), ("addFailure", "FAILED"), ("addError", "ERROR"),
                         ("addSkip", "SKIPPED"), ("addExpectedFailure", "XFAIL"),
                         ("addUnexpectedSuccess", "XPASS")):
        wrap(name, status)
    sub = TestResult.__dict__["addSubTest"]

    def add_sub_test(self, test, subtest, err):
        if err is not None:
            record(test, "FAILED" if issubclass(err[0], test.failureException) else "ERROR")
        return sub(self, test, subtest, err)
    setattr(TestResult, "addSubTest", add_sub_test)  # noqa: B010 (a method: mypy refuses the plain assignment)


class _AfterImport:
    """A ``sys.meta_path`` entry that calls ``then(module)`` once the module ``name`` has run, the first time."""

    def __init__(self, name, then):
        self.name, self.then = name, then

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        if spec is None or spec.loader is None:
            return None
        loader, then = spec.loader, self.then

        class Loader:
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                then(module)
        spec.loader = Loader()  # type: ignore[assignment]  # a loader by protocol
        return spec


def _sympy_recorder(results, ids, state):
    """Wrap SymPy's reporter when ``sympy.testing.runtests`` is first imported (see the module doc)."""

    def then(module):
        reporter = module.PyTestReporter
        entering = reporter.__dict__["entering_test"]

        def entering_test(self, f):
            ids["."] = getattr(f, "__name__", "?")  # the current test, reported by the next outcome
            return entering(self, f)
        setattr(reporter, "entering_test", entering_test)  # noqa: B010

        def wrap(name, status):
            original = reporter.__dict__[name]

            def outcome(self, *args):
                _keep(results, ids.get(".", "?"), status)
                return original(self, *args)
            setattr(reporter, name, outcome)

        for name, status in (("test_pass", "PASSED"), ("test_fail", "FAILED"), ("test_exception", "ERROR"),
                             ("test_skip", "SKIPPED"), ("test_xfail", "XFAIL"), ("test_xpass", "XPASS")):
            wrap(name, status)
        import_error = reporter.__dict__["import_error"]

        def failed_import(self, filename, exc_info):
            _keep(results, os.path.relpath(filename, state["root"]), "ERROR")
            return import_error(self, filename, exc_info)
        setattr(reporter, "import_error", failed_import)  # noqa: B010
        state["recorded"] = True

    sys.meta_path.insert(0, _AfterImport("sympy.testing.runtests", then))


def run_runner(cfg, mode, rest, install):
    """Run the runner's program (``rest``: the script and its arguments) under the guard, record, write, exit."""
    import runpy
    import traceback

    results: dict = {}
    ids: dict = {}
    state = {"root": cfg["root"], "recorded": mode == "unittest"}
    out_flush, err_flush = sys.stdout.flush, sys.stderr.flush
    open_, write, exit_, o_flags = os.open, os.write, os._exit, os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    folder = cfg["folder"]
    install(cfg)
    if mode == "unittest":
        _unittest_recorder(results, ids)
    else:
        _sympy_recorder(results, ids, state)
    watched = _watched_state()  # type: ignore[name-defined]  # noqa: F821 (solo.py's, loaded beside)
    script = os.path.abspath(rest[0])
    sys.argv = [rest[0], *rest[1:]]
    sys.path[0] = os.path.dirname(script)
    code = 1
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    blunted = _changed(watched)  # type: ignore[name-defined]  # noqa: F821
    ids.pop(".", None)
    for flush in (out_flush, err_flush):
        with suppress(Exception):  # a closed stream: nothing to flush
            flush()
    body = ", ".join(_quote(k) + ": " + _quote(v) for k, v in results.items())
    by_id = ", ".join(_quote(k) + ": " + _quote(v) for k, v in ids.items())
    doc = ('{"results": {' + body + '}, "ids": {' + by_id + '}, "recorded": ' + ("true" if state["recorded"]
           else "false") + ', "blunted": [' + ", ".join(_quote(b) for b in blunted[:20]) + '], "exit": '
           + str(int(code) & 0xFF) + "}")
    fd = open_(join_path(folder, RESULTS_FILE), o_flags, 0o600)
    write(fd, doc.encode())
    exit_(int(code) & 0xFF)


# --- the isolated run's part ------------------------------------------------------------------------------------


def _django_keys(test_file, module):
    """Every id Django's runner can give the plain test methods of ``test_file`` -> (class, method, first line)."""
    with open(test_file, "rb") as f:
        tree = ast.parse(f.read())
    out: dict = {}
    docs: dict = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef) or not node.bases:
            continue
        for m in node.body:
            if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and m.name.startswith("test"):
                where = (node.name, m.name, min([d.lineno for d in m.decorator_list] + [m.lineno]))
                for key in (f"{m.name} ({module}.{node.name}.{m.name})", f"{m.name} ({module}.{node.name})",
                            f"{module}.{node.name}.{m.name}"):
                    out[key] = where
                doc = ast.get_docstring(m)
                if doc and doc.strip():
                    first = doc.strip().split("\n")[0].strip()
                    docs[first] = None if first in docs else where  # two tests, one docstring: not resolved
    for first, where in docs.items():
        out.setdefault(first, where)
    return out


def resolve(cfg):
    """Dataset test id -> node id (``file::Class::name``, ``file::name``; "" when it cannot be resolved)."""
    root, runner = cfg["root"], cfg.get("runner", "pytest")
    out = {}
    if runner == "django":
        table: dict = {}
        for label in cfg.get("labels", []):
            test_file = "tests/" + label.replace(".", "/") + ".py"
            try:
                for key, where in _django_keys(join_path(root, test_file), label).items():
                    table.setdefault(key, (test_file, where))
            except (OSError, SyntaxError, ValueError):
                continue
        for tid in cfg["solo"]:
            hit = table.get(tid)
            out[tid] = f"{hit[0]}::{hit[1][0]}::{hit[1][1]}" if hit and hit[1] else ""
        return out
    for tid in cfg["solo"]:  # sympy: a function name, defined at module level in one of the command's files
        out[tid] = ""
        for test_file in cfg.get("test_files", []):
            try:
                with open(join_path(root, test_file), "rb") as f:
                    tree = ast.parse(f.read())
            except (OSError, SyntaxError, ValueError):
                continue
            if any(isinstance(n, ast.FunctionDef) and n.name == tid for n in tree.body):
                out[tid] = f"{test_file}::{tid}"
                break
    return out


def django_environment(cfg):
    """Django set up as its runner sets it up for the command's test modules; returns the teardown."""
    tests = join_path(cfg["root"], "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    os.environ["DJANGO_SETTINGS_MODULE"] = cfg.get("settings") or "test_sqlite"
    from importlib import import_module

    runtests = import_module("runtests")
    labels = list(cfg.get("labels", []))
    if hasattr(runtests, "setup_run_tests"):
        runtests.setup_run_tests(0, None, None, labels)
    else:
        runtests.setup(0, labels, 1, None, None)
    from django.test.runner import DiscoverRunner

    runner = DiscoverRunner(verbosity=0, interactive=False)
    runner.setup_test_environment()
    old = runner.setup_databases()

    def teardown():
        runner.teardown_databases(old)
        runner.teardown_test_environment()
    return teardown


def call_django(cls, name):
    """One test as Django's runner runs it, with nothing caught (``SimpleTestCase.debug``), its class set up and
    torn down around it; for a plain ``unittest.TestCase``, ``TestCase.debug`` likewise."""
    cls.setUpClass()
    try:
        case = cls(name)
        try:
            case.debug()
        except BaseException:
            post = getattr(case, "_post_teardown", None)  # debug() skips it when the test raises
            if post is not None:
                with suppress(Exception):  # the test's own failure is what is reported
                    post()
            raise
    finally:
        cls.tearDownClass()
