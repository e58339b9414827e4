"""Where a sandbox's image comes from when the host lacks it, what the images cost on disk, and which go first.

``ensure(name)`` takes an image from, in order: the local Docker store; a ``docker load`` tarball
(``<folder>/<name>.tar`` or ``.tar.gz``, the name with every character outside ``[A-Za-z0-9._-]`` made ``_``); each
mirror prefix (a registry that mirrors the image's namespace: ``127.0.0.1:5000`` makes
``swebench/sweb.eval.x86_64.x:latest`` into ``127.0.0.1:5000/swebench/sweb.eval.x86_64.x:latest``; the image's
own registry host, if it names one, is replaced), the pulled image then tagged with the name asked for; and last
the image's own registry. Pulls show their progress and stop at a deadline; when no source gives the image,
``ImageUnavailable`` names it, says what each source answered and what to do. The sources come from
``ImageSources``: given, or read from the environment (``AGENTENV_IMAGE_MIRRORS``: comma-separated prefixes;
``AGENTENV_IMAGE_TARBALLS``: a folder; ``AGENTENV_IMAGE_PULL=0``: never pull; ``AGENTENV_PULL_DEADLINE``:
seconds, default 600); an env server takes them from ``agentenv serve``'s options, never from a request.

Docker records no time of last use, so agentenv keeps its own: ``record_use`` (called as a sandbox starts from an
image, or is restored or forked onto one) sets the mtime of ``<home>/image-uses/<image id>``, a file whose
content is the image's names and how agentenv got it. ``usage()`` reports every image's size (``docker system df``:
``Size``, and ``SharedSize`` with other images), its last use (that mtime; an image never used through agentenv
has none and sorts first) and whether something stands on it. ``evict(budget)`` removes images, least recently
used first, until the images' layers fit in ``budget`` bytes; it never removes an image a sandbox (any state,
warm ones included) or a snapshot of this home stands on, nor one a Docker container uses, nor agentenv's base
image, and by default only images agentenv fetched itself (``ensure``: a load or a pull), not ones you built.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentenv.api import DEFAULT_IMAGE, ImageFetch
from agentenv.config import PRIVATE_FILE, paths, write_json
from agentenv.errors import AgentEnvError, ImageUnavailable
from agentenv.host import images

Say = Callable[[str], None]


@dataclass(frozen=True)
class ImageSources:
    """Where ``ensure`` looks for an image the host lacks (see the module doc)."""

    mirrors: tuple[str, ...] = ()
    tarballs: str | None = None
    pull: bool = True
    deadline: float = images.PULL_DEADLINE

    def __post_init__(self) -> None:
        for m in self.mirrors:
            if not re.fullmatch(r"[A-Za-z0-9.-]+(:\d+)?(/[a-z0-9._/-]+)?", m):
                raise ValueError(f"mirror {m!r} is not a registry prefix (HOST[:PORT][/PATH], e.g. 127.0.0.1:5000)")
        if not self.deadline > 0:
            raise ValueError(f"the pull deadline must be positive, got {self.deadline!r}")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> ImageSources:
        env = os.environ if environ is None else environ
        mirrors = tuple(m.strip() for m in env.get("AGENTENV_IMAGE_MIRRORS", "").split(",") if m.strip())
        deadline = env.get("AGENTENV_PULL_DEADLINE", "").strip()
        return cls(mirrors=mirrors, tarballs=env.get("AGENTENV_IMAGE_TARBALLS") or None,
                   pull=env.get("AGENTENV_IMAGE_PULL", "1").strip() not in ("0", "no", "false"),
                   deadline=float(deadline) if deadline else images.PULL_DEADLINE)


def tarball_name(name: str) -> str:
    """The file name (without ``.tar`` / ``.tar.gz``) a tarball of image ``name`` has in the tarball folder."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def mirror_ref(name: str, mirror: str) -> str:
    """``name`` under ``mirror``: its registry host (a first part with a dot or port, or ``localhost``) replaced,
    a Docker Hub official image under ``library/``."""
    first, sep, rest = name.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        name = rest
    elif not sep:
        name = f"library/{name}"
    return f"{mirror.rstrip('/')}/{name}"


_ensuring: dict[str, threading.Lock] = {}
_ensuring_lock = threading.Lock()


def ensure(name: str, sources: ImageSources | None = None, *, say: Say | None = None) -> ImageFetch:
    """The image ``name`` on this host, from the first source that has it (see the module doc). Calls for one name
    in this process wait for each other (the second finds it local)."""
    with _ensuring_lock:
        lock = _ensuring.setdefault(name, threading.Lock())
    with lock:
        return _ensure(name, sources, say)


def _ensure(name: str, sources: ImageSources | None, say: Say | None) -> ImageFetch:
    src = sources if sources is not None else ImageSources.from_env()
    note = say or (lambda _m: None)
    t0 = time.monotonic()

    def done(source: str, detail: str = "") -> ImageFetch:
        image_id = str(images.inspect(name)["Id"])
        if source != "local":
            record_use(image_id, [name], fetched=f"{source} {detail}".strip())
        return ImageFetch(name, image_id, source, detail, round(time.monotonic() - t0, 3))

    if images.present(name):
        return done("local")
    tried: list[str] = []
    if src.tarballs:
        for suffix in (".tar", ".tar.gz"):
            path = Path(src.tarballs) / (tarball_name(name) + suffix)
            if path.is_file():
                note(f"[image] {name}: docker load {path}")
                tags = images.load_file(str(path))
                if images.present(name):
                    return done("tarball", str(path))
                tried.append(f"{path} holds {', '.join(tags) or 'no tagged image'}, not {name}")
                break
        else:
            tried.append(f"no {tarball_name(name)}.tar in {src.tarballs}")
    if src.pull:
        for mirror in src.mirrors:
            ref = mirror_ref(name, mirror)
            note(f"[image] {name}: pulling {ref}")
            why = images.pull(ref, deadline=src.deadline, on_progress=_progress(note, ref))
            if why is None:
                images.tag(ref, name, unless_present=True)  # another process may have done it meanwhile
                images.remove(ref)  # the name asked for holds it now
                return done("mirror", ref)
            tried.append(f"mirror {ref}: {why}")
        note(f"[image] {name}: pulling")
        why = images.pull(name, deadline=src.deadline, on_progress=_progress(note, name))
        if why is None:
            return done("registry")
        tried.append(f"registry: {why}")
    else:
        tried.append("pulls are off (AGENTENV_IMAGE_PULL=0)")
    raise ImageUnavailable(
        f"image {name!r} is not on this host and no source gave it: {'; '.join(tried)}",
        fix=f"put `docker save {name}` at <folder>/{tarball_name(name)}.tar and set AGENTENV_IMAGE_TARBALLS="
            f"<folder> (agentenv serve --image-tarballs), point AGENTENV_IMAGE_MIRRORS at a registry that mirrors "
            f"{name.split('/')[0] if '/' in name else 'library'}/ (--image-mirror), or build it and tag it {name}")


def _progress(note: Say, ref: str) -> Say:
    return lambda line: note(f"[pull] {ref}: {line}")


# --- last use -------------------------------------------------------------------------------------------------


def _use_file(image_id: str) -> Path:
    return paths().image_uses / image_id.removeprefix("sha256:")


def record_use(image_id: str, names: Iterable[str] = (), *, fetched: str | None = None) -> None:
    """Note that ``image_id`` is used now (its file's mtime); its names and how agentenv got it are its content,
    written when they change (a start touches the file: one system call)."""
    if not re.fullmatch(r"(sha256:)?[0-9a-f]{64}", image_id):
        return  # not an image id (a test's fake, say): nothing to record
    f = _use_file(image_id)
    names = sorted(set(names))
    if f.exists() and fetched is None:
        try:
            known = json.loads(f.read_text()).get("names", []) if names else []
        except (OSError, ValueError):
            known = []
        if set(names) <= set(known):
            with contextlib.suppress(FileNotFoundError):
                os.utime(f)
            return
    old = _read_use(f)
    record = {"names": sorted(set(names) | set(old.get("names", []))), "fetched": fetched or old.get("fetched")}
    write_json(f, record, mode=PRIVATE_FILE)


def _read_use(f: Path) -> dict[str, Any]:
    try:
        data = json.loads(f.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


# --- disk and eviction ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredImage:
    """One image in the Docker store, as ``usage`` and ``evict`` see it."""

    id: str
    tags: tuple[str, ...]
    size: int             # bytes of its layers
    shared: int           # of which other images share
    last_used: float | None  # epoch seconds agentenv last started a sandbox from it (None: never through agentenv)
    fetched: str | None   # how agentenv got it ("tarball PATH", "mirror REF", "registry"), None: not agentenv
    held_by: str | None   # what stands on it ("sandbox ID", "snapshot ID", "container ID", "base image"), if any

    @property
    def unique(self) -> int:
        """The bytes removing it frees (its layers no other image shares)."""
        return max(0, self.size - max(0, self.shared))


@dataclass(frozen=True)
class DiskUsage:
    """The images' disk: ``total`` bytes of every layer (shared layers once), and each image."""

    total: int
    images: list[StoredImage] = field(default_factory=list)


def _holders() -> dict[str, str]:
    """Image id -> what stands on it: this home's sandboxes (their records) and snapshots, Docker's containers."""
    held: dict[str, str] = {}
    p = paths()
    for folder, record, kind in ((p.sandboxes, "sandbox.json", "sandbox"), (p.snapshots, "meta.json", "snapshot")):
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(folder):
                with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                    spec = json.loads((Path(entry.path) / record).read_text())["spec"]
                    held.setdefault(str(spec["image_id"]), f"{kind} {entry.name}")
    for c in images.docker_client().api.containers(all=True):
        held.setdefault(str(c.get("ImageID", "")), f"container {str(c.get('Id', ''))[:12]}")
    with contextlib.suppress(AgentEnvError):
        held.setdefault(str(images.inspect(DEFAULT_IMAGE)["Id"]), "base image")
    return held


def usage() -> DiskUsage:
    """Every image's size, last use and holder (see the module doc), least recently used first."""
    df = images.disk_usage()
    held = _holders()
    out = []
    for img in df.get("Images") or []:
        iid = str(img["Id"])
        f = _use_file(iid)
        last = f.stat().st_mtime if f.exists() else None
        out.append(StoredImage(id=iid, tags=tuple(t for t in img.get("RepoTags") or () if t != "<none>:<none>"),
                               size=int(img.get("Size") or 0), shared=int(img.get("SharedSize") or 0),
                               last_used=last, fetched=_read_use(f).get("fetched") if last is not None else None,
                               held_by=held.get(iid)))
    out.sort(key=lambda i: (i.last_used or 0.0, i.id))
    return DiskUsage(total=int(df.get("LayersSize") or 0), images=out)


def evict(budget: int, *, only_fetched: bool = True, dry_run: bool = False, say: Say | None = None
          ) -> list[StoredImage]:
    """Remove images, least recently used first, until the images' layers take at most ``budget`` bytes (see the
    module doc for what is never removed); returns those removed (with ``dry_run``, those that would be)."""
    note = say or (lambda _m: None)
    now = usage()
    total = now.total
    removed: list[StoredImage] = []
    for img in now.images:
        if total <= budget:
            break
        if img.held_by or not img.tags or (only_fetched and not img.fetched):
            continue
        if img.id in _holders():  # a sandbox started on it meanwhile
            continue
        note(f"[evict] {', '.join(img.tags)} ({img.unique / 2**20:.0f} MiB, last used "
             f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(img.last_used)) if img.last_used else 'never'})")
        if not dry_run:
            for t in img.tags:
                images.remove(t)
            with contextlib.suppress(FileNotFoundError):
                _use_file(img.id).unlink()
        total -= img.unique
        removed.append(img)
    return removed
