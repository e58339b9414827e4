"""Accounts of the image in a real sandbox: commands and file calls as ``user`` (uid 1000 of agentenv/base) or
another account, through ``Sandbox.as_user`` and through the E2B SDK against a real ``agentenv serve``; and
that nothing asked to run as an account ever runs as root."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import agentenv
from agentenv.api import JobOutput
from agentenv.errors import UnknownUser

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def sb() -> Iterator[agentenv.Sandbox]:
    with agentenv.Sandbox.create(memory="512m", cpus=1.0, ttl=None) as s:  # the module's: closed at its teardown, no deadline
        assert s.exec("useradd --create-home --uid 1001 other").exit_code == 0  # a second unprivileged account
        yield s


def test_a_command_as_user_has_its_uid_groups_home_and_folder(sb: agentenv.Sandbox) -> None:
    r = sb.as_user("user").exec("id -u; id -g; id -G; echo $HOME $USER $LOGNAME; pwd")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.split("\n")[:5] == ["1000", "1000", "1000", "/home/user user user", "/home/user"]
    assert sb.as_user("user").exec("pwd", cwd="/tmp").stdout == "/tmp\n"
    assert sb.as_user("user").exec("touch /etc/nope").exit_code != 0, "user wrote a root-owned folder"


def test_root_is_root_and_the_native_default_stays_root(sb: agentenv.Sandbox) -> None:
    assert sb.exec("id -u").stdout == "0\n"
    r = sb.as_user("root").exec("id -u; echo $HOME; pwd")
    assert r.stdout == "0\n/root\n/root\n"


def test_a_started_job_and_a_spawned_process_run_as_the_account(sb: agentenv.Sandbox) -> None:
    u = sb.as_user("user")
    job = u.start("id -u")
    out = b"".join(item.data for item in sb.output(job.pid) if isinstance(item, JobOutput))
    assert out == b"1000\n"
    p = u.spawn("id -u > /tmp/spawned-uid")
    assert p.wait(20) == 0 and sb.read_file("/tmp/spawned-uid") == b"1000\n"


def test_an_unknown_user_is_refused(sb: agentenv.Sandbox) -> None:
    with pytest.raises(UnknownUser, match="invalid username"):
        sb.as_user("nosuch")


def test_a_file_written_as_user_is_its_own_and_0600_keeps_others_out(sb: agentenv.Sandbox) -> None:
    u = sb.as_user("user")
    u.write_file("secret.txt", "s3cret", mode=0o600)  # relative: from the account's home
    info = sb.stat("/home/user/secret.txt")
    assert (info.owner, info.group, info.mode) == ("user", "user", 0o600)
    assert u.exec("cat secret.txt").stdout == "s3cret"
    other = sb.as_user("other")
    r = other.exec("cat /home/user/secret.txt")
    assert r.exit_code != 0 and "Permission denied" in r.stderr and "s3cret" not in r.stdout
    with pytest.raises(PermissionError):
        other.read_file("/home/user/secret.txt")
    with pytest.raises(PermissionError):
        u.write_file("/etc/owned-by-user", "x")  # a write as user has its permissions, not root's
    assert u.make_dir("made/deep") and sb.stat("/home/user/made/deep").owner == "user"


def test_a_failed_drop_never_runs_the_command_as_root(sb: agentenv.Sandbox) -> None:
    # uid 70000 is outside the sandbox's user namespace: setgid/setuid to it fail
    sb.exec("echo 'ghost:x:70000:70000::/tmp:/bin/sh' >> /etc/passwd")
    ghost = sb.as_user("ghost")
    with pytest.raises(OSError, match="cannot run as 'ghost'"):
        ghost.exec("touch /tmp/ghost-ran")
    with pytest.raises(OSError):
        ghost.write_file("/tmp/ghost-file", "x")
    assert sb.exec("ls /tmp/ghost-ran /tmp/ghost-file").exit_code != 0, "something ran as root in ghost's place"


e2b = pytest.importorskip("e2b", reason="the E2B SDK is a test extra; bootstrap installs it")


@pytest.fixture
def e2b_sandbox(e2b_url: str) -> Iterator[e2b.Sandbox]:
    sandbox = e2b.Sandbox.create(timeout=600)
    try:
        yield sandbox
    finally:
        e2b.Sandbox.kill(sandbox.sandbox_id)


def test_the_e2b_sdk_runs_as_user_by_default_and_as_whom_it_names(e2b_sandbox: e2b.Sandbox) -> None:
    assert e2b_sandbox.commands.run("id -u; pwd").stdout == "1000\n/home/user\n"
    assert e2b_sandbox.commands.run("id -u; pwd", user="root").stdout == "0\n/root\n"
    info = e2b_sandbox.files.write("mine.txt", "hello")
    assert info.path == "/home/user/mine.txt"
    assert e2b_sandbox.files.get_info("mine.txt").owner == "user"
    e2b_sandbox.files.write("/tmp/roots.txt", "x", user="root")
    assert e2b_sandbox.files.get_info("/tmp/roots.txt").owner == "root"
    e2b_sandbox.files.make_dir("a/b")
    assert e2b_sandbox.files.get_info("/home/user/a/b").owner == "user"
    assert e2b_sandbox.commands.run("stat -c %U /home/user/mine.txt").stdout == "user\n"


def test_the_e2b_sdk_gets_envds_error_for_an_unknown_user(e2b_sandbox: e2b.Sandbox) -> None:
    from e2b.exceptions import AuthenticationException

    with pytest.raises(AuthenticationException, match="invalid username"):
        e2b_sandbox.commands.run("id -u", user="nosuch")
    with pytest.raises(AuthenticationException, match="invalid username"):
        e2b_sandbox.files.write("/tmp/x", "x", user="nosuch")
    with pytest.raises(AuthenticationException, match="invalid username"):
        e2b_sandbox.files.make_dir("/tmp/y", user="nosuch")
    assert not e2b_sandbox.files.exists("/tmp/x", user="root")


def test_a_job_as_user_keeps_its_account_through_a_fork(sb: agentenv.Sandbox) -> None:
    job = sb.as_user("user").start("sleep 1; id -u; echo $HOME")
    kid = sb.fork(1, memory=True)[0]
    try:
        out = b"".join(item.data for item in kid.output(job.pid) if isinstance(item, JobOutput))
        assert out == b"1000\n/home/user\n"
        assert kid.as_user("user").exec("id -un").stdout == "user\n"
    finally:
        kid.close()


def test_a_relative_cwd_is_in_the_accounts_home(sb: agentenv.Sandbox) -> None:
    u = sb.as_user("user")
    u.make_dir("work")
    assert u.exec("pwd", cwd="work").stdout == "/home/user/work\n"


def test_an_account_cannot_reach_the_agent_which_runs_as_root(sb: agentenv.Sandbox) -> None:
    probe = ("python3 -c \"import socket; s = socket.socket(socket.AF_UNIX); "
             "s.connect('/dev/agentenv/agent.sock'); print('CONNECTED')\"")
    r = sb.as_user("user").exec(probe)
    assert r.exit_code != 0 and "CONNECTED" not in r.stdout and "Permission denied" in r.stderr
    assert sb.exec("stat -c %a /dev/agentenv").stdout == "700\n"


def test_the_code_interpreter_runs_as_user_in_its_home(e2b_url: str) -> None:
    code_interpreter = pytest.importorskip("e2b_code_interpreter")
    ci = code_interpreter.Sandbox.create()
    try:
        assert ci.run_code("import os\nos.getuid(), os.getcwd()").text == "(1000, '/home/user')"
        ctx = ci.create_code_context()
        assert ctx.cwd == "/home/user"
        assert ci.run_code("import os\nos.getcwd()", context=ctx).text.strip("'") == "/home/user"
    finally:
        code_interpreter.Sandbox.kill(ci.sandbox_id)
