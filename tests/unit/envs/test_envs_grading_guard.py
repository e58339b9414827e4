"""The grader's run-time guard (issue 24, point 6): derived canaries, the audit hook and the isolated run.

The guard program (``envs/grading/sandbox_guard.py``) is run here for real, with this interpreter and the real
pytest, on a small repository in a temporary folder (the integration tests run it in the task images).
"""

from __future__ import annotations

import ast
import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from envs.grading import audit, canary, isolation

TESTS = textwrap.dedent("""\
    from lib import f


    def test_value():
        x = f(1)
        assert x == 2


    def test_twice():
        assert f(f(1)) == 3


    def test_no_assert():
        f(0)
""")


def test_canaries_copy_real_tests_under_names_made_of_their_words_and_always_fail():
    c = canary.derive(TESTS, rng=random.Random(1))
    assert c is not None and len(c.names) == 2  # test_no_assert has no assert to turn
    tree = ast.parse(c.source)
    names = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
    for name in c.names:
        base = next(b for b in ("test_value", "test_twice") if name.startswith(b + "_"))
        assert names.index(name) == names.index(base) + 1  # right after the test it copies
        assert name.removeprefix(base + "_") in {"value", "twice", "no", "assert"}
    assert "assert not (x == 2)" in c.source and "assert not (f(f(1)) == 3)" in c.source
    for right in (True, False):  # whatever the code under test does, the canary fails
        ns: dict[str, object] = {}
        exec(compile(c.source.replace("from lib import f", ""), "t.py", "exec"),
             {**ns, "f": (lambda v: v + 1) if right else (lambda v: v)}, ns)
        for name in c.names:
            with pytest.raises(AssertionError):
                ns[name]()  # type: ignore[operator]
        if right:
            ns["test_value"]()  # type: ignore[operator]  # the originals are untouched


def test_a_file_without_a_test_to_copy_has_no_derived_canary():
    assert canary.derive("def helper():\n    assert True\n") is None
    assert canary.derive("def test_x(:\n") is None


PATCH = (b"diff --git a/lib.py b/lib.py\nindex 1..2 100644\n--- a/lib.py\n+++ b/lib.py\n@@ -1,3 +1,4 @@\n"
         b" def f(x):\n-    return x\n+    return x + 1\n+# note\n \n"
         b"diff --git a/new.py b/new.py\nnew file mode 100644\nindex 0..1\n--- /dev/null\n+++ b/new.py\n"
         b"@@ -0,0 +1,2 @@\n+a = 1\n+b = 2\n")


def test_added_lines_are_the_new_sides_plus_lines_and_a_new_file_is_added_throughout():
    first, second = PATCH.split(b"diff --git a/new.py")
    assert audit.added_lines(first) == [2, 3]
    assert audit.added_lines(b"diff --git a/new.py" + second) is None
    assert audit.module_names("src/pkg/__init__.py") == {"src.pkg", "pkg"}


def test_the_audit_log_counts_starts_and_keeps_what_it_cannot_read_as_an_event():
    log = audit.read_log(b'{"event": "started"}\n{"event": "gc.get_objects", "detail": "", "where": "/t/l.py:3"}\n'
                         b"garbage\n")
    assert log.starts == 1 and [e["event"] for e in log.events] == ["gc.get_objects", "unreadable log line"]
    assert "/t/l.py:3" in log.reasons()[0]


def test_an_isolated_result_without_the_secret_is_not_believed():
    good = json.dumps({"secret": "s1", "results": {"t.py::test_a": "PASSED"}}).encode()
    assert isolation.read_solo(good, "s1").status("t.py::test_a") == "PASSED"
    assert isolation.read_solo(good, "s2").problem and isolation.read_solo(b"", "s1").problem
    forged = isolation.read_solo(good, "s2")
    assert isolation.disagreements(forged, ["t.py::test_a"], {"t.py::test_a": "PASSED"}, [])
    assert not isolation.disagreements(forged, ["t.py::test_a"], {"t.py::test_a": "FAILED"}, [])


def test_disagreements_between_pytest_and_the_isolated_run():
    solo = isolation.SoloRun({"t::a": "FAILED AssertionError", "t::b": "PASSED", "t::c": "UNSUPPORTED",
                              "t::k": "PASSED"})
    statuses = {"t::a": "PASSED", "t::b": "PASSED", "t::c": "PASSED"}
    found = isolation.disagreements(solo, ["t::a", "t::b", "t::c", "t::k"], statuses, ["t::k"])
    assert len(found) == 2 and "t::a" in found[0] and "canary t::k" in found[1]


# --- the guard, for real ---------------------------------------------------------------------------


SOLO = ["tests/test_lib.py::test_value", "tests/test_lib.py::test_twice", "tests/test_lib.py::test_p"]


def repo(tmp_path: Path, lib: str, added: list[int] | None, tests: str = TESTS,
         solo_ids: list[str] = SOLO) -> tuple[Path, Path]:
    root, folder = tmp_path / "repo", tmp_path / "grade"
    (root / "tests").mkdir(parents=True)
    folder.mkdir()
    (root / "lib.py").write_text(lib)
    (root / "tests" / "test_lib.py").write_text(tests)
    cfg = {"log": str(folder / "audit.log"), "folder": str(folder), "root": str(root),
           "patched": {str(root / "lib.py"): added}, "modules": ["lib"], "paths": [str(folder), "/proc/"],
           "solo": solo_ids}
    (folder / "guard.json").write_text(json.dumps(cfg))
    for name, text in audit.guard_files().items():
        (folder / name).write_bytes(text)
    return root, folder


def guarded(root: Path, folder: Path, *mode: str) -> subprocess.CompletedProcess[str]:
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    return subprocess.run([sys.executable, str(folder / "guard.py"), str(folder / "guard.json"), *mode],
                          cwd=root, env=env, capture_output=True, text=True, timeout=120, check=False)


def run_pytest(root: Path, folder: Path) -> tuple[subprocess.CompletedProcess[str], audit.AuditLog]:
    r = guarded(root, folder, "pytest", "-q", "-p", "no:cacheprovider", "tests")
    return r, audit.read_log((folder / "audit.log").read_bytes())


LIB = "def f(x):\n    return x + 1\n"
GC_WALK = "_g = __import__('g' + 'c')\n_objs = getattr(_g, 'get_' + 'objects')()\n"


def test_a_gc_walk_in_added_lines_is_refused_and_logged(tmp_path):
    root, folder = repo(tmp_path, LIB + GC_WALK, [3, 4])
    r, log = run_pytest(root, folder)
    assert log.starts == 1 and [e["event"] for e in log.events] == ["gc.get_objects"], r.stdout
    assert log.events[0]["where"] == f"{root}/lib.py:4"
    assert r.returncode != 0 and "refused" in r.stdout


def test_the_same_walk_on_a_line_the_patch_did_not_add_is_the_repositorys_own(tmp_path):
    root, folder = repo(tmp_path, LIB + GC_WALK, [2])
    r, log = run_pytest(root, folder)
    assert log.starts == 1 and not log.events and r.returncode == 0, r.stdout


def test_a_frame_taken_from_a_traceback_in_added_code_is_refused(tmp_path):
    lib = LIB + ("def _peek():\n    try:\n        raise ValueError\n    except ValueError as e:\n"
                 "        return getattr(e.__traceback__, 'tb_' + 'frame')\n_peek()\n")
    root, folder = repo(tmp_path, lib, list(range(3, 9)))
    _, log = run_pytest(root, folder)
    assert [e["event"] for e in log.events] == ["object.__getattr__"] and log.events[0]["detail"] == "tb_frame"


def test_benign_run_time_code_in_added_lines_is_not_refused(tmp_path):
    lib = LIB + ("import collections, fractions, inspect, logging\n"
                 "P = collections.namedtuple('P', 'a b')\n"
                 "logging.getLogger(__name__).warning('loaded %s', P(1, 2))\n"
                 "class Own:\n    pass\nOwn.flag = fractions.Fraction(1, 2)\n"
                 "SIG = inspect.signature(collections.namedtuple)\n")
    root, folder = repo(tmp_path, lib, list(range(3, 11)))
    r, log = run_pytest(root, folder)
    assert log.starts == 1 and not log.events and r.returncode == 0, r.stdout + r.stderr


def solo(root: Path, folder: Path, secret: str = "s3cret") -> isolation.SoloRun:
    (folder / "solo.key").write_text(secret)
    r = guarded(root, folder, "solo")
    assert not (folder / "solo.key").exists(), "the secret is deleted before the repository's code runs"
    return isolation.read_solo((folder / "solo.json").read_bytes(), secret) if r.returncode == 0 else \
        isolation.SoloRun({}, r.stderr)


def test_the_isolated_run_calls_plain_tests_and_reports_only_with_the_secret(tmp_path):
    tests = TESTS + "\n\nimport pytest\n\n\n@pytest.mark.parametrize('v', [1])\ndef test_p(v):\n    assert v\n"
    root, folder = repo(tmp_path, "def f(x):\n    return x + 2\n", [2], tests)
    run = solo(root, folder)
    assert not run.problem, run.problem
    assert run.status("tests/test_lib.py::test_value") == "FAILED" and run.status("tests/test_lib.py::test_twice") \
        == "FAILED" and run.status("tests/test_lib.py::test_p") == "UNSUPPORTED"
    root2, folder2 = repo(tmp_path / "b", LIB, [2], tests)
    good = solo(root2, folder2)
    assert good.status("tests/test_lib.py::test_value") == "PASSED", good.results


def test_an_xfail_or_a_swapped_test_function_fails_the_isolated_run(tmp_path):
    lib = LIB + ("import sys, threading\n"
                 "def _swap():\n"
                 "    m = sys.modules.get('test_lib')\n"
                 "    if m is not None:\n"
                 "        m.test_twice = lambda: None\n"
                 "def f(x):\n"
                 "    _swap()\n"
                 "    raise getattr(__import__('py' + 'test'), 'xf' + 'ail').Exception('known bug')\n")
    root, folder = repo(tmp_path, lib, list(range(3, 13)))
    run = solo(root, folder)
    assert run.results["tests/test_lib.py::test_value"].startswith("FAILED"), run.results
    assert run.status("tests/test_lib.py::test_twice") in ("MISMATCH", "FAILED"), run.results


UNITTEST = textwrap.dedent("""\
    import unittest

    from lib import f
    from mixin import Mixin


    class TestF(unittest.TestCase, Mixin):
        def test_own(self):
            self.assertEqual(f(1), 2)
""")
MIXIN = "from lib import f\n\n\nclass Mixin:\n    def test_inherited(self):\n        self.assertEqual(f(2), 3)\n"
UNITTEST_IDS = ["tests/test_lib.py::TestF::test_own", "tests/test_lib.py::TestF::test_inherited"]


@pytest.mark.parametrize("right", [True, False])
def test_the_isolated_run_calls_unittest_tests_their_own_and_inherited(tmp_path, right):
    root, folder = repo(tmp_path, LIB if right else "def f(x):\n    return x\n", [2], UNITTEST, UNITTEST_IDS)
    (root / "tests" / "mixin.py").write_text(MIXIN)
    run = solo(root, folder)
    assert {run.status(t) for t in UNITTEST_IDS} == {"PASSED" if right else "FAILED"}, run.results


def test_blunting_unittests_assertions_is_seen_by_the_isolated_run(tmp_path):
    lib = "def f(x):\n    return x\n" + "import unittest as _u\nsetattr(_u.TestCase, 'assert' + 'Equal', lambda *a, **k: None)\n"
    root, folder = repo(tmp_path, lib, [3, 4], UNITTEST, UNITTEST_IDS)
    (root / "tests" / "mixin.py").write_text(MIXIN)
    run = solo(root, folder)
    assert {run.status(t) for t in UNITTEST_IDS} == {"MISMATCH"}, run.results
    assert "unittest.case.TestCase.assertEqual" in run.results[UNITTEST_IDS[0]]


# --- signals, rebound builtins and module attributes, parametrized tests -----------------------------------

SIGNAL_FRAMES = textwrap.dedent("""\
    import os as _os
    _sg = __import__('sig' + 'nal')
    def _walk(signum, frame):
        open(_os.environ['MARK'], 'w').write(frame.f_back.f_code.co_name)
    getattr(_sg, 'sig' + 'nal')(_sg.SIGUSR1, _walk)
    getattr(_sg, 'raise_' + 'signal')(_sg.SIGUSR1)
""")


def test_a_signal_handler_set_by_the_patch_never_runs_and_is_logged(tmp_path):
    """A handler is handed the interrupted frame, which no audit event reports: under the guard's seccomp
    filter no handler set from Python is called (the signal keeps its default action: SIGUSR1 ends the run)."""
    root, folder = repo(tmp_path, LIB + "import os\nif os.environ.get('ARM'):\n" + textwrap.indent(SIGNAL_FRAMES, "    "),
                        list(range(3, 12)))
    mark = tmp_path / "walked"
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
           "MARK": str(mark), "ARM": "1"}
    r = subprocess.run([sys.executable, str(folder / "guard.py"), str(folder / "guard.json"), "pytest", "-q",
                        "-p", "no:cacheprovider", "tests"], cwd=root, env=env, capture_output=True, text=True,
                       timeout=120, check=False)
    assert not mark.exists(), "the handler ran"
    assert r.returncode == -10, (r.returncode, r.stdout, r.stderr)   # SIGUSR1's default action
    plain = subprocess.run([sys.executable, "-c", "import lib"], cwd=root, env=env, capture_output=True, text=True,
                           timeout=60, check=False)
    assert plain.returncode == 0 and mark.read_text(), "without the guard the same code reaches a frame"


def test_a_leftover_handler_of_the_patch_is_logged(tmp_path):
    lib = LIB + "_sg = __import__('sig' + 'nal')\ngetattr(_sg, 'sig' + 'nal')(_sg.SIGUSR2, lambda *a: None)\n"
    root, folder = repo(tmp_path, lib, [3, 4])
    r, log = run_pytest(root, folder)
    assert [e["event"] for e in log.events] == ["signal.signal"], (r.stdout, log)
    assert log.events[0]["where"].startswith(f"{root}/lib.py:")


BUSY_GETATTR = ("import builtins as _b\n_g0 = _b.getattr\n"
                "_b.getattr = lambda o, n, *d: True if n == 'busy' else _g0(o, n, *d)\n")
QUIET_JSON = ("import json as _j\nclass _Quiet:\n    def encode(self, o):\n        return '{\"event\": \"started\"}'\n"
              "_j._default_encoder = _Quiet()\n")


@pytest.mark.parametrize("rebinding", [BUSY_GETATTR, QUIET_JSON], ids=["a_getattr_that_says_busy", "a_quiet_json"])
def test_rebinding_builtins_or_json_neither_blinds_the_hook_nor_hides_what_it_refused(tmp_path, rebinding):
    """The hook runs with builtins of its own and writes its log with the C encoder: a getattr that says it is
    busy, or a json encoder that writes start lines, changes nothing for it."""
    root, folder = repo(tmp_path, LIB + rebinding + GC_WALK, list(range(3, 3 + (LIB + rebinding).count("\n") + 2)))
    r, log = run_pytest(root, folder)
    assert [e["event"] for e in log.events] == ["gc.get_objects"], (r.stdout, log)


def test_a_rebound_json_dumps_cannot_forge_the_isolated_runs_verdicts(tmp_path):
    lib = "def f(x):\n    return x\n" + textwrap.dedent("""\
        import sys as _s
        _j = _s.modules['js' + 'on']
        _d = _j.dumps
        def _forge(obj, *a, **k):
            if isinstance(obj, dict) and 'results' in obj:
                obj = dict(obj, results={t: 'PASSED' for t in obj['results']})
            return _d(obj, *a, **k)
        _j.dumps = _forge
        _j._default_encoder = _j.JSONEncoder()
        _j.encoder.encode_basestring_ascii = lambda s: '"PASSED"'
    """)
    root, folder = repo(tmp_path, lib, list(range(3, 15)))
    run = solo(root, folder)
    assert not run.problem and run.results["tests/test_lib.py::test_value"].startswith("FAILED"), run.results


PARAMETRIZED = textwrap.dedent("""\
    import pytest

    from lib import f

    CASES = [(1, 2), (2, 3), ("a", "b")]


    @pytest.mark.parametrize("x, y", CASES)
    def test_f(x, y):
        assert f(x) == y


    class TestF:
        @pytest.mark.parametrize("x", [1, None])
        @pytest.mark.parametrize("k", ["p", "q"])
        def test_k(self, x, k):
            assert x is None or f(x) == 2


    @pytest.mark.parametrize("v", [object(), f])
    def test_obj(v):
        assert v is not None


    @pytest.mark.parametrize("v", [1, 1])
    def test_dup(v):
        assert v
""")
PARAM_IDS = ["tests/test_lib.py::test_f[1-2]", "tests/test_lib.py::test_f[2-3]", "tests/test_lib.py::test_f[a-b]",
             "tests/test_lib.py::TestF::test_k[p-1]", "tests/test_lib.py::TestF::test_k[q-None]",
             "tests/test_lib.py::test_obj[v0]", "tests/test_lib.py::test_obj[f]", "tests/test_lib.py::test_dup[1]",
             "tests/test_lib.py::test_f[9-9]"]


def test_the_isolated_run_calls_parametrized_tests_with_the_set_their_id_names(tmp_path):
    lib = "def f(x):\n    return x + 1 if x == 1 else x\n"
    root, folder = repo(tmp_path, lib, [2], PARAMETRIZED, PARAM_IDS)
    run = solo(root, folder)
    assert not run.problem, run.problem
    got = {t.split("::")[-1]: run.status(t) for t in PARAM_IDS}
    assert got == {"test_f[1-2]": "PASSED", "test_f[2-3]": "FAILED", "test_f[a-b]": "FAILED", "test_k[p-1]": "PASSED",
                   "test_k[q-None]": "PASSED", "test_obj[v0]": "PASSED", "test_obj[f]": "PASSED",
                   "test_dup[1]": "UNSUPPORTED", "test_f[9-9]": "UNSUPPORTED"}, got


def test_the_ids_are_pytests_own(tmp_path):
    """Every id the isolated run derives is one pytest collects, for the same test file."""
    root, folder = repo(tmp_path, LIB, [2], PARAMETRIZED, PARAM_IDS)
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"],
                       cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}, capture_output=True,
                       text=True, timeout=120, check=False)
    collected = {line.strip() for line in r.stdout.splitlines() if "::" in line}
    run = solo(root, folder)
    called = {t for t in PARAM_IDS if run.status(t) not in ("UNSUPPORTED", "MISSING")}
    assert called and called <= collected, (called - collected, r.stdout)

