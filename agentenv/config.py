"""Where agentenv keeps its state, and the parsing of user-facing sizes."""

from __future__ import annotations

import os
import re
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


@dataclass(frozen=True)
class Paths:
    """The on-disk layout: sandboxes, the snapshot store and runc's state."""

    home: Path

    @property
    def sandboxes(self) -> Path:
        return self.home / "sandboxes"

    @property
    def snapshots(self) -> Path:
        return self.home / "snapshots"

    @property
    def runc_root(self) -> Path:
        return self.home / "runc"

    @property
    def tmp(self) -> Path:
        return self.home / "tmp"


def paths() -> Paths:
    """The layout under $AGENTENV_HOME (default /var/lib/agentenv), created on first use."""
    p = Paths(Path(os.environ.get("AGENTENV_HOME", "/var/lib/agentenv")))
    for d in (p.sandboxes, p.snapshots, p.runc_root, p.tmp):
        d.mkdir(parents=True, exist_ok=True)
    return p
