"""The keeper process, as the host knows it: a sandbox's PID 1 pinned by pidfd, start time and cgroup, so that no
call ever acts on a later process that got its pid number, and kept out of the OOM killer's reach."""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass

from agentenv.host.hostcalls import proc_start_time


@dataclass(frozen=True)
class Root:
    """A sandbox's root as one connect reaches it: an ``O_PATH`` descriptor of ``/proc/<pid>/root``,
    owned (and closed) by the connect, and the host pid that must be serving the socket found there."""

    fd: int
    pid: int


def in_cgroup(pid: int, cgroup: str) -> bool:
    """True if the process is in the cgroup ``cgroup`` (as runc's cgroupsPath names it)."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return False
    return any(line.split(":", 2)[-1].endswith(cgroup) for line in lines)


class KeeperProcess:
    """A sandbox's keeper (its PID 1), pinned: a pidfd names that very process, never a later one that
    happens to get its pid number.

    Pinning checks the pid against what the sandbox's record says of its keeper (start time, cgroup)
    *after* opening the pidfd, so the pidfd cannot belong to another process; each ``root()`` then
    opens ``/proc/<pid>/root`` and checks that the pinned process is still alive *after* the open, so
    the root cannot be another process's either. ProcessLookupError when the process is gone or is not
    the sandbox's keeper.
    """

    def __init__(self, pid: int, start: int | None, cgroup: str) -> None:
        self.pid = pid
        self._fd = os.pidfd_open(pid)
        try:
            if (start is not None and proc_start_time(pid) != start) or not in_cgroup(pid, cgroup) or not self.alive():
                raise ProcessLookupError(3, f"pid {pid} is not the sandbox's keeper any more")
        except BaseException:
            os.close(self._fd)
            self._fd = -1  # closed: __del__ must not close the number again (by then another file's, in a thread)
            raise

    def alive(self) -> bool:
        try:
            signal.pidfd_send_signal(self._fd, 0)
        except ProcessLookupError:
            return False
        return True

    def root(self) -> Root:
        """An O_PATH descriptor of the keeper's root folder (the caller closes it)."""
        fd = os.open(f"/proc/{self.pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        if not self.alive():
            os.close(fd)
            raise ProcessLookupError(3, f"the keeper (pid {self.pid}) is gone")
        return Root(fd, self.pid)

    def __del__(self) -> None:  # the last user let go of it: no other thread can still use the pidfd
        if getattr(self, "_fd", -1) >= 0:  # (pidfd_open itself may have failed)
            with contextlib.suppress(Exception):
                os.close(self._fd)
            self._fd = -1


def protect_keeper(pid: int) -> bool:
    """Take the keeper out of the OOM killer's reach where the host may (CAP_SYS_RESOURCE); True if done.

    Written through the legacy ``oom_adj`` (-17 is -1000 in ``oom_score_adj``), which, unlike
    ``oom_score_adj``, leaves the floor its children inherit at 0: they cannot make themselves
    unkillable too. (The keeper also starts every child at the highest score, so even without this the
    kernel chooses them first.)
    """
    try:
        with open(f"/proc/{pid}/oom_score_adj", "w") as f:
            f.write("0")  # resets the floor a CRIU restore may have lowered
        with open(f"/proc/{pid}/oom_adj", "w") as f:
            f.write("-17")
    except OSError:
        return False
    return True
