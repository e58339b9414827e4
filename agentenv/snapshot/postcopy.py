"""Post-copy migration's host half: a lazy dump whose pages a CRIU page server hands out, and a lazy restore whose
``criu lazy-pages`` daemon pulls them from there instead of reading local images.

``PageServer.start`` runs ``criu dump --lazy-pages --ps-socket FD``: CRIU freezes the sandbox, writes every image
but the (lazy) anonymous pages, keeps those in pipes and serves them over FD, one end of a socket pair whose other
end agentenv's own listener (``agentenv.snapshot.page_channel``) joins to the first connection that proves the
migration's key: CRIU never listens itself, so no stranger reaches it. Its status fd says when it serves.
The dump runs with ``--leave-running``: when the transfer ends, well or not, CRIU puts the cgroup freezer back
as it found it (frozen, by ``snapshotting.frozen``) and lets go, so the source is still whole and frozen. The
caller then decides (``finish``): the receiver said it has every page (its daemon exited 0) -> the source is
destroyed; anything else -> it is thawed and runs on. That matters because CRIU's page server takes a clean
end of its one connection as success, whether or not every page went over (its ``page_server_serve``); left to
CRIU's own final state, a receiver dying at the wrong moment would have killed the only copy.

``abandon`` ends a transfer (nobody came within its deadline, or one stuck): the listener and its relay close, so
CRIU reads the end of its socket and lets the source go (it is killed if it does not).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import threading
from pathlib import Path

from agentenv.errors import CheckpointError
from agentenv.snapshot import criu as criu_mod
from agentenv.snapshot import page_channel
from agentenv.snapshot.criu import fix, reason, rundir

READY_TIMEOUT = 60.0  # seconds for CRIU to dump all but the pages and listen (or the daemon to connect)
END_TIMEOUT = 10.0  # seconds CRIU has to let go of the source once its transfer ended
LAZY_LOG_LEVEL = 2


def _start_ready(cmd: list[str], log: Path, what: str, sock: int) -> subprocess.Popen[bytes]:
    """Run ``cmd`` (which takes ``--status-fd`` last) with the page server's socket ``sock`` until it says it is
    ready on its status fd; the running process, or CheckpointError with CRIU's reason (it is ended then)."""
    rundir()
    r, w = os.pipe()
    try:
        proc = subprocess.Popen([*cmd, "--ps-socket", str(sock), "--status-fd", str(w)], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=(w, sock))
    except FileNotFoundError:
        os.close(r)
        os.close(w)
        raise CheckpointError(f"CRIU ({cmd[0]}) is not installed", fix=fix(cmd[0])) from None
    os.close(w)
    try:
        ready = select.select([r], [], [], READY_TIMEOUT)[0] and os.read(r, 1) == b"\0"
    finally:
        os.close(r)
    if ready:
        return proc
    _kill(proc)
    raise CheckpointError(f"{what} did not get ready within {READY_TIMEOUT:g} s: {reason('', log)}",
                          fix=fix(cmd[0]))


def _kill(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGKILL)
    proc.wait()


class PageServer:
    """A running lazy dump of one sandbox, its pages served through ``channel`` (see the module doc)."""

    def __init__(self, proc: subprocess.Popen[bytes], channel: page_channel.Listener, log: Path) -> None:
        self.proc, self.channel, self.log = proc, channel, log
        self.address, self.port = channel.address, channel.port

    @classmethod
    def start(cls, runc_state: Path, images: Path, work: Path, channel: page_channel.Listener,
              criu: str | None = None) -> PageServer:
        """Dump the runc container whose record is ``runc_state`` into ``images`` but for its lazy pages, which
        are then served through ``channel``; returns once CRIU serves. The sandbox must be frozen by the caller
        (its freezer is how it is left afterwards). CheckpointError if the dump fails (it runs on)."""
        args = criu_mod.prepare_dump(runc_state, images, work, leave_running=True)
        with channel.pair() as sock:  # CRIU has its own copy once started
            proc = _start_ready([criu or "criu", *args, "--lazy-pages"], work / "dump.log", "the lazy CRIU dump",
                                sock.fileno())
        channel.serve()
        return cls(proc, channel, work / "dump.log")

    def wait(self, timeout: float) -> int | None:
        """CRIU's exit status once its transfer ended, or None if it still serves after ``timeout`` s."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def abandon(self) -> int:
        """End the transfer now (a receiver that never came, or one stuck): CRIU's exit status; the source is
        kept either way (frozen). The listener is closed whatever happened before."""
        self.channel.close()  # CRIU reads the end of its socket
        if self.wait(END_TIMEOUT) is None:
            _kill(self.proc)
        return int(self.proc.returncode)

    def listening(self) -> bool:
        """True while the page server still waits for its receiver (nobody proved the migration's key yet)."""
        return self.channel.listening()

    def failure(self) -> str:
        """Why the transfer failed, from CRIU's log."""
        return reason(f"CRIU exited with status {self.proc.returncode}", self.log)


_exits: dict[int, int] = {}  # pid -> exit status of the lazy-pages daemons this process started (pull_pages)
_exited = threading.Condition()


def pull_pages(own: Path, work: Path, page_server: page_channel.Endpoint, criu: str | None = None) -> int:
    """Start a ``criu lazy-pages`` daemon over the images in ``own`` whose pages come from the migration's page
    server (the connection authenticated first: ``page_channel.connect``); its pid once it listens for the restore
    in ``work``. Its exit status is kept (``pulled``): 0 once every page is in. CheckpointError if it cannot start
    (the page server is gone, or is not the migration's)."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "lazy-pages.socket").unlink(missing_ok=True)
    cmd = [criu or "criu", "lazy-pages", "--page-server", "--images-dir", str(own), "--work-dir", str(work),
           "--log-file", "lazy-pages.log", f"-v{LAZY_LOG_LEVEL}"]
    with page_channel.connect(page_server) as sock:  # CRIU has its own copy once started
        proc = _start_ready(cmd, work / "lazy-pages.log", f"the lazy-pages daemon pulling from {page_server}",
                            sock.fileno())

    def reap() -> None:
        code = proc.wait()
        with _exited:
            _exits[proc.pid] = code
            _exited.notify_all()

    threading.Thread(target=reap, name="agentenv-pull-pages", daemon=True).start()
    return proc.pid


def pulled(pid: int, timeout: float) -> bool:
    """True once the daemon ``pull_pages`` started as ``pid`` exited 0 (every page in), waiting at most
    ``timeout`` s; False if it failed, still runs, or is not one of this process's."""
    with _exited:
        _exited.wait_for(lambda: pid in _exits, timeout)
        return _exits.get(pid) == 0
