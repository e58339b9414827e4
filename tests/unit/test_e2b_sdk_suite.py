"""bench.e2b_sdk_suite without Docker: grouping, junit -> JSON, taking the tests out of a git repository, argument
errors. The repositories here are tiny ones made in tmp_path with real git."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from bench import e2b_sdk_suite as suite

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="7">
<testcase classname="tests.sync.sandbox_sync.test_kill" name="test_kill" time="0.1"/>
<testcase classname="tests.async.sandbox_async.commands.test_run" name="test_run[x]" time="0.2">
  <failure message="AssertionError: assert 1 == 2&#10;second line">trace</failure></testcase>
<testcase classname="tests.async.sandbox_async.commands.test_run" name="test_other" time="0.2">
  <error message="">fixture 'x' not found&#10;more</error></testcase>
<testcase classname="tests.sync.sandbox_sync.pty.test_pty.TestPty" name="test_in_class" time="0.0">
  <skipped message="no pty here"/></testcase>
<testcase classname="tests.sync.sandbox_sync.pty.test_pty.TestPty" name="test_teardown" time="0.0">
  <failure message="boom"/><error message="teardown too"/></testcase>
<testcase classname="tests.gone.test_nowhere" name="test_lost" time="0.0"/>
<testcase classname="" name="tests.sync.sandbox_sync.test_kill" time="0.0">
  <error message="collection failure">ImportError: cannot import name 'x'</error></testcase>
</testsuite></testsuites>"""

FILES = {"sync/sandbox_sync/test_kill.py": "kill", "async/sandbox_async/commands/test_run.py": "commands",
         "sync/sandbox_sync/pty/test_pty.py": "pty"}


@pytest.mark.parametrize(("rel", "group"), [
    ("sync/sandbox_sync/commands/test_run.py", "commands"),
    ("async/sandbox_async/files/test_read.py", "files"),
    ("sync/sandbox_sync/pty/test_pty.py", "pty"),
    ("async/api_async/test_sbx_kill.py", "api"),
    ("sync/sandbox_sync/test_kill.py", "kill"),
    ("async/sandbox_async/test_snapshot_filesystem_only.py", "snapshots"),
    ("sync/template_sync/methods/test_run_cmd.py", "templates"),
    ("sync/sandbox_sync/test_host.py", "network"),
    ("sync/sandbox_sync/test_config_propagation.py", "sandbox"),
    ("test_paginator.py", "offline"),
    ("shared/git/test_add.py", "git"),
    ("shared/sandbox/test_network_transform.py", "offline"),
    ("elsewhere/test_x.py", None),
])
def test_group_of_a_file_is_the_first_pattern_that_matches(rel: str, group: str | None) -> None:
    assert suite.group_of(rel) == group


def test_junit_cases_go_to_their_files_groups_with_the_first_line_of_the_message() -> None:
    cases = suite.read_junit(JUNIT, FILES)
    got = [(c.group, c.test, c.outcome, c.message) for c in cases]
    assert got == [
        ("kill", "sync/sandbox_sync/test_kill.py::test_kill", "passed", ""),
        ("commands", "async/sandbox_async/commands/test_run.py::test_run[x]", "failed", "AssertionError: assert 1 == 2"),
        ("commands", "async/sandbox_async/commands/test_run.py::test_other", "errors", "fixture 'x' not found"),
        ("pty", "sync/sandbox_sync/pty/test_pty.py::test_in_class", "skipped", "no pty here"),
        ("pty", "sync/sandbox_sync/pty/test_pty.py::test_teardown", "failed", "boom"),  # failure wins over error
        ("?", "tests.gone.test_nowhere::test_lost", "passed", ""),
        ("kill", "sync/sandbox_sync/test_kill.py::<collection>", "errors", "collection failure"),  # not importable
    ]


def test_summary_counts_per_group_in_the_order_asked_and_lists_the_problems() -> None:
    groups = suite.summarize(suite.read_junit(JUNIT, FILES), ["pty", "commands", "kill", "fork"])
    assert list(groups) == ["pty", "commands", "kill", "fork", "?"]
    assert {k: groups["commands"][k] for k in ("passed", "failed", "errors", "skipped")} == \
        {"passed": 0, "failed": 1, "errors": 1, "skipped": 0}
    assert [p["outcome"] for p in groups["commands"]["problems"]] == ["failed", "errors"]
    assert groups["fork"] == {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "problems": []}
    assert suite.totals(groups) == {"passed": 2, "failed": 2, "skipped": 1, "errors": 2, "total": 7}


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                          capture_output=True, text=True).stdout.strip()


def _repo(tmp_path: Path) -> tuple[Path, Path, str, str]:
    """A checkout with two commits of a python-sdk tests tree, and a bare clone of it."""
    src = tmp_path / "src"
    sdk = src / suite.SDK
    (sdk / "tests/sync/sandbox_sync").mkdir(parents=True)
    (sdk / "pytest.ini").write_text("[pytest]\n")
    (sdk / "pyproject.toml").write_text('[project]\nname = "e2b"\nversion = "9.9.9"\n')
    (sdk / "tests/sync/sandbox_sync/test_kill.py").write_text("def test_one(): pass\n")
    (src / "README.md").write_text("not taken\n")
    _git(tmp_path, "init", "-q", str(src))
    _git(src, "add", "-A")
    _git(src, "commit", "-qm", "one")
    first = _git(src, "rev-parse", "HEAD")
    (sdk / "tests/sync/sandbox_sync/test_kill.py").write_text("def test_two(): pass\n")
    _git(src, "commit", "-qam", "two")
    second = _git(src, "rev-parse", "HEAD")
    bare = tmp_path / "bare.git"
    _git(tmp_path, "clone", "-q", "--bare", str(src), str(bare))
    return src, bare, first, second


def test_a_bare_repository_gives_its_head_or_the_rev_asked(tmp_path: Path) -> None:
    _, bare, first, second = _repo(tmp_path)
    sdk, commit = suite.extract(bare, None, tmp_path / "head")
    assert commit == second
    assert (sdk / "tests/sync/sandbox_sync/test_kill.py").read_text() == "def test_two(): pass\n"
    assert (sdk / "pytest.ini").exists() and not (tmp_path / "head/README.md").exists()
    assert suite.sdk_version(sdk) == "9.9.9"
    assert suite.test_files(sdk / "tests") == {"sync/sandbox_sync/test_kill.py": "kill"}
    sdk, commit = suite.extract(bare, first[:10], tmp_path / "old")
    assert commit == first
    assert (sdk / "tests/sync/sandbox_sync/test_kill.py").read_text() == "def test_one(): pass\n"


def test_a_checkout_is_taken_as_it_is_on_disk_or_at_a_rev(tmp_path: Path) -> None:
    src, _, first, _ = _repo(tmp_path)
    (src / suite.SDK / "tests/sync/sandbox_sync/test_kill.py").write_text("# uncommitted\n")
    sdk, commit = suite.extract(src, None, tmp_path / "wt")
    assert commit == "worktree"
    assert (sdk / "tests/sync/sandbox_sync/test_kill.py").read_text() == "# uncommitted\n"
    sdk, commit = suite.extract(src, first, tmp_path / "at")
    assert commit == first
    assert (sdk / "tests/sync/sandbox_sync/test_kill.py").read_text() == "def test_one(): pass\n"


def test_repositories_that_cannot_give_the_tests_are_refused_clearly(tmp_path: Path) -> None:
    _, bare, _, _ = _repo(tmp_path)
    with pytest.raises(suite.SuiteError, match="--rev nope"):
        suite.extract(bare, "nope", tmp_path / "x")
    with pytest.raises(suite.SuiteError, match="no such folder"):
        suite.extract(tmp_path / "missing", None, tmp_path / "y")
    (tmp_path / "plain").mkdir()
    with pytest.raises(suite.SuiteError, match="neither a checkout"):
        suite.extract(tmp_path / "plain", None, tmp_path / "z")
    other = tmp_path / "other"
    _git(tmp_path, "init", "-q", str(other))
    (other / "f").write_text("x")
    _git(other, "add", "-A")
    _git(other, "commit", "-qm", "x")
    with pytest.raises(suite.SuiteError, match="has no packages/python-sdk/tests"):
        suite.extract(other, "HEAD", tmp_path / "w")


def test_no_repository_is_an_error_naming_the_option(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("AGENTENV_E2B_REPO", raising=False)
    with pytest.raises(suite.SuiteError, match="--e2b-repo"):
        suite.run(suite.parse_args([]))
    assert suite.main([]) == 2
    assert "--e2b-repo" in capsys.readouterr().out


def test_the_environment_variable_names_the_repository(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AGENTENV_E2B_REPO", str(tmp_path))
    assert suite.parse_args([]).e2b_repo == tmp_path
    assert suite.parse_args(["--e2b-repo", "/x"]).e2b_repo == Path("/x")


def test_groups_are_checked_and_the_offline_ones_run_only_when_named() -> None:
    assert "offline" not in suite.parse_groups(None) and "commands" in suite.parse_groups(None)
    assert suite.parse_groups("pty, fork") == ["pty", "fork"]
    assert suite.parse_groups("offline") == ["offline"]
    with pytest.raises(suite.SuiteError, match="unknown group.*'nope'.*commands"):
        suite.parse_groups("pty,nope")
    with pytest.raises(suite.SuiteError, match="unknown group"):
        suite.parse_groups(",")


def test_the_pytest_child_sees_our_server_and_none_of_the_callers_e2b_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("E2B_DOMAIN", "e2b.app")
    monkeypatch.setenv("E2B_DEBUG", "1")
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    env = suite.pytest_env("http://127.0.0.1:1", "tok")
    assert (env["E2B_API_URL"], env["E2B_SANDBOX_URL"], env["E2B_API_KEY"]) == ("http://127.0.0.1:1",) * 2 + ("tok",)
    assert "E2B_DOMAIN" not in env and "E2B_DEBUG" not in env and "PYTHONPATH" not in env
    offline = suite.pytest_env(None, None)  # the SDK's own unit tests assume its defaults
    assert not [k for k in offline if k.startswith("E2B_")] and "PYTHONPATH" not in offline


def test_list_groups_prints_every_group(capsys: pytest.CaptureFixture[str]) -> None:
    assert suite.main(["--list-groups"]) == 0
    out = capsys.readouterr().out
    assert all(g in out for g in suite.GROUPS)


def test_only_snapshots_of_recorded_templates_are_kept_by_design(tmp_path: Path) -> None:
    def snapshot(name: str, labels: dict[str, str]) -> None:
        (tmp_path / "snapshots" / name).mkdir(parents=True)
        (tmp_path / "snapshots" / name / "meta.json").write_text(json.dumps({"id": name, "labels": labels}))

    (tmp_path / "e2b-templates" / "templates").mkdir(parents=True)
    (tmp_path / "e2b-templates" / "templates" / "t1.json").write_text("{}")
    snapshot("snap-a", {"agentenv.kind": "e2b-template", "e2b.template": "t1"})   # its template is recorded
    snapshot("snap-b", {"agentenv.kind": "e2b-template", "e2b.template": "gone"})  # its template is not: a leak
    snapshot("snap-c", {"e2b.template": "t1"})                                       # not a template's snapshot
    assert suite.template_snapshots(tmp_path) == 1
