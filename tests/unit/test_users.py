"""The agent's accounts (``agentenv.inside.users``): passwd and group read as files, and the refusals that keep a
command or file call for an account from ever running as root. No Docker: the drops run on this host (as root
here, where the test runs as root)."""

from __future__ import annotations

import base64
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from connectrpc.errors import ConnectError

from agentenv import errors
from agentenv.inside import users
from agentenv.server.e2b.bridge import connect_error, user_named

PASSWD = """root:x:0:0:root:/root:/bin/bash
# a comment
nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin
user:x:1000:1000::/home/user:/bin/bash
broken:x:notanumber:1::/:/bin/sh
short:x:5
"""
GROUP = """root:x:0:
user:x:1000:
docker:x:999:other,user
audio:x:29:user
nogroup:x:65534:
"""
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="the drops need root (as the agent is in a sandbox)")


@pytest.fixture
def etc(tmp_path: Path) -> str:
    (tmp_path / "passwd").write_text(PASSWD)
    (tmp_path / "group").write_text(GROUP)
    return str(tmp_path)


def test_an_account_has_its_uid_gid_member_groups_and_home(etc: str) -> None:
    acct = users.account("user", etc)
    assert (acct.uid, acct.gid, acct.groups, acct.home) == (1000, 1000, [1000, 999, 29], "/home/user")
    assert acct.env("/home/user") == {"HOME": "/home/user", "USER": "user", "LOGNAME": "user", "PWD": "/home/user"}
    root = users.account("root", etc)
    assert (root.uid, root.gid, root.groups, root.home) == (0, 0, [0], "/root")


@pytest.mark.parametrize("name", ["nosuch", "broken", "short", "", "us:er", "x\nroot", "#"])
def test_an_unknown_or_malformed_name_is_e2bs_invalid_username(etc: str, name: str) -> None:
    with pytest.raises(users.UnknownUser, match="invalid username"):
        users.account(name, etc)


def test_a_passwd_that_is_not_a_regular_file_knows_no_one(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "passwd")  # a FIFO must not block the agent
    with pytest.raises(users.UnknownUser):
        users.account("root", str(tmp_path))


def test_the_unknown_user_error_is_unauthenticated_as_envd_answers() -> None:
    err = connect_error(errors.UnknownUser("invalid username: 'nosuch'"))
    assert err.code.name == "UNAUTHENTICATED" and "invalid username: 'nosuch'" in err.message


def test_the_request_names_its_user_in_basic_auth_or_the_query() -> None:
    basic = "Basic " + base64.b64encode(b"user:").decode()
    assert user_named({"authorization": basic}) == "user"
    assert user_named({"authorization": basic}, {"username": "root"}) == "root"
    assert user_named({}) is None and user_named({"authorization": "Bearer x"}) is None
    with pytest.raises(ConnectError):
        user_named({"authorization": "Basic !!!"})


def _reap(pid: int) -> int:
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@as_root
def test_a_command_runs_with_the_accounts_ids_groups_and_folder(tmp_path: Path) -> None:
    out = tmp_path / "out"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT, 0o666)
    acct = users.Account("nobody", 65534, 65534, [65534, 29], "/")
    try:
        pid = users.spawn_as(acct, ["/bin/sh", "-c", "id -u; id -g; id -G; pwd"], {"PATH": os.environ["PATH"]},
                             "/", [(fd, 1)])
    finally:
        os.close(fd)
    assert _reap(pid) == 0
    assert out.read_text().split("\n")[:4] == ["65534", "65534", "65534 29", "/"]


@as_root
def test_a_failed_step_never_runs_the_command_and_says_which(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    acct = users.Account("nobody", 65534, 65534, [65534], "/")
    private = tmp_path / "private"
    private.mkdir(mode=0o700)  # root's: nobody cannot enter it
    with pytest.raises(PermissionError, match="chdir failed"):
        users.spawn_as(acct, ["/bin/sh", "-c", f"touch {marker}"], {}, str(private), [])
    bad = users.Account("bad", 65534, 65534, [-5], "/")  # setgroups refuses a negative gid
    with pytest.raises(OSError, match="setgroups failed"):
        users.spawn_as(bad, ["/bin/sh", "-c", f"touch {marker}"], {}, "/", [])
    os.waitpid(-1, os.WNOHANG)
    assert not marker.exists()


@pytest.fixture
def shared() -> Iterator[Path]:
    """A folder every account can reach (pytest's tmp_path is under root-only folders)."""
    top = Path(tempfile.mkdtemp(prefix="agentenv-users-", dir="/tmp"))
    top.chmod(0o755)
    try:
        yield top
    finally:
        shutil.rmtree(top)


@as_root
def test_a_file_call_as_an_account_has_its_permissions_and_owner(shared: Path) -> None:
    tmp_path = shared
    acct = users.Account("nobody", 65534, 65534, [65534], "/")
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o777)
    open_dir.chmod(0o777)
    seen: list[object] = []

    def work() -> None:  # on a thread of its own: the switch is that thread's alone
        with users.AsAccount(acct):
            (open_dir / "mine").write_text("x")
            try:
                (private / "no").write_text("x")
            except PermissionError as e:
                seen.append(e)
        (private / "root-again").write_text("x")

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert len(seen) == 1, "a root-only folder took a write as nobody"
    st = (open_dir / "mine").stat()
    assert (st.st_uid, st.st_gid) == (65534, 65534)
    assert os.stat(private / "root-again").st_uid == 0 and stat.S_ISREG(os.stat(private / "root-again").st_mode)
    assert (os.getuid(), os.getgid()) == (0, 0)
