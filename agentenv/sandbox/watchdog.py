"""Who holds a home's sandboxes to their deadlines when no server runs: one small process per agentenv home.

A sandbox's deadline (``ttl``, ``expires_at`` in its record) once held only while ``agentenv serve`` or
``agentenv gc`` ran: a script that forgot to close its sandboxes left them running for ever. Now making a
sandbox with a deadline (create, fork, restore, the warm pool, ``set_ttl``, a resume) calls ``ensure``, which
starts this home's reaper (``agentenv.sandbox.reaper``) unless one runs: a detached process (its own session,
so the maker's exit or ^C does not end it) that closes each sandbox at its deadline and exits once no
sandbox of the home is left with one to keep. It holds ``<home>/watchdog.lock`` (an ``flock``) while it
watches, which is how ``ensure`` knows, at the cost of one open and one lock attempt.

The race between the reaper leaving and a new sandbox appearing is closed by order: a maker writes its record
before it calls ``ensure``, and the reaper, after it lets go of the lock, looks at the records once more before
it exits (and takes the lock again if one appeared, unless another reaper already has).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from agentenv.config import PRIVATE_FILE, paths, where

MODULE = "agentenv.sandbox.reaper"  # the process ``ensure`` starts (run as ``python -m``)
_started: list[subprocess.Popen[bytes]] = []  # the reapers this process started: waited for once they exit


def lock_path() -> Path:
    return where().home / "watchdog.lock"


def log_path() -> Path:
    """Where the reaper writes what it could not do (a sandbox it failed to close), for ``agentenv gc`` users."""
    return paths().home / "watchdog.log"


@contextlib.contextmanager
def held(block: bool = False) -> Iterator[bool]:
    """This home's watchdog lock, tried (``block=False``) or waited for; yields whether it is held.
    FileNotFoundError once the home is gone."""
    fd = os.open(lock_path(), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, PRIVATE_FILE)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def running() -> bool:
    """Whether a reaper watches this home now."""
    if not where().home.exists():
        return False
    with held() as free:
        return not free


def ensure() -> None:
    """Start this home's reaper unless one runs (call it after the record with the deadline is written)."""
    if running():
        return
    _started[:] = [p for p in _started if p.poll() is None]  # those that exited, waited for (no zombie stays)
    home = str(paths().home)
    with open(log_path(), "ab", buffering=0) as log:
        os.chmod(log.fileno(), PRIVATE_FILE)
        _started.append(subprocess.Popen([sys.executable, "-m", MODULE], cwd="/", env={**os.environ, "AGENTENV_HOME": home},
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                                         start_new_session=True))
