"""E2B templates built on this host with the real ``e2b`` SDK against a real ``agentenv serve``: the steps become a
Docker build of a local image; a template with a start command is snapshotted once ready, so its sandboxes start
with that process already running."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

e2b = pytest.importorskip("e2b", reason="the E2B SDK is a test extra; bootstrap installs it")

from e2b import BuildException, Sandbox, Template, wait_for_file  # noqa: E402
from e2b.template.logger import LogEntry  # noqa: E402

from agentenv.host import images  # noqa: E402
from agentenv.server.e2b import template_store as store  # noqa: E402

from .server_fixtures import TOKEN  # noqa: E402


@pytest.fixture
def templates(e2b_url: str) -> Iterator[list[str]]:
    """Names of the templates a test builds; each is deleted after it, its images and snapshots with it (only its
    own images are looked at: other test sessions may be building templates on the same engine)."""
    made: list[str] = []
    yield made
    key = {"X-API-KEY": TOKEN}
    ids = []
    for name in made:
        found = httpx.get(f"{e2b_url}/templates/aliases/{name}", headers=key, timeout=60)
        if found.status_code == 200:
            ids.append(found.json()["templateID"])
        httpx.delete(f"{e2b_url}/templates/{name}", headers=key, timeout=60)
    left = [t for t in images.available() if any(t.startswith(f"agentenv-e2b/{i}:") for i in ids)]
    assert not left, f"deleting the templates left their images {left}"


def _name(made: list[str], prefix: str) -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    made.append(name)
    return name


def test_build_copy_run_envs_then_a_sandbox_has_them(tmp_path: Path, templates: list[str]) -> None:
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "hello.txt").write_text("hello from the host\n")
    (tmp_path / "app" / "run.sh").write_text("#!/bin/sh\necho ran\n")
    name = _name(templates, "t-files")
    template = (Template(file_context_path=str(tmp_path)).from_image("agentenv/base")
                .copy("app/hello.txt", "/opt/app/")
                .copy("app/run.sh", "/opt/app/run.sh", mode=0o755)
                .copy("app", "/opt/owned", user="nobody")  # a folder's contents, owned by the image's account
                .set_envs({"WHO": "world"})
                .set_envs({"GREETING": 'say "hi" \\ $WHO'})  # expanded from earlier envs, as Docker's ENV
                .set_workdir("/opt/app")
                .run_cmd("cat hello.txt > copied.txt && echo built > /opt/app/marker"))
    seen: list[LogEntry] = []
    info = Template.build(template, name, on_build_logs=seen.append)
    assert info.name == name and info.template_id and info.build_id
    assert any("Step" in e.message for e in seen), "the docker build's output reached the SDK"
    images_made = [t for t in images.available() if info.template_id in t]
    assert images_made, "the build made a local image"
    assert images.resolve(images_made[0]).workdir == "/opt/app"  # set_workdir is the image's WORKDIR

    sb = Sandbox.create(name, timeout=120)
    try:
        assert sb.files.read("/opt/app/hello.txt") == "hello from the host\n"
        assert sb.files.read("/opt/app/copied.txt") == "hello from the host\n"
        assert sb.commands.run("/opt/app/run.sh").stdout == "ran\n"
        assert sb.commands.run("stat -c %a /opt/app/run.sh").stdout.strip() == "755"
        assert sb.commands.run("stat -c %U:%G /opt/owned /opt/owned/run.sh").stdout.split() == ["nobody:nogroup"] * 2
        assert sb.commands.run("printenv GREETING").stdout.strip() == 'say "hi" \\ world'
    finally:
        sb.kill()
    assert Sandbox.create(f"{name}:default", timeout=60).kill() in (None, True)


def test_from_dockerfile_and_a_folder_with_symlinks(tmp_path: Path, templates: list[str]) -> None:
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "test.txt").write_text("a test file")
    (folder / "rel.txt").symlink_to("test.txt")
    (folder / "dangling.txt").symlink_to("nothing-there.txt")
    dockerfile = ("FROM agentenv/base\nUSER root\nWORKDIR /srv\nCOPY folder/* folder/\n"
                  "RUN cat folder/rel.txt > from-link\nENV MODE=dockerfile\n")
    name = _name(templates, "t-dockerfile")
    Template.build(Template(file_context_path=str(tmp_path)).from_dockerfile(dockerfile), name)
    sb = Sandbox.create(name, timeout=60)
    try:
        assert sb.files.read("/srv/from-link") == "a test file"
        assert sb.commands.run("readlink folder/rel.txt folder/dangling.txt").stdout.split() == [
            "test.txt", "nothing-there.txt"]  # links copied as links, as E2B does without resolve_symlinks
        assert sb.commands.run("printenv MODE").stdout.strip() == "dockerfile"
    finally:
        sb.kill()
    # without a USER line, the SDK appends E2B's own user (and /home/user): the sandbox's commands run as it
    e2b_user = _name(templates, "t-e2buser")
    Template.build(Template().from_dockerfile("FROM agentenv/base\nRUN id user || useradd -m user"), e2b_user)
    sb = Sandbox.create(e2b_user, timeout=60)
    try:
        assert sb.commands.run("id -un; pwd").stdout.split() == ["user", "/home/user"]
    finally:
        sb.kill()


def test_exists_tags_and_aliases(templates: list[str], e2b_url: str) -> None:
    name = _name(templates, "t-tags")
    assert Template.exists("base") is True
    assert Template.exists(name) is False
    template = Template().from_image("agentenv/base").run_cmd("echo one > /one")
    first = Template.build(template, f"{name}:v1", tags=["stable"])
    assert Template.exists(name) is True
    assert {t.tag: t.build_id for t in Template.get_tags(name)} == {"v1": first.build_id, "stable": first.build_id}
    assigned = Template.assign_tags(f"{name}:v1", ["production", "latest"])
    assert assigned.build_id == first.build_id and set(assigned.tags) == {"production", "latest"}
    with pytest.raises(Exception, match="invalid tag"):
        Template.assign_tags(f"{name}:v1", ":invalid-tag")
    with pytest.raises(Exception, match="invalid tag"):
        Template.assign_tags(f"{name}:v1", f"{name}:")

    second = Template.build(Template().from_image("agentenv/base").run_cmd("echo two > /one"), f"{name}:v2",
                            tags=["stable"])
    assert second.template_id == first.template_id and second.build_id != first.build_id
    tags = {t.tag: t.build_id for t in Template.get_tags(first.template_id)}
    assert tags["stable"] == second.build_id and tags["v1"] == tags["production"] == first.build_id
    for ref, want in ((f"{name}:stable", "two"), (f"{name}:production", "one")):
        sb = Sandbox.create(ref, timeout=60)
        try:
            assert sb.files.read("/one").strip() == want
        finally:
            sb.kill()
    Template.remove_tags(name, "production")
    assert "production" not in {t.tag for t in Template.get_tags(name)}
    with pytest.raises(Exception, match="no ready build tagged 'production'"):
        Sandbox.create(f"{name}:production", timeout=60)


def test_a_failing_step_names_itself(templates: list[str]) -> None:
    name = _name(templates, "t-fail")
    template = (Template().from_image("agentenv/base").run_cmd("echo fine")
                .run_cmd("echo about to fail; exit 7").run_cmd("echo never"))
    seen: list[LogEntry] = []
    with pytest.raises(BuildException) as e:
        Template.build(template, name, on_build_logs=seen.append)
    assert "failed to run command 'echo about to fail; exit 7': exit status 7" in str(e.value)
    assert any("about to fail" in entry.message for entry in seen), "the failing step's output was streamed"
    assert Template.exists(name) is True  # the template is there, without a ready build
    with pytest.raises(Exception, match="no ready build"):
        Sandbox.create(name, timeout=60)

    unknown = Template().from_image("agentenv/base").run_cmd("whoami", user="root123")
    with pytest.raises(BuildException, match="failed to run command 'whoami': command failed: unauthenticated: "
                                             "invalid username: 'root123'"):
        Template.build(unknown, _name(templates, "t-user"))

    offline = Template().from_image("agentenv/base").pip_install("nothing-here-offline")
    with pytest.raises(BuildException, match="no package registry is reachable"):
        Template.build(offline, _name(templates, "t-pip"))


def test_a_missing_image_says_how_to_get_it(templates: list[str]) -> None:
    template = Template().from_image("agentenv-missing/nothing:1").run_cmd("true")
    with pytest.raises(BuildException) as e:
        Template.build(template, _name(templates, "t-missing"))
    message = str(e.value)
    assert "image 'agentenv-missing/nothing:1' is not on this host" in message
    assert "docker build -t agentenv-missing/nothing:1" in message and "docker" in message and "import" in message


def test_set_user_runs_the_build_steps_and_the_sandboxes_as_that_user(templates: list[str]) -> None:
    name = _name(templates, "t-runner")
    Template.build(Template().from_image("agentenv/base").run_cmd("useradd -m runner", user="root")
                   .set_user("runner").run_cmd("id -un > /tmp/who").set_start_cmd("sleep 600", "true"), name)
    sb = Sandbox.create(name, timeout=60)
    try:
        assert sb.files.read("/tmp/who").strip() == "runner"  # the build step ran as the user
        assert sb.commands.run("id -un").stdout.strip() == "runner"  # and so do the sandbox's commands
        assert sb.commands.run("id -un", user="root").stdout.strip() == "root"  # unless they name another
        owner = sb.commands.run("ps -o user= -C sleep", user="root").stdout.split()
        assert owner == ["runner"], "the start command ran as the template's user, not root"
    finally:
        sb.kill()
    with pytest.raises(BuildException, match="invalid username: 'nosuchuser'"):
        Template.build(Template().from_image("agentenv/base").set_user("nosuchuser"), _name(templates, "t-nouser"))


def test_build_in_background_then_status(templates: list[str]) -> None:
    name = _name(templates, "t-bg")
    template = Template().from_image("agentenv/base").skip_cache().run_cmd("sleep 2; echo slept")
    info = Template.build_in_background(template, name)
    status = Template.get_build_status(info)
    assert status.status.value in ("building", "waiting")
    wait(lambda: Template.get_build_status(info).status.value == "ready", "the background build ends", 120)
    logs = Template.get_build_status(info, logs_offset=0).log_entries
    assert any("slept" in e.message for e in logs)
    later = Template.get_build_status(info, logs_offset=len(logs))
    assert later.log_entries == []


def test_start_cmd_is_running_in_a_new_sandbox_without_being_run_again(templates: list[str]) -> None:
    """The start command ran once, at build time; a sandbox of the template is restored with it running."""
    name = _name(templates, "t-start")
    start = "echo started >> /tmp/starts; i=0; while true; do i=$((i+1)); echo $i > /tmp/n; sleep 0.1; done"
    template = Template().from_image("agentenv/base").set_start_cmd(start, wait_for_file("/tmp/n"))
    Template.build(template, name)
    with pytest.raises(Exception, match="envs cannot reach it"):
        Sandbox.create(name, envs={"A": "1"}, timeout=60)  # never accepted and ignored
    boxes = [Sandbox.create(name, timeout=120) for _ in range(2)]
    try:
        for sb in boxes:
            assert sb.files.read("/tmp/starts") == "started\n"  # started once, before the snapshot: not again
            first = int(sb.files.read("/tmp/n"))
            wait(lambda sb=sb, first=first: int(sb.files.read("/tmp/n") or 0) > first + 3,  # type: ignore[misc]
                 "the counter goes on in the restored sandbox")
        assert boxes[0].files.read("/tmp/starts") == "started\n"
    finally:
        for sb in boxes:
            sb.kill()


def test_deletions_replaced_folders_and_owners_carry_into_the_image(templates: list[str]) -> None:
    """A build's layer holds what its steps deleted (whiteouts), a folder they replaced (opaque) and the owners of
    what an account wrote (mapped back from the build sandbox's uid range); a template built on it sees them."""
    first = _name(templates, "t-layer")
    Template.build(Template().from_image("agentenv/base")
                   .run_cmd("rm /etc/debian_version && rm -rf /etc/apt && mkdir /etc/apt && echo new > /etc/apt/only"
                            " && useradd -m runner", user="root")
                   .run_cmd("echo mine > /home/runner/mine && ln /home/runner/mine /home/runner/again", user="runner"),
                   first)
    check = ('test ! -e /etc/debian_version && test "$(ls -A /etc/apt)" = only && '
             'test "$(stat -c %U:%h /home/runner/mine)" = runner:2 && test "$(cat /home/runner/again)" = mine')
    Template.build(Template().from_template(first).run_cmd(check), _name(templates, "t-layer-on"))

def wait(check: Callable[[], bool], what: str, limit: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + limit
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.2)


# --- issue 40: an upload is untrusted input; a build is code of the template's author -------------------------


def _victim(tmp_path: Path) -> tuple[Path, str]:
    """A root-only file in a scratch folder, standing for /etc/shadow: what a hostile upload reaches for."""
    secret = f"root-only {uuid.uuid4().hex}"
    victim = tmp_path / "scratch" / "victim"
    victim.parent.mkdir()
    victim.write_text(secret)
    victim.chmod(0o600)
    return victim, secret


def _crafted(members: list[tuple[str, str, bytes]]) -> bytes:
    """A tar of (kind, name, data) members: 'hard' links ``name`` to the path ``data``; 'file' holds ``data``."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for kind, name, data in members:
            info = tarfile.TarInfo(name)
            info.mode = 0o755
            if kind == "hard":
                info.type, info.linkname = tarfile.LNKTYPE, data.decode()
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.mark.parametrize("attack", ["read", "write", "chmod"])
def test_a_hard_link_in_an_upload_never_reaches_a_host_file(attack: str, tmp_path: Path, templates: list[str],
                                                            e2b_url: str) -> None:
    """READ: a hard link to a root-only host file, copied in and printed by a RUN step. WRITE: a hard link, then a
    regular member of the same name. CHMOD: the copy's mode applied through the link. The upload is refused at
    once, naming the member; stored anyway (as by an older server), the build refuses it too."""
    victim, secret = _victim(tmp_path)
    before = victim.stat()
    member = {"read": "secret.txt", "write": "note.txt", "chmod": "run.sh"}[attack]
    members = [("hard", member, str(victim).encode())]
    if attack == "write":
        members.append(("file", member, b"overwritten by the upload\n"))
    (tmp_path / "ctx").mkdir()
    (tmp_path / "ctx" / member).write_text("what the SDK hashes\n")
    template = Template(file_context_path=str(tmp_path / "ctx")).from_image("agentenv/base")
    template = (template.copy(member, "/opt/", mode=0o777) if attack == "chmod" else template.copy(member, "/opt/"))
    template = template.run_cmd(f"cat /opt/{member}")
    files_hash = json.loads(Template.to_json(template))["steps"][0]["filesHash"]
    name = _name(templates, f"t-link-{attack}")
    key = {"X-API-KEY": TOKEN}
    template_id = httpx.post(f"{e2b_url}/v3/templates", json={"name": name}, headers=key).json()["templateID"]
    link = httpx.get(f"{e2b_url}/templates/{template_id}/files/{files_hash}", headers=key).json()["url"]
    upload = httpx.put(link, content=_crafted(members), timeout=60)
    store.file_path(files_hash).write_bytes(_crafted(members))  # as if stored before the checks: the build checks
    seen: list[LogEntry] = []
    failure = ""
    try:
        Template.build(template, name, on_build_logs=seen.append)
    except BuildException as e:
        failure = str(e)
    after = victim.stat()
    assert victim.read_text() == secret, "the upload wrote a host file"
    assert (after.st_mode, after.st_uid, after.st_gid) == (before.st_mode, before.st_uid, before.st_gid), \
        f"the upload changed a host file's mode to {after.st_mode:o}"
    assert not any(secret in e.message for e in seen), "the build log showed a root-only host file"
    assert upload.status_code == 400 and member in upload.text and "hard link" in upload.text, upload.text
    assert member in failure and "hard link" in failure, failure


def test_a_build_runs_in_a_user_namespace_within_its_limits(templates: list[str]) -> None:
    """A build that asks for 1 CPU and 512 MiB: its steps' root is not the host's, 1.5 GiB cannot be allocated,
    2,000 processes cannot be started, and there is no network but loopback."""
    probe = """python3 - <<'EOF'
import os, signal
print("probe uid_map", *open("/proc/self/uid_map").read().split())
print("probe net", *sorted(os.listdir("/sys/class/net")))
child = os.fork()
if child == 0:
    data = b"x" * (1536 << 20)
    os._exit(0)
_, status = os.waitpid(child, 0)
print("probe alloc", "done" if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 else "refused")
kids = []
try:
    for _ in range(2000):
        kid = os.fork()
        if kid == 0:
            signal.pause()
            os._exit(0)
        kids.append(kid)
except OSError:
    pass
print("probe forked", len(kids))
for kid in kids:
    os.kill(kid, signal.SIGKILL)
    os.waitpid(kid, 0)
EOF"""
    seen: list[LogEntry] = []
    Template.build(Template().from_image("agentenv/base").skip_cache().run_cmd(probe), _name(templates, "t-limits"),
                   cpu_count=1, memory_mb=512, on_build_logs=seen.append)
    found = {}
    for e in seen:
        for line in e.message.splitlines():
            words = line.split()
            if len(words) >= 2 and words[0] == "probe":
                found[words[1]] = words[2:]
    uid_map = found["uid_map"]
    assert uid_map[0] == "0" and uid_map[1] != "0" and int(uid_map[2]) <= 65536, f"the build's root is {uid_map}"
    assert found["alloc"] == ["refused"], "a 512 MiB build allocated 1.5 GiB"
    assert int(found["forked"][0]) < 2000, "a build started 2,000 processes"
    assert found["net"] == ["lo"]
