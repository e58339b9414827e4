"""The task sandbox: the scrub leaves no future in git (run here on a real repository), "HEAD" base commits
resolve at reset, and a missing image or a base commit the image lacks say what to do."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from agentenv.errors import ImageNotFound
from envs.task import Task
from envs.task_sandbox import SCRUB, SetupError, TaskImageMissing, start_task, start_task_sandbox

from .fakes import HEAD, FakeBackend

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
ENV = {**os.environ, "GIT_AUTHOR_NAME": "a", "GIT_AUTHOR_EMAIL": "a@x", "GIT_COMMITTER_NAME": "a",
       "GIT_COMMITTER_EMAIL": "a@x", "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_CONFIG_NOSYSTEM": "1"}
FIX = "def f():\n    return 'the fix, only in the future'\n"


def git(repo, *args, check=True):
    r = subprocess.run(["git", *args], cwd=repo, env=ENV, capture_output=True, text=True, check=False)
    assert r.returncode == 0 or not check, r.stderr
    return r.stdout.strip()


def scrub(repo):
    return subprocess.run(["sh", "-c", SCRUB], cwd=repo, env=ENV, capture_output=True, text=True, check=False)


@pytest.fixture
def repo_with_a_future(tmp_path):
    """base (HEAD, on main) <- fix; a tag and an annotated tag on the fix, a branch, a remote-tracking ref,
    a stash, notes, ORIG_HEAD and reflog entries that name the fix; packed and loose refs."""
    r = tmp_path / "repo"
    r.mkdir()
    git(r, "init", "-q", "-b", "main")
    (r / "m.py").write_text("def f():\n    return 'bug'\n")
    git(r, "add", "-A")
    git(r, "commit", "-qm", "base")
    base = git(r, "rev-parse", "HEAD")
    (r / "m.py").write_text(FIX)
    git(r, "commit", "-qam", "the fix")
    fix = git(r, "rev-parse", "HEAD")
    git(r, "tag", "v2")
    git(r, "tag", "-a", "v2-annotated", "-m", "release with the fix")
    git(r, "branch", "feature")
    git(r, "notes", "add", "-m", "fixed here", fix)
    git(r, "remote", "add", "origin", "https://example.invalid/repo.git")
    git(r, "update-ref", "refs/remotes/origin/main", fix)
    git(r, "pack-refs", "--all")
    (r / "m.py").write_text(FIX + "# work in progress\n")
    git(r, "stash", "-q")
    git(r, "reset", "-q", "--hard", base)
    blob = git(r, "hash-object", "m.py")  # m.py at base
    fix_blob = subprocess.run(["git", "hash-object", "--stdin"], input=FIX, cwd=r, env=ENV, capture_output=True,
                              text=True, check=True).stdout.strip()
    assert git(r, "cat-file", "-t", fix_blob) == "blob" and fix[:7] in git(r, "reflog")
    return r, base, fix, fix_blob, blob


def test_the_scrub_leaves_nothing_past_the_base_commit(repo_with_a_future):
    r, base, fix, fix_blob, blob = repo_with_a_future
    res = scrub(r)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.split()[-1] == "repacked"
    assert git(r, "rev-parse", "HEAD") == base and git(r, "status", "--porcelain") == ""
    assert git(r, "log", "--all", "--format=%H") == base
    assert git(r, "for-each-ref", "--format=%(refname)") == "refs/heads/main"
    assert git(r, "tag") == "" and git(r, "stash", "list") == "" and git(r, "reflog") == ""
    assert git(r, "remote") == "" and git(r, "notes", "list", check=False) == ""
    for obj in (fix, fix_blob):
        assert subprocess.run(["git", "cat-file", "-e", obj], cwd=r, env=ENV, check=False).returncode != 0
    listed = git(r, "cat-file", "--batch-all-objects", "--batch-check=%(objectname)").split()
    assert fix not in listed and fix_blob not in listed and base in listed and blob in listed
    leftovers = [p for p in (r / ".git").rglob("*") if p.is_file() and fix.encode() in p.read_bytes()]
    assert not leftovers  # no stale packed-refs line, ORIG_HEAD, reflog or commit-graph names it


def test_a_scrubbed_state_is_trusted_only_while_nothing_changed(repo_with_a_future):
    """An image-level scrub records the state it left: the next scrub skips counting objects, unless an
    object, a ref or HEAD changed since."""
    r, base, fix, fix_blob, _blob = repo_with_a_future
    assert scrub(r).stdout.split()[-1] == "repacked"
    assert scrub(r).stdout.split()[-1] == "marked"
    subprocess.run(["git", "hash-object", "-w", "--stdin"], input=FIX, cwd=r, env=ENV, text=True, check=True,
                   capture_output=True)  # the fix's blob is back, dangling
    assert scrub(r).stdout.split()[-1] == "repacked"
    assert subprocess.run(["git", "cat-file", "-e", fix_blob], cwd=r, env=ENV, check=False).returncode != 0
    git(r, "tag", "later")
    res = scrub(r)
    assert res.stdout.split()[-1] == "marked" and git(r, "tag") == ""  # refs are always cleaned


def test_a_detached_head_loses_every_branch(repo_with_a_future):
    r, base, fix, _fix_blob, _blob = repo_with_a_future
    git(r, "checkout", "-q", "feature")  # at the fix
    git(r, "checkout", "-q", base)
    assert scrub(r).returncode == 0
    assert git(r, "for-each-ref") == "" and git(r, "log", "--all", "--format=%H") == base


def test_a_repository_with_only_its_base_is_not_repacked(tmp_path):
    git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-qm", "base")
    res = scrub(tmp_path)
    assert res.returncode == 0 and res.stdout.split()[-1] == "counted", res.stdout + res.stderr
    assert not (tmp_path / ".git" / "logs").exists()


def task(**over):
    rec = {"instance_id": "t__1", "repo": "pypi/demo", "version": "1.0", "base_commit": "HEAD", "problem_statement": "p",
           "patch": "--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n-a\n+b\n", "FAIL_TO_PASS": ["t.py::t"]}
    return Task.from_json({**rec, **over})


def test_a_head_base_commit_is_resolved_at_reset():
    backend = FakeBackend()
    sb, resolved = start_task(task(), backend)
    assert resolved.base_commit == HEAD and resolved.instance_id == "t__1" and task().base_is_head
    assert any("agentenv-scrub" in c for c in sb.commands)  # the scrub ran after the setup
    pinned = task(base_commit=HEAD)
    sb2, same = start_task(pinned, backend)
    assert same is pinned and start_task_sandbox(pinned, backend).state == "running"


def test_a_missing_image_names_the_field_repository_version_and_the_command():
    backend = FakeBackend()

    def missing(image, **kw):
        raise ImageNotFound(image, [])

    backend.Sandbox.create = missing
    with pytest.raises(TaskImageMissing) as e:
        start_task(task(), backend)
    msg = str(e.value)
    assert e.value.field == "image" and e.value.image == "agentenv/swe-demo:1.0" and isinstance(e.value, SetupError)
    assert "'pypi/demo'" in msg and "'1.0'" in msg and "agentenv tasks images --libraries" in msg
    assert '"name": "demo", "version": "1.0"' in msg


def test_a_base_commit_the_image_lacks_says_how_to_find_the_right_one():
    backend = FakeBackend()
    with pytest.raises(SetupError) as e:
        start_task(task(base_commit="ab" * 20, setup_commands=["false"]), backend)
    assert "base-commit agentenv/swe-demo:1.0" in str(e.value) and '"HEAD"' in str(e.value)
    assert not backend.sandboxes  # closed
    with pytest.raises(SetupError, match="not the base commit"):
        start_task(task(base_commit="ab" * 20, setup_commands=["true"]), backend)
