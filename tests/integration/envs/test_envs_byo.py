"""Bring your own task, end to end, with a library the project does not ship (six, from PyPI):
a libraries file -> ``images --libraries`` (prints the base commit) -> a hand-written task record with an
injected bug -> ``validate --libraries --tasks`` -> an SWEEnv episode that the gold patch resolves. And the
scrub: a repository with a future commit, tags, a stash and reflog entries keeps none of them at reset.

It builds one image, agentenv/swe-six:1.16.0, cached by its inputs like the shipped ones (kept for later
runs); everything else it writes lives in pytest's tmp_path.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import re
import shlex
import tarfile

import pytest

from envs.grading import grade
from envs.images import fetch_sdist, image_exists
from envs.swe_env import SWEEnv
from envs.task import Task, load_tasks
from envs.task_sandbox import SetupError, TaskImageMissing, start_task
from envs.tasks import __main__ as cli
from envs.tasks import build
from envs.tasks.validate import validate

pytestmark = pytest.mark.integration

SIX = {"name": "six", "version": "1.16.0", "sha256": "1e61c37477a1626458e36f7b1d82aa5c9b094fa4802892072e49de9c60c4c926"}
IMAGE = "agentenv/swe-six:1.16.0"
# The injected bug: six.b encodes with UTF-8 instead of Latin-1, so six.b("\xff") is two bytes.
GOLD = """\
diff --git a/six.py b/six.py
--- a/six.py
+++ b/six.py
@@ -643,3 +643,3 @@ if PY3:
     def b(s):
-        return s.encode("utf-8")
+        return s.encode("latin-1")
\x20
"""
RECORD = {
    "instance_id": "six-1.16.0__b_latin1", "repo": "pypi/six", "version": "1.16.0",  # image: by the naming rule
    "base_commit": "HEAD", "patch": GOLD, "test_patch": "",
    "problem_statement": "six.b('\\xff') returns b'\\xc3\\xbf' (two bytes) on Python 3; it should be the single "
                         "byte b'\\xff', as on Python 2.",
    "FAIL_TO_PASS": json.dumps(["test_six.py::test_b"]),  # JSON-encoded, as SWE-bench publishes it
    "PASS_TO_PASS": json.dumps(["test_six.py::test_u", "test_six.py::test_u_escapes", "test_six.py::test_int2byte",
                                "test_six.py::test_byte2int", "test_six.py::test_add_metaclass"]),
    "setup_commands": build.setup_commands(GOLD),  # inject the bug into the pristine image, one fresh commit
    "created_at": "2024-01-01T00:00:00Z",
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("byo")
    (d / "libraries.json").write_text(json.dumps({"libraries": [SIX]}))
    (d / "tasks.jsonl").write_text(json.dumps(RECORD) + "\n")
    return d / "libraries.json", d / "tasks.jsonl"


@pytest.fixture(scope="module")
def image_commit(files):
    libraries, tasks = files
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli.main(["images", "--libraries", str(libraries), "--tasks", str(tasks)]) == 0, buf.getvalue()
    m = re.search(rf"{re.escape(IMAGE)} .*base commit ([0-9a-f]{{40}})", buf.getvalue())
    assert m, buf.getvalue()
    return m.group(1)


@pytest.fixture(scope="module")
def task(files, image_commit):
    [t] = load_tasks(files[1])
    return t


def test_the_image_is_built_from_a_libraries_file_and_shows_its_base_commit(image_commit, capsys):
    assert image_exists(IMAGE)
    assert cli.main(["base-commit", IMAGE]) == 0
    assert capsys.readouterr().out == f"{IMAGE} {image_commit}\n"


def test_the_record_loads_as_written(task):
    assert task.image == IMAGE and task.base_is_head and task.FAIL_TO_PASS == ("test_six.py::test_b",)
    assert task.metadata == {"created_at": "2024-01-01T00:00:00Z"}


def test_validate_with_libraries_and_tasks_passes(files, image_commit, capsys):
    libraries, tasks = files
    assert cli.main(["validate", "--libraries", str(libraries), "--tasks", str(tasks)]) == 0, capsys.readouterr().out
    assert "1/1 tasks valid" in capsys.readouterr().out


def test_an_swe_env_episode_is_resolved_by_the_gold_patch(task):
    with SWEEnv(task=task) as env:
        obs, _ = env.reset()
        assert "six.b" in obs
        env.step({"name": "create", "arguments": {"path": "/testbed/.fix.patch", "file_text": task.patch}})
        obs, *_ = env.step({"name": "bash", "arguments": {"command": "git apply .fix.patch && rm .fix.patch && "
                                                                      "echo applied"}})
        assert "applied" in obs
        obs, reward, terminated, _, info = env.step({"name": "submit", "arguments": {}})
        assert (reward, terminated, info["resolved"]) == (1.0, True, True), obs
        assert info["FAIL_TO_PASS"] == {"test_six.py::test_b": "PASSED"} and 'latin-1' in info["patch"]


def test_grading_diffs_against_the_resolved_base_even_after_the_agent_commits(task, image_commit):
    sb, resolved = start_task(task)
    try:
        assert re.fullmatch(r"[0-9a-f]{40}", resolved.base_commit) and resolved.base_commit != image_commit
        sb.write_file("/tmp/fix.patch", task.patch)
        r = sb.exec("git apply /tmp/fix.patch && git commit -qam 'my fix' && git log --oneline | wc -l",
                    cwd="/testbed")
        assert r.stdout.strip() == "2", r
        res = grade(sb, resolved)
        assert res.resolved and 'latin-1' in res.patch  # the commit is part of the agent's change
    finally:
        sb.close()


def fix_blob() -> str:
    """The git blob id of six.py with the fix (the pristine sdist's file), computed here from the sdist."""
    with tarfile.open(fetch_sdist(SIX["name"], SIX["version"], SIX["sha256"])) as tar:
        member = tar.extractfile("six-1.16.0/six.py")
        assert member is not None
        data = member.read()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def assert_no_future(sb, base: str) -> None:
    """/testbed is at ``base``, and nothing past it is reachable, listable or readable."""
    blob = fix_blob()

    def sh(cmd: str) -> str:
        return str(sb.exec(cmd, cwd="/testbed").stdout).strip()

    assert sh("git rev-parse HEAD") == base
    assert sh("git log --all --format=%H") == base  # one commit, from any ref
    assert sh("git tag; git stash list; git reflog; git remote; ls .git/ORIG_HEAD .git/logs 2>/dev/null") == ""
    assert sh("git for-each-ref --format='%(refname)'") in ("refs/heads/main", "")
    listed = sh("git cat-file --batch-all-objects --batch-check='%(objecttype) %(objectname)'").splitlines()
    assert sum(line.startswith("commit ") for line in listed) == 1 and not any(blob in x for x in listed)
    assert sb.exec(f"git cat-file -p {shlex.quote(blob)}", cwd="/testbed").exit_code != 0
    assert "latin-1" not in sh("git grep -h 'encode(\"latin' $(git rev-list --all) 2>/dev/null; true")


def test_the_repository_keeps_no_future_at_reset(task):
    """Setup commands that leave a future: a commit (the fix) on the branch and in tags, a stash on top of
    it, reflog entries, ORIG_HEAD and a remote. After reset none is reachable or listable and the fix's
    blob cannot be read."""
    future = [*build.setup_commands(GOLD),  # the base: the bug, one commit
              f"git apply --whitespace=nowarn <<'{build.PATCH_EOF}'\n{GOLD}{build.PATCH_EOF}",
              "git commit -qam 'fix six.b' && git tag v1.16.1 && git tag -a v1.16.1-ann -m release",
              "git remote add origin https://example.invalid/six.git && git update-ref refs/remotes/origin/main HEAD",
              "echo '# wip' >> six.py && git stash -q && git reset -q --hard HEAD~1"]
    history = Task.from_json({**task.to_json(), "instance_id": "six-1.16.0__history", "setup_commands": future})
    sb, resolved = start_task(history)
    try:
        assert_no_future(sb, resolved.base_commit)
    finally:
        sb.close()
    with SWEEnv(task=history) as env:  # the bug is still the bug: the unchanged repository is not resolved
        env.reset()
        assert env.step({"name": "submit", "arguments": {}})[1] == 0.0


HISTORY_IMAGE = "agentenv/swe-six-history:test"
HISTORY_DOCKERFILE = f"""\
FROM {IMAGE}
COPY gold.patch /tmp/gold.patch
RUN git apply -R /tmp/gold.patch && rm -rf .git && git init -q && git add -A && git commit -qm 'six 1.16.0' \\
 && git apply /tmp/gold.patch && git commit -qam 'six.b: encode as Latin-1' && rm /tmp/gold.patch \\
 && git tag v1.16.1 && git tag -a v1.16.1-ann -m release && git branch release \\
 && echo '# wip' >> six.py && git stash -q
"""


@pytest.fixture(scope="module")
def history_image(image_commit, tmp_path_factory):
    """An image built from a history that runs past the task's base: HEAD (main) is the fix, with tags,
    a branch and a stash; the base commit is its parent. Like an upstream clone for SWE-bench records."""
    from agentenv.host.images import docker_client

    ctx = tmp_path_factory.mktemp("history-image")
    (ctx / "Dockerfile").write_text(HISTORY_DOCKERFILE)
    (ctx / "gold.patch").write_text(GOLD)
    client = docker_client()
    client.images.build(path=str(ctx), tag=HISTORY_IMAGE, rm=True, forcerm=True, network_mode="none", pull=False)
    yield HISTORY_IMAGE
    client.images.remove(HISTORY_IMAGE, force=True)


def test_an_image_with_a_future_is_scrubbed_at_reset(task, history_image):
    """A record with a real base commit (not HEAD) in an image whose history goes past it: the default
    setup checks the base out and the scrub drops the rest; validate passes on it."""
    import agentenv

    with agentenv.Sandbox.create(history_image, network=False) as sb:
        base = sb.exec("git rev-parse HEAD~1", cwd="/testbed").stdout.strip()
    record = {**task.to_json(), "instance_id": "six-1.16.0__real_history", "image": history_image,
              "base_commit": base, "setup_commands": []}
    real = Task.from_json(record)
    sb, resolved = start_task(real)
    try:
        assert resolved is real
        assert_no_future(sb, base)
    finally:
        sb.close()
    [verdict] = validate([real], log=lambda _m: None)
    assert verdict.ok, verdict.detail
    wrong = Task.from_json({**record, "base_commit": "0" * 40})
    with pytest.raises(SetupError, match="is not in the repository") as e:
        start_task(wrong)
    assert f"base-commit {history_image}" in str(e.value)


def test_a_missing_image_is_a_typed_error_naming_the_repository_and_version(task):
    other = Task.from_json({**task.to_json(), "instance_id": "nope__1", "repo": "owner/not-built", "version": "9.9",
                            "image": None})
    assert other.image == "agentenv/swe-owner__not-built:9.9"
    with pytest.raises(TaskImageMissing) as e:
        start_task(other)
    assert "'owner/not-built'" in str(e.value) and "'9.9'" in str(e.value) and "--libraries" in str(e.value)
