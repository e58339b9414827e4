"""The hardened channels of runners other than pytest (issue 41, item 5): Django's ``tests/runtests.py`` (any
unittest runner) and SymPy's ``bin/test``.

The guard's ``unittest`` and ``sympy`` modes are run here for real, with this interpreter, on small repositories in
a temporary folder: a unittest program standing for Django's runner, and a ``sympy.testing.runtests`` with the
reporter methods SymPy's has (the integration tests run the real ones in their images:
``tests/integration/envs/test_envs_runner_attacks.py``).
"""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

from envs.grading import audit, canary, channels
from envs.grading.command import parse_test_command, run_script
from envs.grading.patch import filter_patch
from envs.task import Task

DJANGO = "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1 humanize_tests.tests signals.tests"
SYMPY = "PYTHONWARNINGS='ignore::UserWarning,ignore::SyntaxWarning' bin/test -C --verbose sympy/core/tests/test_a.py"


def task(repo: str = "django/django", f2p: tuple[str, ...] = ("test_x (app.tests.T.test_x)",)) -> Task:
    return Task("i", repo, "HEAD", "", "", "p", f2p, (), "img", "true")


def test_the_runners_commands_are_read_as_channels_the_guard_starts_in_their_own_modes():
    inv = parse_test_command(DJANGO)
    assert inv.channel is not None and inv.channel.kind == "django" and inv.channel.mode == "unittest"
    assert inv.interpreter == "python" and inv.args is not None and inv.args[0] == "tests/runtests.py"
    assert inv.channel.labels == ["humanize_tests.tests", "signals.tests"] and inv.channel.settings == "test_sqlite"
    assert inv.channel.test_files == ["tests/humanize_tests/tests.py", "tests/signals/tests.py"]
    script = run_script(task(), inv, "/venv/bin/python", "/g", solo=True)
    assert "/venv/bin/python /g/guard.py /g/guard.json unittest tests/runtests.py --verbosity 2" in script
    assert "junit" not in script and "/g/guard.json solo" in script
    sym = parse_test_command(SYMPY)
    assert sym.channel is not None and sym.channel.mode == "sympy" and sym.assignments[0].startswith("PYTHONWARNINGS=")
    assert sym.channel.test_files == ["sympy/core/tests/test_a.py"]
    assert sym.channel.solo_config()["env"] == {"SYMPY_USE_CACHE": "no"}
    assert parse_test_command("python tests/runtests.py x.tests").channel is not None
    assert parse_test_command("pytest -rA tests/test_x.py").channel is None
    assert parse_test_command("./runtests.sh").args is None


def test_canaries_go_in_the_file_of_the_first_fail_to_pass_test_named_as_the_recorder_names_them():
    ch = parse_test_command(DJANGO).channel
    assert ch is not None
    assert ch.canary_file(task(f2p=("test_x (signals.tests.T.test_x)",))) == "tests/signals/tests.py"
    assert ch.canary_file(task(f2p=("A docstring's first line.",))) == "tests/humanize_tests/tests.py"
    source = UNITTEST_TESTS
    text, ids = ch.canaries(source, task(f2p=("test_x (signals.tests.Checks.test_sum)",)), "tests/signals/tests.py",
                            rng=random.Random(3))
    assert ids and all(i.startswith("signals.tests.Checks.test_") for i in ids) and text != source


UNITTEST_TESTS = textwrap.dedent('''\
    import unittest

    from lib import f


    class Checks(unittest.TestCase):
        def test_sum(self):
            """Adds one."""
            self.assertEqual(f(1), 2)

        def test_in(self):
            with self.subTest(v=1):
                self.assertIn(f(1), [2, 3])

        def test_branch(self):
            if f(0):
                self.assertTrue(f(0))

        def test_subtests(self):
            for v in (1, 2):
                with self.subTest(v=v):
                    self.assertEqual(f(v), v + 1)
''')


def test_method_canaries_copy_a_tests_method_with_the_opposite_first_assertion_and_always_fail(tmp_path):
    made = canary.derive_methods(UNITTEST_TESTS, prefer_class="Checks", count=5, rng=random.Random(1))
    assert made is not None and {c for c, _ in made.methods} == {"Checks"}
    copied = {name.rsplit("_", 1)[0] for _, name in made.methods}
    assert copied == {"test_sum", "test_in"}  # test_branch's assertion may not run; test_subtests' is in a loop
    assert "self.assertNotEqual(f(1), 2)" in made.source and "self.assertNotIn(f(1), [2, 3])" in made.source
    assert made.source.count('"""Adds one."""') == 1  # a copy keeps no docstring: the runner would name it by it
    for right in (True, False):  # whatever the code under test does, every canary fails; the originals do not
        (tmp_path / "lib.py").write_text("def f(x):\n    return x + 1\n" if right else "def f(x):\n    return x\n")
        (tmp_path / "test_c.py").write_text(made.source)
        r = subprocess.run([sys.executable, "-m", "unittest", "-v", "test_c"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=60, check=False)
        for _, name in made.methods:
            assert f"FAIL: {name} (test_c.Checks.{name})" in r.stderr, r.stderr  # itself, or its subtest
        if right:
            assert "test_sum (test_c.Checks.test_sum)\nAdds one. ... ok" in r.stderr, r.stderr
    assert canary.derive_methods("def test_x():\n    assert 1\n") is None
    plain = canary.plain_method("import unittest\n\n\nclass K(unittest.TestCase):\n    def test_a(self):\n"
                                "        pass\n\n\nx = 1\n", "", "test_k")
    assert plain is not None and plain.methods == (("K", "test_k"),)
    (tmp_path / "test_k.py").write_text(plain.source)
    r = subprocess.run([sys.executable, "-m", "unittest", "-v", "test_k"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60, check=False)
    assert "test_k (test_k.K.test_k) ... FAIL" in r.stderr and "test_a (test_k.K.test_a) ... ok" in r.stderr


def test_a_runners_own_files_and_its_test_suite_are_not_graded_and_the_runner_rewrite_is_tampering():
    tests, runner = channels.protected(task())
    patch = b"".join(section(p) for p in ("tests/runtests.py", "django/test/runner.py", "tests/signals/tests.py",
                                          "sitecustomize.py", "tests/sitecustomize.py", "django/utils/text.py"))
    got = filter_patch(patch, runner_files=runner, test_patterns=tests)
    reasons = {d.path: d.reason for d in got.dropped}
    assert reasons == {"tests/runtests.py": "test-config", "django/test/runner.py": "test-config",
                       "tests/signals/tests.py": "test", "sitecustomize.py": "startup-hook",
                       "tests/sitecustomize.py": "startup-hook"} and got.tampering
    assert [c.path for c in got.changes] == ["django/utils/text.py"]
    gold = filter_patch(section("django/test/runner.py"), runner_files=runner, test_patterns=tests,
                        exempt_paths={"django/test/runner.py"})
    assert not gold.dropped  # a real fix of Django's test runner stays gradable for its own task
    s_tests, s_runner = channels.protected(task("sympy/sympy"))
    sym = filter_patch(section("bin/test") + section("sympy/testing/runtests.py") + section(
        "sympy/core/tests/test_basic.py"), runner_files=s_runner, test_patterns=s_tests)
    assert {d.path: d.reason for d in sym.dropped} == {"bin/test": "test-config", "sympy/testing/runtests.py":
                                                       "test-config", "sympy/core/tests/test_basic.py": "test"}
    assert channels.protected(task("psf/requests")) == ((), ())


def section(path: str) -> bytes:
    return (f"diff --git a/{path} b/{path}\nindex 1..2 100644\n--- a/{path}\n+++ b/{path}\n@@ -1 +1 @@\n-a\n+b\n"
            ).encode()


def test_pytest_ids_are_named_as_the_datasets_parser_names_them():
    key = channels.dataset_key
    assert key("parse_log_pytest", "t.py::test_p[a b]") == "t.py::test_p[a"
    assert key("parse_log_requests", "t.py::test_z[/testbed/src/pkg/__init__.py]") == "t.py::test_z[/__init__.py]"
    assert key("parse_log_requests", "t.py::test_z[//x/y]") == "t.py::test_z[//x/y]"
    assert key("parse_log_pytest_v2", "t.py::test_p[a b]") == "t.py::test_p[a b]"
    assert key("parse_log_matplotlib", "t.py::test_b[MouseButton.LEFT]") == "t.py::test_b[1]"
    got = channels.dataset_statuses("parse_log_pytest", {"t.py::a[x y]": "PASSED", "t.py::a[x z]": "FAILED"})
    assert got["t.py::a[x"] == "FAILED" and got["t.py::a[x y]"] == "PASSED"


def test_the_recorders_file_is_read_and_refused_when_it_is_not_the_recorders():
    good = json.dumps({"results": {"k": "PASSED"}, "ids": {"a.B.k": "PASSED"}, "recorded": True,
                       "blunted": ["unittest.case.TestCase.run"], "exit": 0}).encode()
    r = channels.read_results(good)
    assert r.statuses == {"k": "PASSED"} and r.ids == {"a.B.k": "PASSED"} and r.recorded and r.blunted
    for bad in (b"", b"not json", b"[]", b'{"results": []}'):
        assert channels.read_results(bad).problem


# --- the guard's modes, for real -------------------------------------------------------------------------------


RUNNER = textwrap.dedent("""\
    import sys
    import unittest

    sys.exit(not unittest.main(module=None, argv=["run", *sys.argv[1:]], verbosity=2, exit=False).result
             .wasSuccessful())
""")


def guard_repo(tmp_path: Path, lib: str, added: list[int] | None, files: dict[str, str],
               extra: dict[str, object] | None = None) -> tuple[Path, Path]:
    root, folder = tmp_path / "repo", tmp_path / "grade"
    folder.mkdir(parents=True)
    for rel, source in {"lib.py": lib, **files}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(source)
    cfg = {"log": str(folder / "audit.log"), "folder": str(folder), "root": str(root),
           "patched": {str(root / "lib.py"): added}, "modules": ["lib"], "paths": [str(folder), "/proc/"],
           "solo": [], **(extra or {})}
    (folder / "guard.json").write_text(json.dumps(cfg))
    for name, program in audit.guard_files().items():
        (folder / name).write_bytes(program)
    return root, folder


def run_guard(root: Path, folder: Path, *mode: str, env: dict[str, str] | None = None) -> tuple[
        subprocess.CompletedProcess[str], channels.Results]:
    r = subprocess.run([sys.executable, str(folder / "guard.py"), str(folder / "guard.json"), *mode], cwd=root,
                       env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", **(env or {})}, capture_output=True,
                       text=True, timeout=120, check=False)
    path = folder / channels.RESULTS_FILE
    return r, channels.read_results(path.read_bytes() if path.exists() else b"")


def test_unittest_mode_records_outcomes_as_the_runner_names_tests_and_a_forged_ok_line_changes_nothing(tmp_path):
    forge = ("import sys\n"
             "def f(x):\n"
             "    sys.stderr.write('\\ntest_subtests (app.tests.Checks.test_subtests) ... ok\\n')\n"
             "    return x + (1 if x == 1 else 0)\n")
    root, folder = guard_repo(tmp_path, forge, [3], {"app/__init__.py": "", "app/tests.py": UNITTEST_TESTS,
                                                      "run.py": RUNNER})
    r, got = run_guard(root, folder, "unittest", "run.py", "app.tests")
    assert "test_subtests (app.tests.Checks.test_subtests) ... ok" in r.stderr  # what a text parser would believe
    assert got.recorded and not got.problem and got.exit == r.returncode == 1, r.stderr
    assert got.statuses == {"Adds one.": "PASSED", "test_in (app.tests.Checks.test_in)": "PASSED",
                            "test_branch (app.tests.Checks.test_branch)": "PASSED",
                            "test_subtests (app.tests.Checks.test_subtests)": "FAILED"}  # a failing subtest fails it
    assert got.ids["app.tests.Checks.test_sum"] == "PASSED" and not got.blunted


def test_unittest_mode_sees_the_patch_rewrite_the_result_class(tmp_path):
    # Python audits no ordinary class attribute write: the rewrite goes through, and the recorder reports it
    lib = ("import unittest.result as _r\n"
           "_r.TestResult.addFailure = lambda self, test, err: _r.TestResult.addSuccess(self, test)\n"
           "def f(x):\n    return x\n")
    root, folder = guard_repo(tmp_path, lib, [1, 2], {"app/__init__.py": "", "app/tests.py": UNITTEST_TESTS,
                                                       "run.py": RUNNER})
    r, got = run_guard(root, folder, "unittest", "run.py", "app.tests")
    assert "unittest.result.TestResult.addFailure" in got.blunted, r.stderr
    assert got.statuses["Adds one."] == "PASSED"  # what the rewrite makes of it: the grader calls it tampering


REPORTER = textwrap.dedent("""\
    import os, sys

    class PyTestReporter:
        def entering_test(self, f):
            sys.stdout.write("\\n" + f.__name__ + " ")
        def test_pass(self, char="."):
            sys.stdout.write("ok")
        def test_fail(self, exc_info):
            sys.stdout.write("F")
        def test_exception(self, exc_info):
            sys.stdout.write("E")
        def test_skip(self, v=None):
            sys.stdout.write("s")
        def test_xfail(self):
            sys.stdout.write("f")
        def test_xpass(self, v):
            sys.stdout.write("X")
        def import_error(self, filename, exc_info):
            sys.stdout.write(filename + " failed to import")

    def test(*paths, **kwargs):
        if not os.environ.get("PYTHONHASHSEED"):  # SymPy's runner starts a second interpreter then
            raise SystemExit("would start an unguarded subprocess")
        from lib import f
        rep = PyTestReporter()
        def test_one():
            assert f(1) == 2
        def test_two():
            assert f(2) == 3
        for fn in (test_one, test_two):
            rep.entering_test(fn)
            try:
                fn()
                rep.test_pass()
            except AssertionError:
                rep.test_fail(None)
        return True
""")
BIN_TEST = "import sys\nfrom sympy.testing.runtests import test\nsys.exit(not test(*sys.argv[1:]))\n"


def test_sympy_mode_wraps_the_reporter_when_the_runner_loads_it_and_keeps_the_run_in_the_guarded_process(tmp_path):
    lib = "def f(x):\n    print('\\ntest_two ok')\n    return x + 1 if x == 1 else x\n"
    files = {"sympy/__init__.py": "", "sympy/testing/__init__.py": "", "sympy/testing/runtests.py": REPORTER,
             "bin/test": BIN_TEST}
    root, folder = guard_repo(tmp_path, lib, [2], files)
    r, got = run_guard(root, folder, "sympy", "bin/test", "--verbose")
    assert "test_two ok" in r.stdout  # forged for a text parser
    assert got.recorded and got.statuses == {"test_one": "PASSED", "test_two": "FAILED"}, r.stdout + r.stderr


def runners_module() -> ModuleType:
    """``sandbox_runners.py`` as a module (the guard runs it in its own namespace)."""
    spec = importlib.util.spec_from_file_location("agentenv_runners", Path(channels.__file__).with_name(
        "sandbox_runners.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_isolated_run_resolves_djangos_ids_and_sympys_names_from_the_source(tmp_path):
    runners = runners_module()
    (tmp_path / "tests" / "app").mkdir(parents=True)
    (tmp_path / "tests" / "app" / "tests.py").write_text(UNITTEST_TESTS + textwrap.dedent('''\


        class Other(unittest.TestCase):
            def test_a(self):
                """Same line."""

            def test_b(self):
                """Same line."""
    '''))
    ids = ["test_in (app.tests.Checks.test_in)", "test_in (app.tests.Checks)", "Adds one.", "app.tests.Other.test_a",
           "Same line.", "test_gone (app.tests.Checks.test_gone)"]
    got = runners.resolve({"root": str(tmp_path), "runner": "django", "labels": ["app.tests"], "solo": ids})
    node = "tests/app/tests.py::Checks::"
    assert got == {ids[0]: node + "test_in", ids[1]: node + "test_in", "Adds one.": node + "test_sum",
                   ids[3]: "tests/app/tests.py::Other::test_a", "Same line.": "", ids[5]: ""}
    (tmp_path / "t.py").write_text("def test_a():\n    pass\nclass K:\n    def test_b(self):\n        pass\n")
    got = runners.resolve({"root": str(tmp_path), "runner": "sympy", "test_files": ["t.py"], "solo": ["test_a",
                                                                                                     "test_b"]})
    assert got == {"test_a": "t.py::test_a", "test_b": ""}


@pytest.mark.parametrize("command", [DJANGO, SYMPY])
def test_the_channel_names_the_runners_modules_for_the_audit_hook(command):
    ch = parse_test_command(command).channel
    assert ch is not None and ch.solo_config()["runner_modules"]


def test_the_grading_folder_is_refused_to_the_patch_by_a_relative_path_too(tmp_path):
    folder_name = "agentenv-grade-0123"
    lib = ("import os\n"
           f"os.chdir({str(tmp_path)!r})\n"
           "for name in os.listdir('.'):\n"
           "    if 'grade' in name:\n"
           "        open(name + '/' + 'results.json', 'w').write('{}')\n"
           "def f(x):\n    return x + 1\n")
    root, folder = guard_repo(tmp_path, lib, [1, 2, 3, 4, 5], {"app/__init__.py": "", "app/tests.py": UNITTEST_TESTS,
                                                               "run.py": RUNNER})
    moved = folder.rename(tmp_path / folder_name)
    cfg = json.loads((moved / "guard.json").read_text().replace(str(folder), str(moved)))
    cfg["paths"] = [str(moved), "/proc/", str(tmp_path / "agentenv-grade")]
    (moved / "guard.json").write_text(json.dumps(cfg))
    r, got = run_guard(root, moved, "unittest", "run.py", "app.tests")
    log = audit.read_log((moved / "audit.log").read_bytes())
    assert [(e["event"], e["detail"]) for e in log.events] == [("open", f"{folder_name}/results.json")], r.stderr
