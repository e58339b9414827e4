"""The image's accounts: who a command or a file call runs as, from the sandbox's own /etc/passwd and /etc/group.

Both files are read as files, never through NSS (whose modules the sandbox chooses). What the sandbox wrote
there only selects uids inside its own user namespace, so it can gain nothing outside. A command for an
account other than root is forked, and the child drops to that account before it execs (``spawn_as``). If
any step fails, the child exits 126 and the parent raises the step's error: it never runs as root. A file
call for an account runs on a thread whose file system ids and groups are that account's (``AsAccount``:
Linux's setfsuid, setfsgid and setgroups are per thread at the system call), so the kernel checks
permissions as it would for the account, and what it makes is owned by it.
"""

from __future__ import annotations

import errno
import os
import stat

TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal as _signal  # no stub for _signal: its names are signal's
    from typing import Any
else:
    import _signal

DB_LIMIT = 1 << 20  # bytes of /etc/passwd or /etc/group read at most
_SETGROUPS = {"x86_64": 116, "aarch64": 159}  # the raw system call (glibc's wrapper sets every thread's)


class UnknownUser(LookupError):
    """The image has no account of that name (E2B's "invalid username")."""


class Account:
    """One account of the image: its name, uid, primary gid, every gid it is a member of, home and shell."""

    def __init__(self, name: str, uid: int, gid: int, groups: list[int], home: str) -> None:
        self.name, self.uid, self.gid, self.groups, self.home = name, uid, gid, groups, home

    def env(self, cwd: str) -> dict[str, str]:
        """The variables a login as this account sets (a request's own env goes over them)."""
        return {"HOME": self.home, "USER": self.name, "LOGNAME": self.name, "PWD": cwd}

    def wire(self) -> dict[str, Any]:
        return {"name": self.name, "uid": self.uid, "gid": self.gid, "groups": self.groups, "home": self.home}


def db_rows(path: str) -> list[list[str]]:
    """The colon-separated rows of a passwd or group file, at most ``DB_LIMIT`` bytes of it (a FIFO or device
    there reads as empty)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            data = f.read(DB_LIMIT) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
    except OSError:
        return []
    return [line.split(":") for line in data.decode(errors="replace").splitlines()
            if line and not line.startswith(("#", "+", "-"))]


def account(name: str, etc: str = "/etc") -> Account:
    """The account ``name`` of the image whose /etc is ``etc`` (UnknownUser if it has none; names only, as E2B)."""
    if not isinstance(name, str) or not name or ":" in name or "\n" in name:
        raise UnknownUser(f"invalid username: {name!r}")
    for row in db_rows(f"{etc}/passwd"):
        if len(row) >= 7 and row[0] == name and row[2].isdigit() and row[3].isdigit():
            uid, gid = int(row[2]), int(row[3])
            groups = [gid]
            for g in db_rows(f"{etc}/group"):
                if len(g) >= 4 and g[2].isdigit() and name in g[3].split(",") and int(g[2]) not in groups:
                    groups.append(int(g[2]))
            return Account(name, uid, gid, groups, row[5] or "/")
    raise UnknownUser(f"invalid username: '{name}'")


def spawn_as(acct: Account | None, argv: list[str], env: dict[str, str], cwd: str, fds: list[tuple[int, int]],
             ctty: Any = None) -> int:
    """Fork a child that becomes ``acct`` (groups, gid, then uid; None: keeps the keeper's), enters ``cwd`` as it
    and execs ``argv`` in a new session, with ``fds`` as (from, to) dups and, given ``ctty`` (a function run in
    the child after the dups), a controlling terminal; its pid. A failed step is the child's exit 126 and an
    OSError here, with the step named: the command never runs with more than the account's rights."""
    r, w = os.pipe()  # close-on-exec: EOF here is the exec's success
    try:
        pid = os.fork()
        if pid == 0:  # the child: system calls only, then exec or _exit
            step = "setsid"
            try:
                os.setsid()
                step = "dup2"
                for src, dst in fds:
                    os.dup2(src, dst)
                if ctty is not None:
                    step = "TIOCSCTTY"
                    ctty()
                for sig in (_signal.SIGPIPE, _signal.SIGXFSZ):  # Python ignores these: the command must not
                    _signal.signal(sig, _signal.SIG_DFL)
                if acct is not None:
                    step = "setgroups"
                    os.setgroups(acct.groups)
                    step = "setgid"
                    os.setgid(acct.gid)
                    step = "setuid"
                    os.setuid(acct.uid)
                    if acct.uid and (os.getuid(), os.geteuid()) != (acct.uid, acct.uid):
                        raise PermissionError(errno.EPERM, "the uid did not change")
                step = "chdir"
                os.chdir(cwd)
                step = "exec"
                os.execve(argv[0], argv, env)
            except BaseException as e:  # noqa: BLE001 - the child reports and dies, whatever happened
                code = e.errno if isinstance(e, OSError) and e.errno else errno.EPERM
                os.write(w, f"{step}:{code}:{e}".encode()[:512])
            finally:
                os._exit(126)
        os.close(w)
        w = -1
        report = os.read(r, 512)
    finally:
        if w >= 0:
            os.close(w)
        os.close(r)
    if report:
        failed, num, msg = report.decode(errors="replace").split(":", 2)
        who = "the command" if acct is None else f"as {acct.name!r} (uid {acct.uid})"
        raise OSError(int(num), f"cannot run {who}: {failed} failed: {msg}")
    return pid


class AsAccount:
    """``with AsAccount(acct):`` the calling thread's file system uid, gid and groups are ``acct``'s (the
    kernel drops the capabilities that bypass file permissions with a non-zero fsuid); root's again after.
    Raises OSError where the switch cannot be made or checked, before anything is touched."""

    _libc: list[Any] = []

    def __init__(self, acct: Account) -> None:
        self.acct = acct
        self.saved: list[int] = []

    def __enter__(self) -> AsAccount:
        if not self._libc:
            try:
                import ctypes
            except ImportError:
                raise OSError(errno.ENOSYS, "file calls as another user need ctypes in the image's python3") from None
            self._libc.append(ctypes.CDLL(None, use_errno=True))
            self._libc.append(ctypes)
        self.saved = os.getgroups()
        try:
            self._set(self.acct.uid, self.acct.gid, self.acct.groups)
        except BaseException:
            self._set(0, 0, self.saved)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._set(0, 0, self.saved)

    def _set(self, uid: int, gid: int, groups: list[int]) -> None:
        libc, ctypes = self._libc
        nr = _SETGROUPS.get(os.uname().machine)
        if nr is None:
            raise OSError(errno.ENOSYS, f"file calls as another user are not offered on {os.uname().machine}")
        arr = (ctypes.c_uint * max(1, len(groups)))(*groups)
        if libc.syscall(nr, len(groups), arr) != 0:
            raise OSError(ctypes.get_errno(), "setgroups failed")
        libc.setfsgid(gid)
        libc.setfsuid(uid)
        if libc.setfsgid(-1) != gid or libc.setfsuid(-1) != uid or sorted(os.getgroups()) != sorted(groups):
            raise OSError(errno.EPERM, f"cannot take the file system ids of uid {uid}")
