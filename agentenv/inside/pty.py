"""The keeper's terminals: a job started with ``pty`` runs on a pseudo-terminal the keeper opens (E2B's ``pty``).

The command's stdin, stdout and stderr are the terminal's slave end, which is also the controlling terminal of
its session (``take_terminal``, in the forked child), so ``tty``, job control and SIGWINCH work as in a login.
The keeper keeps the master end: what the command writes there is the job's one output stream, what ``input``
sends is typed at it, and ``resize`` sets its size. fcntl and termios are imported with the first terminal,
not at every sandbox start.
"""

from __future__ import annotations

import errno
import os
import struct

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

MAX_SIDE = 0xFFFF  # rows or columns at most (the kernel's winsize holds 16 bits)
_tty_modules: list[Any] = []  # fcntl, termios


def _tty() -> list[Any]:
    """fcntl and termios, imported by the parent (never by a forked child: the import lock may be held there)."""
    if not _tty_modules:
        import fcntl
        import termios

        _tty_modules.extend((fcntl, termios))
    return _tty_modules


def check_size(size: Any) -> tuple[int, int]:
    """A terminal size from a request, ``{"rows": R, "cols": C}``, as (rows, cols), each 1..65535 (else ValueError)."""
    if not isinstance(size, dict):
        raise TypeError(f"'pty' must be {{'rows': R, 'cols': C}}, not {type(size).__name__}")
    rows, cols = size.get("rows"), size.get("cols")
    if not all(type(v) is int and 0 < v <= MAX_SIDE for v in (rows, cols)):
        raise ValueError(f"a terminal's rows and cols must be integers from 1 to {MAX_SIDE}, got {rows!r} x {cols!r}")
    return rows, cols  # type: ignore[return-value]


def set_size(fd: int, size: Any) -> None:
    """Set the size of the terminal whose master end is ``fd`` (the kernel signals SIGWINCH to its foreground)."""
    rows, cols = check_size(size)
    fcntl, termios = _tty()
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def open_terminal(size: Any) -> tuple[int, int]:
    """A new pseudo-terminal of ``size``: its (master, slave) ends, neither inherited by commands."""
    check_size(size)
    master, slave = os.openpty()
    try:
        set_size(master, size)
    except BaseException:
        os.close(master)
        os.close(slave)
        raise
    return master, slave


def take_terminal() -> None:
    """In a forked child that leads a new session and has the slave end as fd 0: make it its controlling terminal."""
    fcntl, termios = _tty_modules
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def resize(job: Any, size: Any) -> None:
    """Resize the terminal of a job started with ``pty`` (ValueError for a job without one; BrokenPipeError once
    its terminal is closed). Through the job's input end, under its lock, so a closed one is never reused."""
    if job.tty is None:
        raise ValueError(f"job {job.pid} was started without a terminal: there is nothing to resize")
    check_size(size)
    with job.stdin_lock:
        end = job.proc.stdin
        if end is None or end.closed:
            raise BrokenPipeError(errno.EPIPE, f"the terminal of job {job.pid} is closed")
        set_size(end.fileno(), size)
        job.tty = dict(size)
