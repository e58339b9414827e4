"""What counts as the agent's patch: extraction (the real script, on a git repository of this host), the
filter rule, git's reading of the kept patch, and how the grader runs a task's test command."""

from __future__ import annotations

import base64
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from agentenv.api import ExecResult
from envs.grading import PatchError, drop_reason, extract_patch, filter_patch, parse_test_command
from envs.grading.diff import FileChange, parse_numstat, parse_section, split_sections, unquote
from envs.grading.grader import Invocation, filter_for, protected_files, run_script
from envs.grading.patch import check_numstat, content_reason, gold_exemptions, link_stays_inside
from envs.task import Task

GIT_ENV = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull}
TESTS = ["pkg/tests/test_mod.py"]


def git(root: Path, *args: str, input: bytes | None = None) -> bytes:
    return subprocess.run(["git", *args], cwd=root, env=GIT_ENV, input=input, capture_output=True, check=True).stdout


class HostSandbox:
    """A stand-in for an agent's sandbox: exec runs on this host with /testbed mapped to a temporary folder."""

    def __init__(self, root: Path, exec_override: str | None = None) -> None:
        self.root, self.override = root, exec_override

    def exec(self, command, *, timeout=None, cwd=None, env=None, on_output=None):
        if self.override is not None:
            return ExecResult(0, self.override, "", 0.0)
        r = subprocess.run(["sh", "-c", command.replace("/testbed", str(self.root))], capture_output=True,
                           text=True, env={**GIT_ENV, **(env or {})}, timeout=60)
        return ExecResult(r.returncode, r.stdout, r.stderr, 0.0)


@pytest.fixture
def repo(tmp_path):
    root = tmp_path / "testbed"
    (root / "pkg" / "tests").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "mod.py").write_text("def f():\n    return 1\n")
    (root / "pkg" / "tests" / "__init__.py").write_text("")
    (root / "pkg" / "tests" / "test_mod.py").write_text("from pkg.mod import f\n\ndef test_f():\n    assert f() == 2\n")
    (root / "setup.cfg").write_text("[metadata]\nname = pkg\n")
    (root / "data.bin").write_bytes(bytes(range(256)))
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "base")
    return root


def base_of(root: Path) -> str:
    return git(root, "rev-parse", "HEAD").decode().strip()


def fresh_copy(root: Path, dest: Path) -> Path:
    subprocess.run(["git", "clone", "-q", str(root), str(dest)], check=True, env=GIT_ENV, capture_output=True)
    return dest


# --- extraction ------------------------------------------------------------------------------------

def test_extraction_takes_tracked_untracked_and_binary_and_leaves_the_index(repo, tmp_path):
    base = base_of(repo)
    (repo / "pkg" / "mod.py").write_text("def f():\n    return 2\n")
    (repo / "pkg" / "new file é.py").write_text("X = 1\n")
    (repo / "data.bin").write_bytes(bytes(reversed(range(256))))
    (repo / "setup.cfg").unlink()
    status = git(repo, "status", "--porcelain")
    patch = extract_patch(HostSandbox(repo), base)
    assert git(repo, "status", "--porcelain") == status  # the agent's index is untouched
    copy = fresh_copy(repo, tmp_path / "copy")
    git(copy, "apply", "--check", "-", input=patch)
    git(copy, "apply", "-", input=patch)
    assert (copy / "pkg" / "mod.py").read_text() == "def f():\n    return 2\n"
    assert (copy / "pkg" / "new file é.py").exists() and not (copy / "setup.cfg").exists()
    assert (copy / "data.bin").read_bytes() == bytes(reversed(range(256)))
    assert extract_patch(HostSandbox(fresh_copy(repo, tmp_path / "clean")), base) == b""


def test_extraction_ignores_a_hostile_repository_config(repo, tmp_path):
    base = base_of(repo)
    marker = tmp_path / "ran"
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    for name in ("pre-commit", "post-index-change", "reference-transaction"):
        (hooks / name).write_text(f"#!/bin/sh\ntouch {marker}\n")
        (hooks / name).chmod(0o755)
    for key, value in (("core.hooksPath", str(hooks)), ("core.fsmonitor", f"touch {marker}; false"),
                       ("diff.noprefix", "true"), ("diff.external", f"sh -c 'touch {marker}'"),
                       ("diff.mnemonicPrefix", "true"), ("diff.renames", "copies")):
        git(repo, "config", key, value)
    (repo / "pkg" / "mod.py").write_text("def f():\n    return 2\n")
    patch = extract_patch(HostSandbox(repo), base)
    assert not marker.exists()
    assert patch.startswith(b"diff --git a/pkg/mod.py b/pkg/mod.py\n")


def test_extraction_refuses_what_is_too_large_or_not_a_patch(repo):
    base = base_of(repo)
    (repo / "big.txt").write_text("x" * 5000)
    with pytest.raises(PatchError, match="over the 1000 byte limit"):
        extract_patch(HostSandbox(repo), base, limit=1000)
    with pytest.raises(PatchError, match="not a patch"):
        extract_patch(HostSandbox(repo, exec_override="Here is my patch: PASSED"), base)
    huge = base64.b64encode(b"y" * 3000).decode()
    with pytest.raises(PatchError, match="over the 1000 byte limit"):
        extract_patch(HostSandbox(repo, exec_override=huge), base, limit=1000)


# --- the rule --------------------------------------------------------------------------------------

@pytest.mark.parametrize(("path", "new", "want"), [
    ("pkg/mod.py", False, None),
    ("pkg/sub/new.py", True, None),
    ("docs/index.rst", False, None),
    ("setup.py", False, None),
    ("pkg/tests/test_mod.py", False, "test"),
    ("conftest.py", True, "test-config"),
    ("pkg/tests/conftest.py", True, "test-config"),
    ("pkg/conftest.py", False, "test-config"),
    ("pytest.ini", True, "test-config"),
    ("pkg/.pytest.ini", True, "test-config"),
    ("tox.ini", False, "test-config"),
    ("setup.cfg", False, "test-config"),
    ("pyproject.toml", False, "test-config"),
    ("sitecustomize.py", True, "startup-hook"),
    ("pkg/usercustomize.py", True, "startup-hook"),
    ("evil.pth", True, "startup-hook"),
    ("pkg/__pycache__/mod.cpython-311.pyc", True, "bytecode"),
    ("pkg/mod.pyc", True, "bytecode"),
    ("pkg/mod.cpython-311-x86_64-linux-gnu.so", True, "native-code"),
    ("pkg/libx.so.1", True, "native-code"),
    ("evil-1.0.dist-info/entry_points.txt", True, "package-metadata"),
    ("pkg.egg-info/entry_points.txt", False, "package-metadata"),
    (".gitattributes", True, "git"),
    (".git/hooks/pre-commit", True, "git"),
    ("pkg/.gitmodules", True, "git"),
    ("/etc/passwd", True, "unsafe-path"),
    ("../outside.py", True, "unsafe-path"),
    ("pkg//mod.py", True, "unsafe-path"),
    ("pkg/mod\n.py", True, "unsafe-path"),
    ("pytest.py", True, "shadows-module"),
    ("_pytest/__init__.py", True, "shadows-module"),
    ("pluggy/__init__.py", True, "shadows-module"),
    ("json.py", True, "shadows-module"),
    ("src/argparse.py", True, "shadows-module"),
    ("pkg/tests/unittest.py", True, "shadows-module"),   # the tests' folder is an import root
    ("pkg/json.py", True, "shadows-module"),             # pkg holds the tests' folder: a root, to be safe
    ("pkg/sub/json.py", True, None),                     # a submodule of the package shadows nothing
    ("json.py", False, None),                            # the repository's own module
])
def test_drop_reason(path, new, want):
    assert drop_reason(path, tests=TESTS, new_file=new,
                       roots=["", "src", "pkg", "pkg/tests"]) == want


def section(text: str) -> FileChange:
    return parse_section(text.encode())


@pytest.mark.parametrize(("added", "want"), [
    ("    return 2", None),
    ("import pytest", "runner-reference"),
    ("from _pytest import runner", "runner-reference"),
    ("import pluggy", "runner-reference"),
    ("def pytest_runtest_makereport(item, call): ...", "runner-reference"),
    ("open(sys.argv[-1]).write('<testsuite/>')", "runner-reference"),
    ("frame = sys._getframe(2)", "runner-reference"),
    ("for o in gc.get_objects(): ...", "runner-reference"),
    ("atexit.register(lambda: os._exit(0))", "runner-reference"),
    ("sys.settrace(tracer)", "runner-reference"),
    ("sys.meta_path.insert(0, Finder())", "runner-reference"),
    ("X = 'JUnit'", "runner-reference"),
])
def test_content_reason_for_added_lines(added, want):
    change = section(f"diff --git a/pkg/mod.py b/pkg/mod.py\n--- a/pkg/mod.py\n+++ b/pkg/mod.py\n@@ -1 +1 @@\n-x\n+{added}\n")
    got = content_reason(change)
    assert (got[0] if got else None) == want


def test_links_must_stay_in_the_repository():
    assert link_stays_inside("pkg/a.py", "mod.py") and link_stays_inside("pkg/tests/x", "../../setup.py")
    for target in ("/usr/lib/python3/dist-packages/pytest.py", "../../outside", "../.git/config", ""):
        assert not link_stays_inside("pkg/a.py", target), target


def test_unquote_reads_gits_quoted_names():
    assert unquote('"a/t\\303\\251st\\tx.py"') == "a/tést\tx.py"
    assert unquote("a/plain.py") == "a/plain.py"
    assert unquote('"a/bad\\q"') is None and unquote('"unterminated') is None


def hostile_change(repo: Path) -> None:
    """Every kind of change the rule knows, next to a real fix."""
    (repo / "pkg" / "mod.py").write_text("def f():\n    return 2\n")                              # kept
    (repo / "pkg" / "helpers.py").write_text("def g():\n    return 3\n")                         # kept
    (repo / "pkg" / "link.py").symlink_to("mod.py")                                                # kept
    (repo / "conftest.py").write_text("import pytest\n")
    (repo / "pkg" / "tests" / "conftest.py").write_text("def pytest_collection_modifyitems(items): pass\n")
    (repo / "pkg" / "tests" / "test_mod.py").write_text("def test_f():\n    pass\n")
    (repo / "setup.cfg").write_text("[tool:pytest]\naddopts = -p evil\n")
    (repo / "pytest.ini").write_text("[pytest]\naddopts = --co\n")
    (repo / "sitecustomize.py").write_text("import os\n")
    (repo / "zz.pth").write_text("import os\n")
    (repo / "pytest.py").write_text("def main(): return 0\n")
    (repo / "pkg" / "escape.py").symlink_to("/usr/lib/python3/dist-packages/evil.py")
    (repo / "pkg" / "plugin.py").write_text("import _pytest.runner\n")
    (repo / "pkg" / "compiled.py").write_bytes(b"X = 1\0\n")
    (repo / "data.bin").write_bytes(b"\0\1\2")                                                     # kept


def test_filter_drops_and_reports_every_kind_and_git_reads_the_rest_alike(repo, tmp_path):
    base = base_of(repo)
    hostile_change(repo)
    patch = extract_patch(HostSandbox(repo), base)
    got = filter_patch(patch, tests=TESTS)
    assert {d.path: d.reason for d in got.dropped} == {
        "conftest.py": "test-config", "pkg/tests/conftest.py": "test-config", "pkg/tests/test_mod.py": "test",
        "setup.cfg": "test-config", "pytest.ini": "test-config", "sitecustomize.py": "startup-hook",
        "zz.pth": "startup-hook", "pytest.py": "shadows-module", "pkg/escape.py": "symlink-escape",
        "pkg/plugin.py": "runner-reference", "pkg/compiled.py": "binary-source"}
    assert [c.path for c in got.changes] == ["data.bin", "pkg/helpers.py", "pkg/link.py", "pkg/mod.py"]
    assert got.tampering
    copy = fresh_copy(repo, tmp_path / "copy")
    numstat = git(copy, "apply", "--numstat", "-z", "-", input=got.kept)
    assert check_numstat(got, parse_numstat(numstat)) == ""
    git(copy, "apply", "-", input=got.kept)
    assert (copy / "pkg" / "link.py").is_symlink() and not (copy / "conftest.py").exists()
    only_tests = filter_patch(patch, tests=[*TESTS, "conftest.py"], roots=[""])
    assert not [d for d in only_tests.dropped if d.path == "pkg/tests/test_mod.py" and d.tampering]


def test_a_patch_git_reads_differently_is_caught(repo, tmp_path):
    """A traditional diff hidden after a section's hunks: git applies it, a splitter on `diff --git` misses it."""
    hidden = (b"diff --git a/pkg/new.py b/pkg/new.py\nnew file mode 100644\n--- /dev/null\n+++ b/pkg/new.py\n"
              b"@@ -0,0 +1 @@\n+X = 1\n--- a/pkg/mod.py\n+++ b/pkg/mod.py\n@@ -1,2 +1,2 @@\n def f():\n"
              b"-    return 1\n+    return 2\n")
    got = filter_patch(hidden, tests=TESTS)
    assert [c.path for c in got.changes] == ["pkg/new.py"]
    copy = fresh_copy(repo, tmp_path / "copy")
    mismatch = check_numstat(got, parse_numstat(git(copy, "apply", "--numstat", "-z", "-", input=got.kept)))
    assert "2 file change(s)" in mismatch


def test_garbage_and_odd_headers_are_unparseable():
    got = filter_patch(b"--- a/conftest.py\n+++ b/conftest.py\n@@ -0,0 +1 @@\n+x\n"
                       b"diff --git nonsense\n--- a/x.py\n+++ b/y.py\n@@ -1 +1 @@\n-a\n+b\n"
                       b"diff --git a/z.py b/z.py\nsomething odd\n--- a/z.py\n+++ b/z.py\n")
    assert [d.reason for d in got.dropped] == ["unparseable"] * 3 and got.kept == b""


def test_a_rename_section_is_judged_by_both_names():
    patch = (b"diff --git a/pkg/mod.py b/conftest.py\nsimilarity index 100%\nrename from pkg/mod.py\n"
             b"rename to conftest.py\n")
    got = filter_patch(patch, tests=TESTS)
    assert [(d.path, d.reason) for d in got.dropped] == [("conftest.py", "test-config")]


def test_numstat_parsing():
    assert [e.paths for e in parse_numstat(b"1\t0\ta.py\x00-\t-\tb.bin\x000\t0\t\x00old.py\x00new.py\x00") or []] == [
        ("a.py",), ("b.bin",), ("old.py", "new.py")]
    assert parse_numstat(b"garbage\x00") is None


def test_the_gold_patch_exempts_what_it_needs_itself():
    gold = ("diff --git a/setup.cfg b/setup.cfg\n--- a/setup.cfg\n+++ b/setup.cfg\n@@ -1 +1 @@\n-a\n+b\n"
            "diff --git a/src/cli.py b/src/cli.py\n--- a/src/cli.py\n+++ b/src/cli.py\n@@ -1 +1 @@\n-a\n"
            "+args = sys.argv[1:]\n")
    paths, reasons = gold_exemptions(gold)
    assert paths == {"setup.cfg", "src/cli.py"} and reasons == {"runner-reference"}
    agent = (gold + "diff --git a/tox.ini b/tox.ini\n--- a/tox.ini\n+++ b/tox.ini\n@@ -1 +1 @@\n-a\n+b\n").encode()
    got = filter_patch(agent, exempt_paths=paths, exempt_reasons=reasons)
    assert [c.path for c in got.changes] == ["setup.cfg", "src/cli.py"] and [d.path for d in got.dropped] == ["tox.ini"]


def test_test_patch_files_are_protected():
    task = Task.from_json({"instance_id": "t", "repo": "r", "base_commit": "abcdef1", "image": "i",
                           "patch": "--- a/x\n+++ b/x\n", "problem_statement": "p", "test_command": "pytest {tests}",
                           "test_patch": ("diff --git a/tests/test_new.py b/tests/test_new.py\nnew file mode 100644\n"
                                          "--- /dev/null\n+++ b/tests/test_new.py\n@@ -0,0 +1 @@\n+def test_n(): pass\n"),
                           "FAIL_TO_PASS": ["tests/test_new.py::test_n"], "PASS_TO_PASS": ["tests/test_old.py::test_o"]})
    assert protected_files(task) == ["tests/test_new.py", "tests/test_old.py"]
    pre = b"diff --git a/tests/test_new.py b/tests/test_new.py\nnew file mode 100644\n--- /dev/null\n" \
          b"+++ b/tests/test_new.py\n@@ -0,0 +1 @@\n+def test_n(): pass\n"
    assert [(d.path, d.reason, d.tampering) for d in filter_for(task, pre).dropped] == [
        ("tests/test_new.py", "test", False)]


def test_split_sections_keeps_every_byte():
    patch = b"junk\ndiff --git a/a b/a\n+x\ndiff --git a/b b/b\n+y"
    pre, parts = split_sections(patch)
    assert pre + b"".join(parts) == patch and len(parts) == 2


# --- the test command ------------------------------------------------------------------------------

SHIPPED = ("python3 -m pytest -p no:cacheprovider -o addopts= -rA --tb=short --color=no "
           "-W ignore::DeprecationWarning {tests}")


@pytest.mark.parametrize(("command", "interp", "args", "canary"), [
    (SHIPPED, "python3", SHIPPED.split()[3:], True),
    ("pytest -rA {tests}", "pytest", ["-rA", "{tests}"], True),
    ("FOO=1 /opt/py/bin/python -X dev -m pytest -x {tests}", "/opt/py/bin/python", ["-x", "{tests}"], True),
    ("python -m pytest -k 'not slow' {tests}", "python", ["-k", "not slow", "{tests}"], False),
    ("python -m pytest", "python", [], False),
    ("tox -e py311", "", None, False),
    ("cd sub && pytest {tests}", "", None, False),
    ("python -c 'import pytest' -m pytest", "", None, False),
])
def test_parse_test_command(command, interp, args, canary):
    inv = parse_test_command(command)
    assert inv.interpreter == interp and (list(inv.args) if inv.args is not None else None) == args
    assert inv.canary_allowed() == canary


def task_with(command: str, **extra) -> Task:
    return Task.from_json({"instance_id": "t", "repo": "r", "base_commit": "abcdef1", "image": "i",
                           "patch": "--- a/x\n+++ b/x\n", "problem_statement": "p", "test_command": command,
                           "FAIL_TO_PASS": ["tests/test_a.py::test_x[a b]"], "PASS_TO_PASS": [], **extra})


def test_the_run_script_pins_the_interpreter_and_turns_plugins_off():
    task = task_with(SHIPPED, pytest_plugins=["pytest_asyncio"])
    script = run_script(task, parse_test_command(SHIPPED), "/usr/bin/python3", "/var/lib/agentenv-grade-x")
    lines = script.splitlines()
    assert "unset" in lines[0] and "PYTHON|PYTEST_" in lines[0]
    assert "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1" in lines[1]
    words = shlex.split(lines[3])
    # pytest starts under the grader's guard (its audit hook), from the grading folder, not with -m
    assert words[:4] == ["/usr/bin/python3", "/var/lib/agentenv-grade-x/guard.py",
                         "/var/lib/agentenv-grade-x/guard.json", "pytest"]
    assert "tests/test_a.py" in words and not [w for w in words if "canary" in w]
    assert "--junitxml=/var/lib/agentenv-grade-x/junit.xml" in words and "junit_family=xunit1" in words
    assert words[words.index("pytest_asyncio") - 1] == "-p" and "--rootdir=/testbed" in words
    assert lines[-2:] == ["kill -s KILL -- -1 2>/dev/null", "exit $rc"]


def test_the_isolated_run_follows_pytest_once_its_processes_are_killed():
    task = task_with(SHIPPED)
    lines = run_script(task, parse_test_command(SHIPPED), "/usr/bin/python3", "/var/lib/agentenv-grade-x",
                       solo=True).splitlines()
    at = lines.index("rc=$?")
    assert lines[at + 1] == "kill -s KILL -- -1 2>/dev/null"
    assert shlex.split(lines[at + 2])[:4] == ["/usr/bin/python3", "/var/lib/agentenv-grade-x/guard.py",
                                              "/var/lib/agentenv-grade-x/guard.json", "solo"]
    assert lines[-2:] == ["kill -s KILL -- -1 2>/dev/null", "exit $rc"]


def test_a_command_the_grader_cannot_rewrite_gets_its_options_from_the_environment():
    task = task_with("cd /testbed && tox -e py -- {tests}")
    script = run_script(task, Invocation(), "", "/var/lib/agentenv-grade-x")
    assert "PYTEST_ADDOPTS=" in script and "--junitxml=/var/lib/agentenv-grade-x/junit.xml" in script
    assert "tox -e py -- tests/test_a.py" in script
