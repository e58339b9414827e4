"""Lazy restores: a restored sandbox runs before its memory is in, served by a ``criu lazy-pages`` daemon.

Copying every page before the processes run was most of CRIU's restore (~55 ms of ~90 for
100 MB). Where a dump's pages take LAZY_MIN_BYTES or more, ``Restore`` starts a ``criu lazy-pages`` daemon over
the images (in a thread, while the sandbox's root is mounted) and CRIU restores with ``--lazy-pages``: the
processes run as soon as all but their anonymous memory is back, and the daemon fills pages in as they are
touched (userfaultfd), copies the rest in the background and exits. The keeper's own pages are copied up front
(``eager_pages``): served one fault at a time, they made its first answer ~30 ms late. The rules that keep this
safe:

- the daemon (and the restore) read hard links to the images in the sandbox's own folder, so the snapshot may
  be deleted at once (a resume deletes the paused one, a fork its own); the links go when the daemon is done;
- nothing may dump the sandbox before the daemon is done (a page not in yet reads as absent, and would be
  missing from the new snapshot): the sandbox's record names the daemon (pid and start time) and a memory
  snapshot, pause or fork waits for it to exit (``wait_lazy_pages``);
- a daemon whose sandbox goes away is ended with it (``Container.destroy``: ``stop_lazy_daemons``), so one whose
  restore never came (its maker killed in between) does not wait forever;
- the risk left: a daemon killed from outside before it is done leaves the pages it had not brought in reading
  as zeros. ``$AGENTENV_LAZY_PAGES=0`` turns lazy restores off (every page is copied up front, as before);
  "all" makes every restore lazy, whatever its size (how the test suite exercises this path everywhere).
- with sandboxes in user namespaces, CRIU opens its userfaultfd from inside one, which the kernel allows only
  with ``vm.unprivileged_userfaultfd=1`` (``userfaultfd_allowed``); without it every restore is eager.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import select
import shutil
import signal
import subprocess
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

from pycriu import images as criu_images

from agentenv.config import replacing
from agentenv.errors import CheckpointError
from agentenv.host.hostcalls import proc_start_time, run_program
from agentenv.phases import phase
from agentenv.snapshot import page_channel, postcopy
from agentenv.snapshot.criu import rundir

log = logging.getLogger("agentenv")

LAZY_ENV = "AGENTENV_LAZY_PAGES"  # "0": no lazy restores; "all": every one, whatever its size
LAZY_LOG_LEVEL = 2  # the daemon logs every page it serves at level 4
LAZY_START_TIMEOUT = 30.0
# Below this, pages are restored up front (lazy_worth_it): a lazy restore costs ~14 ms more in fixed work (the
# daemon, runc's feature check: 88 vs 74 ms for a 6 MB dump) and saves ~55 ms per 100 MB of pages.
LAZY_MIN_BYTES = 32 << 20
LAZY_REAP_WAIT = 24 * 3600.0
LAZY_WAIT = 120.0  # seconds a memory snapshot waits for a lazily restored sandbox's memory to be all in


class Restore:
    """A restore of a dump's processes, begun early: where ``lazy_worth_it``, the lazy-pages daemon starts in a
    thread at once (~8 ms), getting ready while the caller mounts the sandbox's root; ``run`` then restores, and
    ``cancel`` ends the daemon if ``run`` never came (the start failed before it). With ``page_server`` (a
    post-copy migration's: ``agentenv.snapshot.postcopy``) the pages are not in the images: the daemon pulls them
    from there, and a restore that cannot be lazy fails instead of copying pages up front."""

    def __init__(self, images: Path, bundle: Path, criu: str | None = None,
                 page_server: page_channel.Endpoint | None = None) -> None:
        self.images, self.bundle, self.criu, self.page_server = images, bundle, criu, page_server
        self.own = bundle / f"criu-lazy-{uuid.uuid4().hex[:12]}"
        self._daemon: int | None = None
        self._error: CheckpointError | None = None
        self._thread: threading.Thread | None = None
        if page_server is not None and (os.environ.get(LAZY_ENV, "1") == "0" or not userfaultfd_allowed()):
            raise CheckpointError("a post-copy migration restores lazily, and lazy restores are off on this host",
                                  fix="set vm.unprivileged_userfaultfd=1 (scripts/bootstrap.sh) and unset "
                                      f"${LAZY_ENV}=0 on the receiving server, or move the sandbox without "
                                      "post_copy")
        if page_server is not None or lazy_worth_it(images):
            self._thread = threading.Thread(target=self._start_daemon, name="agentenv-lazy-start")
            self._thread.start()

    def _start_daemon(self) -> None:
        with phase("lazy-pages daemon"):
            work = self.bundle / "criu-restore"
            if self.page_server is None:
                self._daemon = start_lazy_pages(self.images, self.own, work, self.criu)
                return
            try:
                link_images(self.images, self.own)
                self._daemon = postcopy.pull_pages(self.own, work, self.page_server, self.criu)
            except (OSError, CheckpointError) as e:
                shutil.rmtree(self.own, ignore_errors=True)
                self._error = e if isinstance(e, CheckpointError) else CheckpointError(
                    f"could not link the migrated images: {e}", fix="check the server's disk")

    def _started(self) -> int | None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return self._daemon

    def run(self, run: Callable[[Path, bool], int]) -> tuple[int, list[int] | None]:
        """Restore with ``run(images, lazy)`` (``runc restore`` into the sandbox's bundle); the pid of the init, and
        the daemon bringing the memory in as [pid, start time] (None when every page is in already), which the
        sandbox's record keeps for ``await_memory``."""
        daemon = self._started()
        start = None
        if daemon is not None:
            with contextlib.suppress(ProcessLookupError):
                start = proc_start_time(daemon)
        if daemon is not None and start is None:  # it died as it started: restore every page up front
            self.cancel()
            daemon = None
        if daemon is None and self.page_server is not None:  # the pages are on the page server alone
            raise self._error or CheckpointError(
                f"the lazy-pages daemon pulling from {self.page_server} died as it started",
                fix="the source's page server may be gone (its deadline passed): move again")
        try:
            with phase("criu restore"):
                pid = run(self.own if daemon is not None else self.images, daemon is not None)
        except BaseException:
            self.cancel()
            raise
        self._daemon = None  # the sandbox's now: it ends with its processes (Container.destroy ends it too)
        if daemon is None or start is None:
            return pid, None
        reap_lazy_pages(daemon, start, self.own)
        return pid, [daemon, start]

    def cancel(self) -> None:
        """End the daemon (if one started) and drop its links: the restore failed or never came."""
        daemon = self._started()
        self._daemon = None
        if daemon is not None:
            stop_lazy_pages(daemon, self.own)


def await_memory(daemon: list[int], sandbox_id: str) -> None:
    """Wait until the daemon bringing a lazily restored sandbox's memory in is done (a dump before then would miss
    the pages not in yet); CheckpointError if that takes more than LAZY_WAIT seconds."""
    with phase("memory in"):
        if not wait_lazy_pages(daemon[0], daemon[1], LAZY_WAIT):
            raise CheckpointError(f"sandbox {sandbox_id} is still bringing its memory in after {LAZY_WAIT:g} s "
                                  f"(criu lazy-pages, pid {daemon[0]}); nothing was saved",
                                  fix="retry; if it persists, read lazy-pages.log in the sandbox's criu-restore "
                                      "folder")


def lazy_worth_it(images: Path) -> bool:
    """True if a restore of these images should bring their memory in lazily: where their pages take at least
    LAZY_MIN_BYTES (below that, copying them up front costs less than starting the daemon and runc's check that
    CRIU can serve pages lazily); never with ``$AGENTENV_LAZY_PAGES`` "0", always with "all"."""
    mode = os.environ.get(LAZY_ENV, "1")
    if mode == "0" or not userfaultfd_allowed():
        return False
    if mode == "all":
        return True
    total = 0
    with contextlib.suppress(OSError):
        for f in images.glob("pages-*.img"):
            total += f.stat().st_size
    return total >= LAZY_MIN_BYTES


UFFD_SYSCTL = Path("/proc/sys/vm/unprivileged_userfaultfd")


@functools.cache
def userfaultfd_allowed() -> bool:
    """True if CRIU can serve a restore's pages lazily here: its restorer opens a userfaultfd from inside the
    sandbox's user namespace, which the kernel allows only with ``vm.unprivileged_userfaultfd=1`` (set by
    scripts/bootstrap.sh; the sandbox's own code still cannot: seccomp refuses it the system call). Without it
    every restore copies its pages up front, said once."""
    try:
        if UFFD_SYSCTL.read_text().strip() == "1":
            return True
    except OSError:
        pass
    log.warning("lazy restores are off: with sandboxes in user namespaces they need vm.unprivileged_userfaultfd=1 "
                "(run scripts/bootstrap.sh, or sysctl -w vm.unprivileged_userfaultfd=1)")
    return False


def start_lazy_pages(images: Path, own: Path, work: Path, criu: str | None = None) -> int | None:
    """Link a dump's images into ``own`` (a new folder of the restoring sandbox) and start a ``criu lazy-pages``
    daemon that serves their pages from there; its pid, or None where it could not start (the caller then
    restores every page up front).

    The links make the images the sandbox's own while its memory comes in: the snapshot may be deleted at once
    (a resume deletes the paused one, a fork its own) without the daemon losing a page. ``own`` goes once the
    daemon is done (``reap_lazy_pages``) or with the sandbox's folder.
    """
    try:
        link_images(images, own)
        eager_pages(own / "pagemap-1.img")
        work.mkdir(parents=True, exist_ok=True)
        (work / "lazy-pages.socket").unlink(missing_ok=True)
        pidfile = work / "lazy-pages.pid"
        pidfile.unlink(missing_ok=True)
        rundir()
        # --daemon: the command returns once the daemon listens on work/lazy-pages.socket, where the restore looks
        r = run_program([criu or "criu", "lazy-pages", "--images-dir", str(own), "--work-dir", str(work),
                         "--log-file", "lazy-pages.log", f"-v{LAZY_LOG_LEVEL}", "--pidfile", str(pidfile),
                         "--daemon"], LAZY_START_TIMEOUT)
        if r.returncode == 0:
            return int(pidfile.read_text())
    except (OSError, ValueError, subprocess.TimeoutExpired):
        pass
    _kill_serving([own])  # a daemon that did start (its start timed out, say) would wait for a restore forever
    shutil.rmtree(own, ignore_errors=True)
    return None


def link_images(images: Path, own: Path) -> None:
    """Hard links to a dump's images in ``own``, a new folder (see ``start_lazy_pages``)."""
    own.mkdir(mode=0o700)
    for f in images.iterdir():
        os.link(f, own / f.name)


def stop_lazy_pages(pid: int, own: Path) -> None:
    """End a lazy-pages daemon whose restore failed (its processes are gone: no page is needed) and drop its links."""
    with contextlib.suppress(OSError):
        fd = os.pidfd_open(pid)
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        finally:
            os.close(fd)
    shutil.rmtree(own, ignore_errors=True)


def stop_lazy_daemons(bundle: Path) -> None:
    """Kill the lazy-pages daemons serving images linked into ``bundle``, whose sandbox is going away: one whose
    restore never connected (its maker was killed in between) would otherwise wait for it forever."""
    _kill_serving(list(bundle.glob("criu-lazy-*")))


def _kill_serving(folders: list[Path]) -> None:
    """SIGKILL every ``criu lazy-pages`` process serving images from one of these folders."""
    dirs = [str(d).encode() for d in folders]
    if not dirs:
        return
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if b"lazy-pages" in cmd and any(d + b"\0" in cmd for d in dirs):
            with contextlib.suppress(OSError):
                os.kill(int(entry.name), signal.SIGKILL)


def wait_lazy_pages(pid: int, start: int, timeout: float) -> bool:
    """Wait until the lazy-pages daemon ``pid`` (which started at ``start``, field 22 of its stat) has served
    every page and exited; True when it has (or was gone already), False if it still runs after ``timeout`` s."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        if proc_start_time(pid) != start:
            return True  # the pid is another process's now: the daemon is long gone
        return bool(select.select([fd], [], [], timeout)[0])  # a pidfd reads ready when its process has exited
    except ProcessLookupError:  # gone as we looked
        return True
    finally:
        os.close(fd)


def reap_lazy_pages(pid: int, start: int, own: Path) -> None:
    """In a thread, wait for the daemon to finish and then drop its links to the images (best effort: the links
    otherwise go with the sandbox's folder)."""
    def reap() -> None:
        if wait_lazy_pages(pid, start, LAZY_REAP_WAIT):
            shutil.rmtree(own, ignore_errors=True)

    threading.Thread(target=reap, name="agentenv-lazy-reap", daemon=True).start()


def eager_pages(pagemap: Path) -> None:
    """Have a lazy restore copy a process's pages up front after all: clear the lazy flag of every entry of its
    pagemap image, written anew in place of ``pagemap`` (a hard link: the snapshot's own file is left as it is).

    Used for the sandbox's init, the keeper: the first call after a restore runs through a few hundred of its
    ~1000 lazily restorable pages, each a page fault served by the daemon (~30 ms in all, measured, while the
    daemon also copies in the background), where copying its few MB up front takes a couple of ms. Left as it
    is if the image is not in the expected form.
    """
    try:
        with open(pagemap, "rb") as f:
            image = criu_images.load(f)
        for entry in image["entries"][1:]:  # the head (pages_id) stays; every later entry is a pagemap_entry
            entry["flags"] = int(entry.get("flags", 0)) & ~_PE_LAZY
    except (OSError, ValueError, TypeError, KeyError, criu_images.MagicException):
        return
    with replacing(pagemap) as f:
        criu_images.dump(image, f)


_PE_LAZY = 1 << 1  # criu/include/pagemap.h
