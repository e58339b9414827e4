"""validate: a task that cannot be set up is a FAIL with its reason and the others still run; the wrong
patch edits the files the gold patch touches; missing images say how to build them; base-commit."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from envs.grading import GradeResult
from envs.task import Task
from envs.task_sandbox import SetupError
from envs.tasks import __main__ as cli
from envs.tasks import validate as checks

from .fakes import FakeSandbox, result

GOLD = "diff --git a/pkg/core.py b/pkg/core.py\n--- a/pkg/core.py\n+++ b/pkg/core.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n"


def task(tid="demo__1", **over):
    rec = {"instance_id": tid, "repo": "pypi/demo", "version": "1.0", "base_commit": "HEAD", "patch": GOLD,
           "problem_statement": "x is 1", "FAIL_TO_PASS": ["tests/test_core.py::test_x"]}
    return Task.from_json({**rec, **over})


class Recorder(FakeSandbox):
    def exec(self, command, **kw):
        self.commands.append(command)
        return result("")


def fake_grading(monkeypatch, fail_setup=()):
    """start_task and grade replaced: setup fails for the ids in ``fail_setup``; the gold patch resolves."""
    seen: list[tuple[str, Task]] = []

    def start(t, **kw):
        if t.instance_id in fail_setup:
            raise SetupError(f"task {t.instance_id}: setup command failed (128): fatal: reference is not a tree")
        return Recorder(), Task.from_json({**t.to_json(), "base_commit": "c0ffee0"})

    def grade(sb, t, timeout):
        last = sb.commands[-1] if len(sb.commands) > 1 else ""
        seen.append((last, t))
        resolved = "git apply" in last
        return GradeResult(resolved=resolved, fail_to_pass={}, pass_to_pass={}, patch="")

    monkeypatch.setattr(checks, "start_task", start)
    monkeypatch.setattr(checks, "grade", grade)
    return seen


def test_a_task_that_cannot_be_set_up_fails_alone_and_the_run_goes_on(monkeypatch):
    seen = fake_grading(monkeypatch, fail_setup={"demo__1"})
    logs: list[str] = []
    verdicts = checks.validate([task("demo__1"), task("demo__2")], log=logs.append)
    assert [v.ok for v in verdicts] == [False, True]
    assert "reference is not a tree" in verdicts[0].detail and logs[0].startswith("[validate] FAIL demo__1: setup")
    assert {t.base_commit for _, t in seen} == {"c0ffee0"}  # grading got the resolved base commit


def test_the_wrong_patch_edits_the_files_the_gold_patch_touches(monkeypatch):
    seen = fake_grading(monkeypatch)
    [v] = checks.validate([task()], log=lambda _m: None)
    assert v.ok, v.detail
    [noop] = [c for c, _ in seen if "not a fix" in c]
    assert "pkg/core.py" in noop and "tests/test_core.py" not in noop


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_noop_edit_changes_the_gold_files_and_nothing_else(tmp_path):
    subprocess.run("git init -q && mkdir pkg tests && echo 'x = 1' > pkg/core.py && echo ok > tests/test_core.py"
                   " && git add -A && git -c user.name=a -c user.email=a@x commit -qm base", shell=True, cwd=tmp_path,
                   check=True)
    r = subprocess.run(["sh", "-c", checks.noop_edit(task())], cwd=tmp_path, capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    changed = subprocess.run(["git", "status", "--porcelain"], cwd=tmp_path, capture_output=True, text=True,
                             check=True).stdout.split()
    assert changed == ["M", "pkg/core.py"]
    assert (tmp_path / "pkg/core.py").read_text() == "x = 1\n\n# agentenv: not a fix\n"
    compile((tmp_path / "pkg/core.py").read_text(), "core.py", "exec")


def test_validate_reports_missing_images_with_the_command_and_exits_non_zero(tmp_path, monkeypatch, capsys):
    fake_grading(monkeypatch)
    monkeypatch.setattr("envs.images.image_exists", lambda image: image == "agentenv/swe-present:1.0")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(t.to_json()) + "\n" for t in (
        task("demo__1"), task("other__1", repo="owner/other"), task("present__1", repo="pypi/present"))))
    libs = tmp_path / "libs.json"
    libs.write_text(json.dumps({"libraries": [{"name": "demo", "version": "1.0", "sha256": "0" * 64}]}))
    rc = cli.main(["validate", "--tasks", str(tasks), "--libraries", str(libs), "--no-images"])
    out = capsys.readouterr().out
    assert rc == 1 and "Traceback" not in out
    assert f"FAIL demo__1: image agentenv/swe-demo:1.0 is missing: build it with `agentenv tasks images " \
           f"--libraries {libs}`" in out
    assert "FAIL other__1: image agentenv/swe-owner__other:1.0 is missing: no library in" in out
    assert '"repo": "owner/other"' in out and "ok   present__1" in out and "1/3 tasks valid" in out


def test_base_commit_prints_the_images_commit(monkeypatch, capsys):
    monkeypatch.setattr("envs.images.image_head", lambda image: "f" * 40)
    assert cli.main(["base-commit", "agentenv/swe-six:1.16.0"]) == 0
    assert capsys.readouterr().out == f"agentenv/swe-six:1.16.0 {'f' * 40}\n"


def test_base_commit_of_a_missing_image_says_how_to_build_it(monkeypatch, capsys):
    monkeypatch.setattr("envs.images.image_exists", lambda image: False)
    assert cli.main(["base-commit", "agentenv/swe-six:1.16.0"]) == 2
    err = capsys.readouterr().err
    assert "not on this host" in err and "agentenv tasks images --libraries" in err
    assert '"name": "six", "version": "1.16.0"' in err and "Traceback" not in err


def test_records_are_validated_in_parallel_and_summed_up_in_tables(monkeypatch):
    """Two workers: both records are set up before either is graded (a barrier that one worker would never pass);
    the tables show, per record, what each patch graded and the official agreement, and per runner the counts."""
    import threading

    from envs.grading.runners.verdicts import verdict

    both = threading.Barrier(2, timeout=60)

    def start(t, **kw):
        both.wait()
        return Recorder(), t

    def grade(sb, t, timeout):
        resolved = "git apply" in (sb.commands[-1] if len(sb.commands) > 1 else "")
        report = verdict("swebench-4", {"tests/test_core.py::test_x": "PASSED" if resolved else "FAILED"},
                         t.FAIL_TO_PASS, ())
        return GradeResult(resolved=resolved, fail_to_pass={}, pass_to_pass={}, patch="", runner="swebench",
                           mode="swebench-4", ours=report, official=report)

    monkeypatch.setattr(checks, "start_task", start)
    monkeypatch.setattr(checks, "grade", grade)
    verdicts = checks.validate([task("demo__1"), task("demo__2")], workers=2, log=lambda _m: None)
    assert [v.instance_id for v in verdicts] == ["demo__1", "demo__2"] and all(v.ok for v in verdicts)
    rows = checks.table(verdicts)
    assert rows[0].split()[:8] == ["record", "dataset", "runner/mode", "gold", "empty", "no-op", "tests-rm", "official"]
    assert rows[1].split()[:8] == ["demo__1", "agentenv", "swebench/swebench-4", "yes", "no", "no", "no", "agrees"]
    assert rows[-1].split() == ["swebench/swebench-4", "2", "2", "0", "2/2"]
