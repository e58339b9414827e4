"""Where agentenv keeps its state, the parsing of user-facing sizes, and the crash points of the tests."""

from __future__ import annotations

import os
import re
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: str | int) -> int:
    """Parse '512m', '1g', '1.5GiB' or a byte count; raise ValueError on anything else."""
    if isinstance(value, bool):
        raise ValueError(f"invalid size {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"size must be positive, got {value}")
        return value
    m = _SIZE.match(str(value))
    if not m:
        raise ValueError(f"invalid size {value!r}: use a number with an optional unit k, m, g or t (e.g. '1g')")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"size must be positive, got {value!r}")
    return n


MIN_DISK = 16 << 20


def parse_disk(value: str | int | None) -> int | None:
    """A disk limit: a size of at least 16 MiB ('10g', bytes), or None for no limit."""
    if value is None:
        return None
    n = parse_size(value)
    if n < MIN_DISK:
        raise ValueError(f"disk must be at least 16m, got {value!r}")
    return n


@dataclass(frozen=True)
class Paths:
    """The on-disk layout under the home (see ``agentenv.host.volume`` for the volume)::

        sandboxes/<id>/     each sandbox's record, OCI bundle, rootfs mount point and logs (host filesystem)
        snapshots/<id>/     the snapshot store: meta.json and criu/, the processes' images (host filesystem,
                            which writes them several times faster than btrfs does)
        runc/, tmp/         runc's state; scratch
        agents/             the in-sandbox agent, its parts joined, one file by content (bind-mounted read-only)
        volume.img          the sparse btrfs image of the volume (when agentenv made it)
        volume/             the volume: what sandboxes write, and the files of snapshots (one filesystem, so
                            that a snapshot's files are reflinks of the sandbox's, and a restore's of the snapshot's)
          layers/<id>/      a sandbox's overlay upper and work folders: one subvolume, its disk limit
          snapshots/<id>/   a snapshot's files (what fs/ of the store held): a subvolume, the store's limit
    """

    home: Path

    @property
    def sandboxes(self) -> Path:
        return self.home / "sandboxes"

    @property
    def volume(self) -> Path:
        return self.home / "volume"

    @property
    def volume_image(self) -> Path:
        return self.home / "volume.img"

    @property
    def layers(self) -> Path:
        return self.volume / "layers"

    @property
    def snapshots(self) -> Path:
        return self.home / "snapshots"

    @property
    def snapshot_files(self) -> Path:
        return self.volume / "snapshots"

    @property
    def agents(self) -> Path:
        return self.home / "agents"

    @property
    def runc_root(self) -> Path:
        return self.home / "runc"

    @property
    def tmp(self) -> Path:
        return self.home / "tmp"


def paths() -> Paths:
    """The layout under $AGENTENV_HOME (default /var/lib/agentenv), created on first use (the volume's
    folders are made by ``agentenv.host.volume.ensure``, which may mount the volume there first)."""
    p = Paths(Path(os.environ.get("AGENTENV_HOME", "/var/lib/agentenv")))
    if not p.tmp.is_dir():  # made last: one stat a call once made (a sandbox start asks ~10 times)
        for d in (p.sandboxes, p.snapshots, p.runc_root, p.tmp):
            d.mkdir(parents=True, exist_ok=True)
    return p


CRASH_ENV = "AGENTENV_CRASH_AT"


def crash_point(name: str) -> None:
    """A test hook: with ``$AGENTENV_CRASH_AT`` = ``name``, this process kills itself with SIGKILL here, as a
    ``kill -9`` from outside would; with ``name@seconds``, a timer does it that much later, so that the kill
    lands in the middle of what follows (a runc checkpoint, say). Nothing happens otherwise."""
    want = os.environ.get(CRASH_ENV)
    if not want:
        return
    point, _, delay = want.partition("@")
    if point != name:
        return
    if delay:
        threading.Timer(float(delay), os.kill, (os.getpid(), signal.SIGKILL)).start()
    else:
        os.kill(os.getpid(), signal.SIGKILL)
