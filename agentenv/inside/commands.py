"""How the keeper starts a command and kills a job's processes: ``sh -c`` leading its own session (its process
group is the job), with the sandbox's environment plus the request's and the job's marker, its stdin, stdout and
stderr as pipes, a file or a terminal, as root or as another account of the image.

Commands start by posix_spawn, not subprocess, whose imports would cost every sandbox start (see ``frames``), or
as another account by ``users.spawn_as``; every process the keeper starts is the OOM killer's first choice, never
the keeper. A part of the keeper (``agentenv.host.keeper_start.PARTS``), apart from ``jobs.py`` because none of this
holds state: the job table, the reaper and the job's output are ``jobs.py``'s.
"""

from __future__ import annotations

import errno
import os
import stat

from agentenv.inside.frames import suppress
from agentenv.inside.pty import open_terminal, take_terminal
from agentenv.inside.users import account, spawn_as

TYPE_CHECKING = False
if TYPE_CHECKING:
    import signal as _signal  # no stub for _signal: its names are signal's
    from typing import Any
else:
    import _signal

JOB_ENV = "AGENTENV_JOB"
CHILD_OOM_SCORE = 1000  # every process the keeper starts is the OOM killer's first choice, never the keeper
_CHILD_PREFIX = f"echo {CHILD_OOM_SCORE} 2>/dev/null >/proc/self/oom_score_adj; "  # before the user's code runs


class Starved(Exception):
    """The keeper cannot start a thread or a process: the sandbox is out of pids (or memory)."""


class Child:
    """A command the keeper started (``sh -c``, leading its own session and process group): its pid, and the
    keeper's ends of its pipes, where it has pipes."""

    def __init__(self, pid: int, stdin: Any = None, stdout: Any = None, stderr: Any = None) -> None:
        self.pid = pid
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr


def start_command(header: dict[str, Any], job_id: int, output: int | None = None) -> Child:
    """Start the request's command: ``sh -c`` in a new session (its group is the job) with the sandbox's
    environment plus the request's; stdin a pipe if asked for, else /dev/null; stdout and stderr two pipes,
    or both the file ``output``; for a ``pty`` job all three are a new terminal's slave end (the keeper's stdin
    and stdout ends its master: ``agentenv.inside.pty``), forked so that it becomes the session's terminal. As
    root, posix_spawn (a vfork) rather than subprocess, whose imports cost every start of a sandbox (see the
    imports); as another account of the image (``header["user"]``), ``users.spawn_as``."""
    acct = None if header.get("user") is None else account(header["user"])
    env = dict(os.environ)
    env.pop("AGENTENV_KEEPER", None)
    cwd = header.get("cwd") or (acct.home if acct is not None else None)
    if cwd and not isinstance(cwd, str):
        raise TypeError(f"'cwd' must be a path, not {type(cwd).__name__}")
    if acct is not None and cwd:  # as an account, a relative folder is in its home (as envd's)
        cwd = os.path.join(acct.home, cwd)
    if acct is not None:
        env.update(acct.env(cwd or "/"))
    env.update(header.get("env") or {})
    env[JOB_ENV] = str(job_id)
    script = _CHILD_PREFIX + str(header["cmd"])
    as_root = acct is None or acct.uid == 0
    if cwd and as_root:  # posix_spawn cannot chdir: the shell does, once it is checked here (an error, as subprocess's)
        if not stat.S_ISDIR(os.stat(cwd).st_mode):
            raise NotADirectoryError(errno.ENOTDIR, f"Not a directory: {cwd!r}")
        script = "cd -- '" + cwd.replace("'", "'\\''") + "' || exit 126; " + script
    ends: list[int | None] = [None, None, None]  # the keeper's ends of the child's stdin, stdout, stderr
    theirs: list[int] = []  # the child's ends, closed here once it runs
    tty = header.get("pty")
    piped = () if tty is not None else ((0,) if header.get("stdin") else ()) + ((1, 2) if output is None else ())
    actions: list[tuple[Any, ...]] = [] if 0 in piped else [(os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0)]
    try:
        if tty is not None:
            master, slave = open_terminal(tty)
            ends[1] = master
            theirs.append(slave)
            if not as_root:  # the account's own terminal, as a login's: it may open it by its name
                os.fchown(slave, acct.uid, -1)  # type: ignore[union-attr]
            ends[0] = os.dup(master)  # its input end: closing one end leaves the other
            actions = [(os.POSIX_SPAWN_DUP2, slave, fd) for fd in (0, 1, 2)]
        elif 0 not in piped and not as_root:  # the forked child dups it as the others
            theirs.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
            actions = [(os.POSIX_SPAWN_DUP2, theirs[-1], 0)]
        for fd in piped:
            r, w = os.pipe()
            ends[fd], child_end = (w, r) if fd == 0 else (r, w)
            theirs.append(child_end)
            actions.append((os.POSIX_SPAWN_DUP2, child_end, fd))
        if output is not None:
            actions += [(os.POSIX_SPAWN_DUP2, output, 1), (os.POSIX_SPAWN_DUP2, output, 2)]
        argv = ["/bin/sh", "-c", script]
        default = (_signal.SIGPIPE, _signal.SIGXFSZ)  # Python ignores these: the command must not
        if not as_root or tty is not None:
            pid = spawn_as(None if as_root else acct, argv, env, cwd or os.getcwd(),
                           [(a[1], a[2]) for a in actions], take_terminal if tty is not None else None)
        else:
            try:
                pid = os.posix_spawn(argv[0], argv, env, file_actions=actions, setsid=True, setsigdef=default)
            except NotImplementedError:  # a C library without POSIX_SPAWN_SETSID: its own group is what matters
                pid = os.posix_spawn(argv[0], argv, env, file_actions=actions, setpgroup=0, setsigdef=default)
    except BaseException as e:
        for end in ends:
            if end is not None:
                os.close(end)
        if isinstance(e, BlockingIOError):  # EAGAIN from clone: the pids cgroup is full
            raise Starved(f"cannot start the command: the sandbox is out of processes ({e})") from None
        raise
    finally:
        for end in theirs:
            os.close(end)
    return Child(pid, *(None if end is None else open(end, "wb" if fd == 0 else "rb", buffering=0)
                        for fd, end in enumerate(ends)))


def kill_job(job_id: int, pgid: int) -> None:
    """SIGKILL a job's process group and every process that carries its marker in the environment."""
    with suppress(OSError):
        os.killpg(pgid, _signal.SIGKILL)
    marker = f"{JOB_ENV}={job_id}".encode()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == 1:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    os.kill(int(name), _signal.SIGKILL)
        except OSError:
            continue
