"""A sandbox's container with its CRIU half: the runtime's ``Container`` (``agentenv.host.runtime``), which runs it with
runc, and here what dumps and restores it.

``checkpoint`` dumps every process (``agentenv.snapshot.criu``; lazily, its pages then served to a migration's
receiver, with ``agentenv.snapshot.postcopy``), ``restore`` brings a dump back into a prepared bundle: CRIU run
directly (``agentenv.snapshot.restore``) where it can do what runc would, else ``runc restore``. ``destroy`` also
ends a lazy restore's ``criu lazy-pages`` daemons (``agentenv.snapshot.lazy_pages``), which would otherwise wait
forever for a restore that never came. The host room stays free of CRIU: the sandbox builds this class.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from agentenv.config import write_private
from agentenv.errors import CheckpointError
from agentenv.host import runtime
from agentenv.host.cgroups import vfork_waiters
from agentenv.host.keeper_start import mount_as_dumped
from agentenv.host.runtime import LINK, ContainerSpec
from agentenv.snapshot import lazy_pages, page_channel, postcopy
from agentenv.snapshot.criu import dump as criu_dump
from agentenv.snapshot.criu import fix as criu_fix
from agentenv.snapshot.criu import reason as criu_reason
from agentenv.snapshot.criu import rundir
from agentenv.snapshot.restore import DIRECT_RESTORE_ENV, tcp_mode
from agentenv.snapshot.restore import hand_over as criu_hand_over
from agentenv.snapshot.restore import restore as criu_restore


class Container(runtime.Container):
    """A runc container (``agentenv.host.runtime.Container``) that CRIU dumps and restores (see the module doc)."""

    def checkpoint(self, images: Path, work: Path, leave_running: bool, criu: str | None = None,
                   page_server: page_channel.Listener | None = None) -> postcopy.PageServer | None:
        """Dump every process of the container with CRIU into ``images``, in the form ``runc restore`` takes
        (CRIU run directly, with runc's options and fewer costs: see ``agentenv.snapshot.criu``). With
        ``page_server`` (a migration's listener), a lazy dump whose pages are then served through it
        (``agentenv.snapshot.postcopy``), returned running."""
        f = self.freezer()
        waiting = vfork_waiters(f.parent / "tasks") if f is not None and self.frozen() else []
        if waiting:  # CRIU would try to seize them for its whole timeout, then fail
            raise CheckpointError(f"process(es) {', '.join(map(str, waiting))} of the sandbox wait for a vfork child "
                                  "that has not run its program yet: CRIU cannot save a process in that state. "
                                  "Nothing was saved and the sandbox runs on",
                                  fix="retry once the child has started its program (or exited)")
        try:
            if self.link_file.exists():  # what a restore compares its own address with (restore.tcp_mode)
                images.mkdir(mode=0o700, parents=True, exist_ok=True)
                write_private(images / LINK, self.link_file.read_bytes())
            if page_server is not None:
                return postcopy.PageServer.start(self.runc_root / self.cid / "state.json", images, work,
                                                 page_server, criu)
            criu_dump(self.runc_root / self.cid / "state.json", images, work, leave_running, criu)
            return None
        except CheckpointError:
            with contextlib.suppress(OSError):  # kept: the snapshot folder is removed on failure
                write_private(self.bundle / "last-dump.log", (work / "dump.log").read_bytes())
            raise

    def restore(self, images: Path, work: Path, spec: ContainerSpec, criu: str | None = None, lazy: bool = False,
                address: str | None = None) -> int:
        """Restore a CRIU dump into this (prepared) bundle; returns the host pid of init. Its network namespace is
        set up (``connect``, on ``address`` where free) before any of its processes runs. With ``lazy``, the
        processes run before their memory is in: a ``criu lazy-pages`` daemon listening in ``work`` serves it
        (``agentenv.snapshot.lazy_pages.start_lazy_pages``)."""
        mount_as_dumped(self.bundle / "config.json", images)  # images dumped before the keeper's rename
        criu_hand_over(images, work, self.bundle)
        if os.environ.get(DIRECT_RESTORE_ENV, "1") != "0":
            pid = criu_restore(images, work, self.bundle, self.cid, self.runc_root, lazy, criu,
                               setup=lambda pid: self.connect(spec, pid, restored=True, address=address),
                               address=address)
            if pid is not None:
                return pid
        pidfile = self.bundle / "init.pid"
        work.mkdir(parents=True, exist_ok=True)
        rundir()
        r = self.runc(*(["--criu", criu] if criu else []), "restore", "--detach", "--image-path", str(images),
                      "--work-path", str(work), "--bundle", str(self.bundle), "--pid-file", str(pidfile),
                      # the namespace is set up after runc's restore: connections through eth0 cannot come back
                      *(["--tcp-established"] if tcp_mode(images, None) == "--tcp-established" else []),
                      "--file-locks", *(["--lazy-pages"] if lazy else []), self.cid,
                      timeout=300)
        if r.returncode != 0:
            raise CheckpointError(f"CRIU restore failed: {criu_reason(r.stderr, work / 'restore.log')}",
                                  fix=criu_fix(criu))
        return int(pidfile.read_text())

    def destroy(self) -> None:
        """The runtime's ``destroy``, then the end of a lazy restore's daemons, if its memory was still coming in."""
        try:
            super().destroy()
        finally:
            lazy_pages.stop_lazy_daemons(self.bundle)
