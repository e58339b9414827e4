"""An imported memory snapshot's CRIU images moved into the uid range its new server leased it (issue 40).

A snapshot's processes are restored by CRIU as its images say, and the images are the one part of an import the
receiving server cannot rebuild (``agentenv.snapshot.trust`` authenticates them). Two things in them are host facts
of the sender, and are set here to this server's:

- the user namespace's maps (``userns-*.img``, and runc's record of the container kept beside the images): CRIU
  makes the sandbox's user namespace from them, so they must name the new range, whose ids its files now have.
  Exactly one extent of ``userns.SIZE`` ids from 0 is what agentenv dumps: any other map is refused;
- every thread's capability sets (``core-*.img``): cut to the sandbox's own (``caps``), the bounding set with them.
  A sandbox's processes never hold more, so for a real dump this changes nothing.

The processes' ids (0..65535) and the files' (unpacked into the new range) need nothing: CRIU keeps them as the
sandbox sees them.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pycriu import images as criu_images

from agentenv.config import PRIVATE_FILE, replacing, write_json
from agentenv.host import userns
from agentenv.snapshot.criu import RUNC_STATE

# Linux's capability numbers (linux/capability.h)
CAPS = ("CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL", "CAP_SETGID",
        "CAP_SETUID", "CAP_SETPCAP", "CAP_LINUX_IMMUTABLE", "CAP_NET_BIND_SERVICE", "CAP_NET_BROADCAST",
        "CAP_NET_ADMIN", "CAP_NET_RAW", "CAP_IPC_LOCK", "CAP_IPC_OWNER", "CAP_SYS_MODULE", "CAP_SYS_RAWIO",
        "CAP_SYS_CHROOT", "CAP_SYS_PTRACE", "CAP_SYS_PACCT", "CAP_SYS_ADMIN", "CAP_SYS_BOOT", "CAP_SYS_NICE",
        "CAP_SYS_RESOURCE", "CAP_SYS_TIME", "CAP_SYS_TTY_CONFIG", "CAP_MKNOD", "CAP_LEASE", "CAP_AUDIT_WRITE",
        "CAP_AUDIT_CONTROL", "CAP_SETFCAP", "CAP_MAC_OVERRIDE", "CAP_MAC_ADMIN", "CAP_SYSLOG", "CAP_WAKE_ALARM",
        "CAP_BLOCK_SUSPEND", "CAP_AUDIT_READ", "CAP_PERFMON", "CAP_BPF", "CAP_CHECKPOINT_RESTORE")
_SETS = ("cap_inh", "cap_prm", "cap_eff", "cap_bnd", "cap_amb")


def mask(caps: Sequence[str]) -> int:
    """The bits of ``caps`` (names, as in an OCI spec)."""
    return sum(1 << CAPS.index(c) for c in caps)


def rehome(images: Path, base: int, caps: Sequence[str]) -> None:
    """Set the images in ``images`` to the range whose root is ``base`` and cut their capabilities to ``caps`` (see
    the module doc); ValueError naming what is not what agentenv dumps."""
    for img in sorted(images.glob("userns-*.img")):
        _edit(img, functools.partial(_maps, base=base, name=img.name))
    for img in sorted(images.glob("core-*.img")):
        _edit(img, functools.partial(_caps, allowed=mask(caps)))
    state = images / RUNC_STATE
    if state.exists():
        record = json.loads(state.read_text())
        config = record.get("config") or {}
        for key in ("uid_mappings", "gid_mappings"):
            config[key] = [{"container_id": 0, "host_id": base, "size": userns.SIZE}]
        for dev in config.get("devices") or []:
            dev["uid"] = dev["gid"] = base
        config["capabilities"] = {k: sorted(caps) for k in ("Bounding", "Effective", "Permitted")}
        write_json(state, record, mode=PRIVATE_FILE)


def _maps(entry: dict[str, Any], base: int, name: str) -> None:
    for key in ("uid_map", "gid_map"):
        extents = entry.get(key) or []
        if [(e.get("first"), e.get("count")) for e in extents] != [(0, userns.SIZE)]:
            raise ValueError(f"{name}'s {key} is not one extent of {userns.SIZE} ids from 0: {extents}")
        extents[0]["lower_first"] = base


def _caps(entry: dict[str, Any], allowed: int) -> None:
    creds = (entry.get("thread_core") or {}).get("creds")
    if creds is None:
        return
    for key in _SETS:
        words = creds.get(key) or []
        creds[key] = [w & (allowed >> (32 * i)) & 0xFFFFFFFF for i, w in enumerate(words)]


def _edit(img: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Load a CRIU image, ``change`` each entry, write it back (atomically)."""
    with open(img, "rb") as f:
        data = criu_images.load(f)
    for entry in data["entries"]:
        change(entry)
    with replacing(img) as f:
        criu_images.dump(data, f)
