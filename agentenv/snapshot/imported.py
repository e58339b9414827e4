"""What an imported snapshot's record becomes here: rebuilt from this server's own facts, never taken as sent
(issue 40: a crafted record gave a sandbox a host folder as a layer and CAP_SYS_ADMIN).

Every field of the record (``meta.json``) is recomputed here or refused (UntrustedSnapshot), never kept unread:

- the image's layers: the folders of the local image with the record's image id (ImageNotFound where there is none);
- the capabilities: the runtime's defaults (``DEFAULT_CAPS``), which every sandbox has;
- the uid range: the one leased to the import (``agentenv.snapshot.unpack`` unpacked the files into it), and a memory
  snapshot's CRIU images moved into it, their capabilities cut to the defaults (``agentenv.snapshot.criu_images``);
- what the sandbox's creator asked for (limits, network and its rules, ``share_memory``, env, workdir): checked as a
  create on this server checks them (``Limits.checked``; ``netpolicy.check`` with this host's subnet, host names
  resolved here again; KSM present), so an import asks for nothing a create here could not, and refused otherwise.
  Not the server's defaults: a memory snapshot's processes need the memory limit they had;
- ``has_memory``: whether CRIU's images are there; sizes, ``layer``: measured here; the owner: none; labels:
  strings, with the server the snapshot came from (``ORIGIN``);
- any other field: refused.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

from agentenv import netpolicy
from agentenv.api import Limits
from agentenv.errors import AgentEnvError, UntrustedSnapshot
from agentenv.host import images, ksm, volume
from agentenv.host import network as hostnet
from agentenv.host.runtime import DEFAULT_CAPS, ContainerSpec
from agentenv.snapshot import criu_images, store
from agentenv.snapshot.store import Snapshot

ORIGIN = "agentenv.imported_from"  # label of an imported snapshot: the url of the server it came from
_IMAGE_ID = re.compile(r"^sha256:[0-9a-f]{64}$")
_SPEC = frozenset(ContainerSpec.__dataclass_fields__)
_FIX = "take the snapshot again on a server of this agentenv version; a record no server wrote is never restored"


def rebuild(tmp: Path, record: dict[str, Any], origin: str, base: int) -> Snapshot:
    """The snapshot unpacked in the staging folder ``tmp`` (``record``: its meta.json as sent), its files and images
    in the range whose root is ``base``, as this server's record."""
    sid = record.get("id")

    def refuse(why: str) -> UntrustedSnapshot:
        return UntrustedSnapshot(f"the record of snapshot {sid} {why}; it was refused and nothing was kept", fix=_FIX)

    if set(record) - {f for f in Snapshot.__dataclass_fields__}:
        raise refuse(f"has fields no snapshot has: {sorted(set(record) - set(Snapshot.__dataclass_fields__))}")
    spec = _spec(record.get("spec"), base, refuse)
    criu = tmp / "criu"
    has_memory = (criu / "inventory.img").is_file()
    if record.get("has_memory") is not has_memory:
        raise refuse(f"says has_memory={record.get('has_memory')!r}, and its archive {'holds' if has_memory else 'holds no'}"
                     " CRIU images")
    if has_memory:
        try:
            criu_images.rehome(criu, base, spec.caps)
        except (ValueError, KeyError, TypeError, OSError) as e:
            raise refuse(f"has CRIU images agentenv does not dump ({e})") from e
    labels, stats = record.get("labels", {}), record.get("criu_stats", {})
    if not _strings(labels) or not isinstance(stats, dict) or not all(
            isinstance(k, str) and type(v) is int for k, v in stats.items()):
        raise refuse("has labels or statistics that are not strings and integers")
    created = record.get("created_at")
    if not isinstance(created, int | float) or isinstance(created, bool) or not math.isfinite(created):
        raise refuse(f"has a creation time {created!r}")
    for key in ("parent_id", "sandbox_id"):
        if not (record.get(key) is None or isinstance(record.get(key), str)):
            raise refuse(f"has a {key} that is no id")
    return Snapshot(id=str(sid), parent_id=record.get("parent_id"), created_at=float(created),
                    size_bytes=store.size_of(tmp), has_memory=has_memory, sandbox_id=record.get("sandbox_id"),
                    labels={**labels, ORIGIN: origin}, spec=spec.to_json(), criu_stats=stats, owner=None,
                    layer=volume.is_subvolume(store.files_of(tmp)))


def _strings(d: Any) -> bool:
    return isinstance(d, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in d.items())


def _spec(d: Any, base: int, refuse: Any) -> ContainerSpec:
    """The sandbox's spec here (see the module doc)."""
    if not isinstance(d, dict) or set(d) - _SPEC or not {"image_id", "env", "workdir", "limits"} <= set(d):
        raise refuse("has no spec in the form agentenv writes")
    image_id, env, workdir = d["image_id"], d["env"], d["workdir"]
    if not (isinstance(image_id, str) and _IMAGE_ID.match(image_id)):
        raise refuse(f"names no image id ({image_id!r})")
    if not (isinstance(env, list) and all(isinstance(e, str) and "=" in e and "\0" not in e for e in env)):
        raise refuse("has an environment that is not a list of NAME=value")
    if not (isinstance(workdir, str) and os.path.isabs(workdir) and "\0" not in workdir):
        raise refuse(f"has a working folder {workdir!r} that is not an absolute path")
    network, share_memory = d.get("network", False), d.get("share_memory", False)
    if not isinstance(network, bool) or not isinstance(share_memory, bool):
        raise refuse("has network or share_memory that is not true or false")
    try:
        limits = Limits.from_wire(d["limits"]).checked()
        rules = None
        if network:
            asked = netpolicy.Rules.from_json(d.get("rules"))
            rules = netpolicy.check(asked.allow_out, asked.deny_out, never=(str(hostnet.subnet()),)).to_json()
        elif d.get("rules") is not None:
            raise ValueError("outbound rules without network")
        if share_memory:
            ksm.require()
    except (ValueError, TypeError, AttributeError, AgentEnvError) as e:
        raise refuse(f"asks for what a create here is refused: {e}") from e
    info = images.resolve(image_id)  # the layers of the image here: ImageNotFound where there is none
    return ContainerSpec(image_id=info.id, layers=info.layers, env=list(env), workdir=workdir, limits=limits,
                         network=network, caps=list(DEFAULT_CAPS), rules=rules, uids=base, share_memory=share_memory)
