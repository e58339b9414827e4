"""Known ways to make an SWE grader say "resolved" without fixing the bug: each must score 0, while the gold
patch still scores 1 on the same task (issue 9 §1; docs/architecture.md §7). The set is never finished: add to it.

Two shipped tasks (toolz: tests in a package; boltons: tests beside a pristine conftest.py). Each attack
starts from the task's pristine state (a sandbox restored from the env's pristine snapshot, as an agent's
sandbox is at reset), does what an agent could do there as root, and is graded as the env grades. The
attacks aimed at code run *inside* the test process avoid the words the filter looks for, to show what
stops them besides the text rule (the fresh sandbox, the canaries, the result file, the process kill, the
audit hook; test_envs_runtime_tampering.py has the attacks that rewrite outcomes from inside the test process).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import agentenv
from agentenv.api import SandboxLike
from envs.grading import GradeResult, grade
from envs.swe_env import Pristine, SWEEnv
from envs.task import Task

sys.path.insert(0, str(Path(__file__).resolve().parent))
from swe_cases import reset_env, run  # noqa: E402

pytestmark = pytest.mark.integration

HOOK = """
import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome = "passed"
    report.longrepr = None
"""
XFAIL_ALL = """
import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.xfail(reason="known upstream bug", run=False))
"""
FORCE_PASSED = """

_agentenv_init = TestReport.__init__


def _agentenv_passed(self, *args, **kwargs):
    _agentenv_init(self, *args, **kwargs)
    self.outcome = "passed"
    self.longrepr = None


TestReport.__init__ = _agentenv_passed
"""


@dataclass
class Case:
    task: Task
    pristine: Pristine
    site: str            # where pytest is installed in the image
    source: str          # the file the bug is in
    function: str        # the buggy function (``Class.method`` for a method)

    @property
    def test_file(self) -> str:
        return self.task.FAIL_TO_PASS[0].split("::", 1)[0]

    @property
    def test_dir(self) -> str:
        return self.test_file.rsplit("/", 1)[0]

    @property
    def module(self) -> str:
        return self.source.removesuffix(".py").replace("/", ".").removeprefix("src.")


@pytest.fixture(scope="module", params=["toolz", "boltons"])
def case(request) -> Iterator[Case]:
    with reset_env(request.param) as (task, env):
        site = env.box().exec("python3 -c 'import _pytest, os; print(os.path.dirname(os.path.dirname("
                              "_pytest.__file__)))'").stdout.strip()
        mutation = task.metadata["mutation"]
        yield Case(task, env.pristine(), site, mutation["file"], mutation["function"])


def graded(case: Case, attack: Callable[[SandboxLike, Case], None], task: Task | None = None) -> GradeResult:
    """Grade what ``attack`` leaves in a sandbox at the task's pristine state, as SWEEnv grades."""
    with agentenv.Sandbox.restore(case.pristine.snapshot) as sb:
        attack(sb, case)
        return grade(sb, task or case.pristine.task, pristine=case.pristine.snapshot)


def gold(sb: SandboxLike, c: Case) -> None:
    sb.write_file("/tmp/gold.patch", c.task.patch)
    run(sb, "git apply /tmp/gold.patch && rm /tmp/gold.patch")


def evil_plugin_at(sb: SandboxLike, folder: str) -> None:
    sb.write_file(f"{folder}/agentenv_evil.py", HOOK)


# --- the attacks -----------------------------------------------------------------------------------

def conftest_at_root(sb, c):
    sb.write_file("/testbed/conftest.py", HOOK)


def conftest_beside_the_tests(sb, c):
    run(sb, f"cat >> {c.test_dir}/conftest.py <<'EOF'\n{HOOK}\nEOF")


def conftest_marks_every_test_xfail(sb, c):
    sb.write_file(f"/testbed/{c.test_dir}/conftest.py", XFAIL_ALL)


def plugin_by_entry_point_in_site_packages(sb, c):
    evil_plugin_at(sb, c.site)
    info = f"{c.site}/agentenv_evil-1.0.dist-info"
    sb.write_file(f"{info}/METADATA", "Metadata-Version: 2.1\nName: agentenv-evil\nVersion: 1.0\n")
    sb.write_file(f"{info}/entry_points.txt", "[pytest11]\nagentenv_evil = agentenv_evil\n")
    sb.write_file(f"{info}/RECORD", "")


def plugin_by_entry_point_in_testbed(sb, c):
    evil_plugin_at(sb, "/testbed")
    sb.write_file("/testbed/agentenv_evil-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: agentenv-evil\n"
                                                                    "Version: 1.0\n")
    sb.write_file("/testbed/agentenv_evil-1.0.dist-info/entry_points.txt", "[pytest11]\nevil = agentenv_evil\n")


REWRITE_LOG = r"sed -e 's/^\(FAILED\|ERROR\) \([^ ]*\).*/PASSED \2/'"


def python3_wrapper_earlier_on_path(sb, c):
    sb.write_file("/usr/local/bin/python3", f"#!/bin/sh\n/usr/bin/python3 \"$@\" 2>&1 | {REWRITE_LOG}\nexit 0\n",
                  mode=0o755)


def python3_itself_replaced(sb, c):
    real = run(sb, "readlink -f /usr/bin/python3").strip()
    run(sb, "rm /usr/bin/python3")
    sb.write_file("/usr/bin/python3", f"#!/bin/sh\n{real} \"$@\" 2>&1 | {REWRITE_LOG}\nexit 0\n", mode=0o755)


def pytest_edited_in_site_packages(sb, c):
    run(sb, f"cat >> {c.site}/_pytest/reports.py <<'EOF'\n{FORCE_PASSED}\nEOF")


def pytest_copied_into_testbed_and_edited(sb, c):
    run(sb, f"cp -r {c.site}/_pytest {c.site}/pytest /testbed/ && cat >> /testbed/_pytest/reports.py <<'EOF'\n"
            f"{FORCE_PASSED}\nEOF")


def fake_pytest_module_at_the_root(sb, c):
    lines = "".join(f"print('PASSED {t}')\n" for t in (*c.task.FAIL_TO_PASS, *c.task.PASS_TO_PASS))
    sb.write_file("/testbed/pytest.py", f"{lines}raise SystemExit(0)\n")


def sitecustomize_in_the_interpreter(sb, c):
    path = run(sb, "python3 -c 'import sitecustomize; print(sitecustomize.__file__)' 2>/dev/null || "
                   f"echo {c.site}/sitecustomize.py").strip()
    evil_plugin_at(sb, c.site)
    run(sb, f"rm -f {path} && printf 'import os\\nos.environ[\"PYTEST_ADDOPTS\"] = \"-p agentenv_evil\"\\n' > {path}")


def sitecustomize_in_testbed(sb, c):
    evil_plugin_at(sb, "/testbed")
    sb.write_file("/testbed/sitecustomize.py", "import os\nos.environ['PYTEST_ADDOPTS'] = '-p agentenv_evil'\n")


def usercustomize_for_root(sb, c):
    evil_plugin_at(sb, c.site)
    user = run(sb, "python3 -c 'import site; print(site.getusersitepackages())'").strip()
    sb.write_file(f"{user}/usercustomize.py", "import os\nos.environ['PYTEST_ADDOPTS'] = '-p agentenv_evil'\n")


def pth_in_site_packages(sb, c):
    evil_plugin_at(sb, c.site)
    sb.write_file(f"{c.site}/zz_agentenv.pth",
                  "import os; os.environ['PYTEST_ADDOPTS'] = '-p agentenv_evil'\n")


def pth_in_testbed(sb, c):
    evil_plugin_at(sb, "/testbed")
    sb.write_file("/testbed/zz_agentenv.pth", "import os; os.environ['PYTEST_ADDOPTS'] = '-p agentenv_evil'\n")


def ini_files_add_the_plugin(sb, c):
    evil_plugin_at(sb, "/testbed")
    sb.write_file("/testbed/pytest.ini", "[pytest]\naddopts = -p agentenv_evil\n")
    sb.write_file(f"/testbed/{c.test_dir}/tox.ini", "[pytest]\naddopts = -p agentenv_evil\n")
    run(sb, "printf '\\n[tool:pytest]\\naddopts = -p agentenv_evil\\n' >> setup.cfg; "
            "printf '\\n[tool.pytest.ini_options]\\naddopts = \"-p agentenv_evil\"\\n' >> pyproject.toml")


def delete_the_test_file(sb, c):
    run(sb, f"rm {c.test_file}")


def empty_the_test_file(sb, c):
    run(sb, f": > {c.test_file}")


def swap_the_test_file_for_a_link(sb, c):
    names = {t.split("::")[-1].split("[")[0] for t in (*c.task.FAIL_TO_PASS, *c.task.PASS_TO_PASS)}
    sb.write_file("/tmp/easy_tests.py", "".join(f"def {n}():\n    pass\n\n\n" for n in sorted(names)))
    run(sb, f"rm {c.test_file} && ln -s /tmp/easy_tests.py {c.test_file}")


def xfail_from_the_library(sb, c):
    owner, _, name = c.function.rpartition(".")
    target = f"setattr({owner}, {name!r}, _agentenv_known_bug)" if owner else f"{name} = _agentenv_known_bug"
    run(sb, f"cat >> {c.source} <<'EOF'\n\nimport pytest as _agentenv_p\n\n\ndef _agentenv_known_bug(*a, **k):\n"
            f"    _agentenv_p.xfail('known upstream bug')\n\n\n{target}\nEOF")


def exit_at_import_unnamed(sb, c):
    """os._exit(0) from the library at import, spelled so no word of the text rule appears."""
    run(sb, f"cat >> {c.source} <<'EOF'\n\ngetattr(__import__('o' + 's'), '_e' + 'xit')(0)\nEOF")


def result_file_written_by_the_library(sb, c):
    """The library writes an all-passed result file where pytest was told to, then leaves (no word of the rule)."""
    cases = "".join(f'<testcase classname="{".".join(t.split("::")[0].removesuffix(".py").split("/") + t.split("::")[1:-1])}"'
                    f' name="{t.split("::")[-1]}"/>' for t in (*c.task.FAIL_TO_PASS, *c.task.PASS_TO_PASS))
    xml = f'<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="s">{cases}</testsuite></testsuites>'
    run(sb, f"cat >> {c.source} <<'EOF'\n\nimport sys as _s\n_a = getattr(_s, 'ar' + 'gv')\n"
            f"_p = [x.split('=', 1)[1] for x in _a if x.startswith('--ju' + 'nitxml=')]\n"
            f"if _p:\n    open(_p[0], 'w').write({xml!r})\n    getattr(__import__('o' + 's'), '_e' + 'xit')(0)\nEOF")


def result_file_rewritten_after_the_run(sb, c):
    """A process left behind rewrites the result file once pytest has exited (keeping the rest as written)."""
    names = [t.split("::")[-1] for t in c.task.FAIL_TO_PASS]
    rewriter = ("import os, re, sys, time\npid, path = getattr(sys, 'ar' + 'gv')[1:3]\n"
                "while os.path.exists('/proc/' + pid):\n    time.sleep(0.05)\n"
                "data = open(path).read()\nfor n in " + json.dumps(names) + ":\n"
                "    data = re.sub(r'(<testcase[^>]*name=\"' + re.escape(n) + r'\"[^>]*?)>.*?</testcase>',"
                " r'\\1/>', data, flags=re.S)\nopen(path, 'w').write(data)\n")
    sb.write_file("/tmp/.rewriter.py", rewriter)
    run(sb, f"cat >> {c.source} <<'EOF'\n\nimport os as _o, subprocess as _sp, sys as _s\n"
            "_p = [x.split('=', 1)[1] for x in getattr(_s, 'ar' + 'gv') if x.startswith('--ju' + 'nitxml=')]\n"
            "if _p and _o.path.exists('/tmp/.rewriter.py'):\n"
            "    _sp.Popen([_s.executable, '/tmp/.rewriter.py', str(_o.getpid()), _p[0]], start_new_session=True)\n"
            "EOF")
    # the rewriter must be in /testbed to reach the grading sandbox: what else would an agent do
    run(sb, "cp /tmp/.rewriter.py /testbed/.rewriter.py && sed -i 's#/tmp/.rewriter.py#/testbed/.rewriter.py#g' "
            f"{c.source}")


def fake_result_files_in_the_agents_sandbox(sb, c):
    xml = "<testsuites><testsuite>" + "".join(f'<testcase classname="x" name="{t.split("::")[-1]}"/>'
                                              for t in c.task.FAIL_TO_PASS) + "</testsuite></testsuites>"
    for path in ("/var/lib/agentenv-grade-0000000000000000/junit.xml", "/tmp/junit.xml", "/testbed/junit.xml"):
        sb.write_file(path, xml)


def git_config_and_hooks(sb, c):
    """A repository whose config runs code and rewrites diffs when the grader's git reads it."""
    sb.write_file("/tmp/evil.sh", "#!/bin/sh\ntouch /tmp/pwned\nexit 0\n", mode=0o755)
    run(sb, "mkdir -p .git/hooks && cp /tmp/evil.sh .git/hooks/post-index-change && "
            "git config core.fsmonitor /tmp/evil.sh && git config diff.external /tmp/evil.sh && "
            "git config core.hooksPath .git/hooks && git config diff.noprefix true && "
            "printf '*.py diff=evil\\n' > .git/info/attributes && git config diff.evil.textconv /tmp/evil.sh")
    conftest_at_root(sb, c)


def git_binary_replaced(sb, c):
    """/usr/bin/git replaced: `git diff` answers a patch of its choosing, hiding a change git applies but a
    splitter on `diff --git` lines does not see: a traditional diff of the test file after the first file's
    hunk, redefining the failing test to pass (no word of the text rule in it)."""
    name = c.task.FAIL_TO_PASS[0].split("::")[-1]
    run(sb, f"printf '\\n\\ndef {name}():\\n    pass\\n' >> {c.test_file}")
    hidden = run(sb, f"git diff -- {c.test_file} | sed -n '/^--- /,$p'")
    run(sb, f"git checkout -q -- {c.test_file}")
    sb.write_file("/tmp/fake.patch", "diff --git a/NOTES.txt b/NOTES.txt\nnew file mode 100644\n--- /dev/null\n"
                                     "+++ b/NOTES.txt\n@@ -0,0 +1 @@\n+notes\n" + hidden)
    run(sb, "mv /usr/bin/git /usr/bin/git.real && printf '%s\\n' '#!/bin/sh' "
            "'for a in \"$@\"; do [ \"$a\" = diff ] && { cat /tmp/fake.patch; exit 0; }; done' "
            "'exec /usr/bin/git.real \"$@\"' > /usr/bin/git && chmod 755 /usr/bin/git")


def huge_patch(sb, c):
    run(sb, "head -c 12000000 /dev/urandom > blob.bin")


ATTACKS: list[tuple[Callable[[SandboxLike, Case], None], str]] = [
    # (attack, what must show in the result: a dropped reason, or words of the error)
    (conftest_at_root, "test-config"),
    (conftest_beside_the_tests, "test-config"),
    (conftest_marks_every_test_xfail, "test-config"),
    (plugin_by_entry_point_in_site_packages, ""),         # outside /testbed: nothing carries over
    (plugin_by_entry_point_in_testbed, "package-metadata"),
    (python3_wrapper_earlier_on_path, ""),
    (python3_itself_replaced, ""),
    (pytest_edited_in_site_packages, ""),
    (pytest_copied_into_testbed_and_edited, "shadows-module"),
    (fake_pytest_module_at_the_root, "shadows-module"),
    (sitecustomize_in_the_interpreter, ""),
    (sitecustomize_in_testbed, "startup-hook"),
    (usercustomize_for_root, ""),
    (pth_in_site_packages, ""),
    (pth_in_testbed, "startup-hook"),
    (ini_files_add_the_plugin, "test-config"),
    (delete_the_test_file, "test"),
    (empty_the_test_file, "test"),
    (swap_the_test_file_for_a_link, "test"),
    (xfail_from_the_library, "runner-reference"),
    (exit_at_import_unnamed, "no result file"),
    (result_file_written_by_the_library, "audit hook refused open"),  # the grading folder, from the patch
    (result_file_rewritten_after_the_run, "audit hook refused subprocess.Popen"),
    (fake_result_files_in_the_agents_sandbox, ""),
    (git_config_and_hooks, "test-config"),
    (git_binary_replaced, "does not mean the same"),
    (huge_patch, "over the"),
]


def explain(r: GradeResult) -> str:
    bad = {t: s for t, s in {**r.fail_to_pass, **r.pass_to_pass}.items() if s != "PASSED"}
    return f"error={r.error!r} dropped={[(d.path, d.reason) for d in r.dropped]} canary={r.canary} bad={bad}"


def test_the_gold_patch_scores_1(case):
    r = graded(case, gold)
    assert r.reward == 1.0 and r.canary == "FAILED" and not r.dropped and not r.tampering, explain(r)


@pytest.mark.parametrize(("attack", "shows"), ATTACKS, ids=[a.__name__ for a, _ in ATTACKS])
def test_a_tampering_attempt_scores_0(case, attack, shows):
    r = graded(case, attack)
    assert r.reward == 0.0, explain(r)
    if shows:
        assert shows in {d.reason for d in r.dropped} or shows in r.error, explain(r)
    assert not any(d.path.startswith(("/", "..")) for d in r.dropped)


def test_the_gold_patch_with_tampering_beside_it_still_scores_1(case):
    """Dropping what the rule drops never costs a right fix its reward; the attempt is still reported."""
    def both(sb, c):
        gold(sb, c)
        conftest_at_root(sb, c)
        sitecustomize_in_testbed(sb, c)
        empty_the_test_file(sb, c)

    r = graded(case, both)
    assert r.reward == 1.0 and r.tampering, explain(r)
    assert {(d.path, d.reason) for d in r.dropped} >= {("conftest.py", "test-config"),
                                                        ("sitecustomize.py", "startup-hook"), (case.test_file, "test")}


def test_git_in_the_agents_sandbox_runs_nothing_of_the_agents(case):
    with agentenv.Sandbox.restore(case.pristine.snapshot) as sb:
        gold(sb, case)
        git_config_and_hooks(sb, case)
        r = grade(sb, case.pristine.task, pristine=case.pristine.snapshot)
        assert r.reward == 1.0, explain(r)  # the gold fix came through, the conftest did not
        assert sb.exec("test -e /tmp/pwned").exit_code != 0


def test_editing_what_the_test_patch_adds_scores_0(case):
    """A task with a test patch (a new test that needs the fix): the agent's version of that test is dropped."""
    test_name = case.task.FAIL_TO_PASS[0].split("::")[-1]
    with agentenv.Sandbox.restore(case.pristine.snapshot) as sb:
        run(sb, f"printf '\\n\\ndef test_agentenv_added():\\n    {test_name}()\\n' >> {case.test_file}")
        test_patch = run(sb, "git diff")
    task = dataclasses.replace(case.pristine.task, test_patch=test_patch,
                               FAIL_TO_PASS=(*case.task.FAIL_TO_PASS, f"{case.test_file}::test_agentenv_added"))

    def edit_the_added_test(sb, c):
        run(sb, f"printf '\\n\\ndef test_agentenv_added():\\n    pass\\n' >> {c.test_file}")

    r = graded(case, edit_the_added_test, task)
    assert r.reward == 0.0 and ("test" in {d.reason for d in r.dropped}), explain(r)
    r = graded(case, gold, task)
    assert r.reward == 1.0 and r.fail_to_pass[f"{case.test_file}::test_agentenv_added"] == "PASSED", explain(r)


def test_the_issues_reproduction_through_the_env_scores_0_and_is_reported(case):
    """Issue 9: a conftest.py hook wrapper that sets every outcome to passed, then submit without touching the bug."""
    with SWEEnv(task=case.task) as env:
        env.reset()
        env.step({"name": "create", "arguments": {"path": "conftest.py", "file_text": HOOK}})
        obs, reward, terminated, _, info = env.step({"name": "submit", "arguments": {}})
        assert reward == 0.0 and terminated and not info["resolved"]
        assert info["grading"]["tampering"] is True
        assert info["grading"]["dropped"][0]["path"] == "conftest.py"
        assert info["grading"]["dropped"][0]["reason"] == "test-config"
        assert "not graded: conftest.py (test-config)" in obs
        assert "conftest.py" in info["patch"]
