"""The runs the trajectory viewer shows (``trainer.viewer.data`` reads what is in them; ``trainer.viewer.web`` serves
them): found by listing the viewer's root, loaded from each run's own files.

A run is a folder under the viewer's root (the root itself, or one of its sub-folders): a rollout run's shards
folder, or a train run (``metrics.jsonl``, ``config.toml``, ``trajectories/``). Runs are found by listing the
root, never by joining a path the browser sent: a name that is not listed (``..``, an absolute path, a symlink
out of the root) is refused with ``RunNotFound`` / ``BadViewerRequest``.

A run folder may come from someone else, so every file of it is read as the run's own (``own``): a regular file
reached without a symlink at its end (opened with O_NOFOLLOW, then read through that very descriptor, so nothing
can swap it in between), in a folder of the run. summary.json, run.json or the index linked elsewhere are read as
absent; a shard, metrics.jsonl or config.toml linked elsewhere, or a shard the index names outside the run, makes
the run ``RunNotFound`` (the viewer never shows a file of the host for a run's).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentenv.errors import AgentEnvError
from rollout import trajectory as tj
from rollout.export import run_folder

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+-]{0,199}")
SEARCHES = "searches"  # a run's saved search trees (rollout.search.SearchResult.save), beside its shards


class BadViewerRequest(AgentEnvError, ValueError):
    """A filter, an id or a run name the viewer does not take (HTTP 400)."""


class RunNotFound(AgentEnvError, LookupError):
    """No run, episode, group or search of that name under the viewer's folder (HTTP 404)."""


def checked_name(name: str, what: str) -> str:
    """``name`` if it is a plain id (letters, digits, ``._:+-``, not starting with a dot): never a path."""
    if not NAME.fullmatch(name):
        raise BadViewerRequest(f"{what} {name[:80]!r} is not a plain name",
                               fix="use the names the viewer lists (no '/', no '..', no leading dot)")
    return name


# --- runs -------------------------------------------------------------------------------------------------------


def _is_run(p: Path) -> bool:
    shards = run_folder(p)
    return (shards / "index.json").is_file() or any(shards.glob(tj.SHARD_GLOB)) or (p / "metrics.jsonl").is_file()


def _inside(root: Path, p: Path) -> bool:
    """``p`` is a real folder (no symlink on the way) inside ``root``."""
    return not p.is_symlink() and p.is_dir() and p.resolve().is_relative_to(root.resolve())


def list_runs(root: Path) -> dict[str, Path]:
    """The runs under ``root`` by name: the root itself (named by its folder) when it is a run, else its
    sub-folders that are runs (symlinks left out, and runs whose trajectories are a symlink)."""
    if not root.is_dir():
        raise RunNotFound(f"no runs folder at {root}", fix="give the folder of a run, or a folder of runs")
    if _is_run(root):
        name = root.resolve().name
        return {name if NAME.fullmatch(name) else "run": root}
    found: dict[str, Path] = {}
    for p in sorted(root.iterdir()):
        if NAME.fullmatch(p.name) and _inside(root, p) and _is_run(p) and _inside(root, run_folder(p)):
            found[p.name] = p
    return found


@dataclass
class Run:
    """One run's data, read once per change of its index (``load`` caches it)."""

    name: str
    path: Path
    episodes: list[tj.Trajectory] = field(default_factory=list)
    by_id: dict[str, tj.Trajectory] = field(default_factory=dict)

    @property
    def shards(self) -> Path:
        return run_folder(self.path)

    @property
    def kind(self) -> str:
        return _kind(self.path)

    def summary(self) -> dict[str, Any]:
        """``brief``'s line with the figures counted from the episodes themselves."""
        rewards = [t.reward for t in self.episodes if t.reward is not None]
        return {**brief(self.name, self.path), "episodes": len(self.episodes),
                "groups": len({t.group_id for t in self.episodes}),
                "reward_mean": sum(rewards) / len(rewards) if rewards else None}


def _kind(path: Path) -> str:
    return "train" if (path / "metrics.jsonl").is_file() or (path / "config.toml").is_file() else "rollout"


def _open_own(path: Path) -> int:
    """A descriptor of ``path`` if it is a regular file with no symlink at its end (O_NOFOLLOW; O_NONBLOCK: a FIFO
    does not hang the viewer); OSError otherwise (ELOOP for a symlink)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file")
    return fd


@contextlib.contextmanager
def own(path: Path, run: str | None = None) -> Iterator[Path]:
    """A name that reads ``path`` (``_open_own``) through its very descriptor (/proc/self/fd), so that nothing swaps
    the file meanwhile. OSError if it is not the run's own; with ``run`` given, that run's ``RunNotFound``."""
    try:
        fd = _open_own(path)
    except OSError as e:
        if run is None:
            raise
        why = "a symlink, which could lead outside the run" if e.errno == errno.ELOOP else e.strerror
        raise RunNotFound(f"run {run!r}: {path.name} is {why}: the viewer reads a run's own files only",
                          fix="replace the link with the file itself, or view the folder it leads to") from None
    try:
        yield Path(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)


def _json_dict(path: Path) -> dict[str, Any]:
    """A JSON object of the run (``own``); {} for anything else (missing, malformed, linked out of the run)."""
    try:
        with own(path) as file:
            found = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def brief(name: str, path: Path) -> dict[str, Any]:
    """A run's line on the runs page, read from its index, run.json and summary.json: no shard is read."""
    shards = run_folder(path)
    listed = _json_dict(shards / "index.json").get("shards")
    summary = _json_dict(path / "summary.json")
    rollout = summary["rollout"] if isinstance(summary.get("rollout"), dict) else summary  # a train run's
    searches = shards / SEARCHES
    return {"name": name, "kind": _kind(path),
            "episodes": sum(int(s.get("records", 0)) for s in listed if isinstance(s, dict))
            if isinstance(listed, list) else 0,
            "groups": rollout.get("groups"), "reward_mean": rollout.get("reward_mean"),
            "metrics": (path / "metrics.jsonl").is_file(),
            "searches": len(list(searches.glob("*.json"))) if searches.is_dir() else 0,
            "started_at": _json_dict(shards / "run.json").get("started_at")}


_CACHE: dict[Path, tuple[tuple[int, int], Run]] = {}
_LOCK = threading.Lock()


def load(root: Path, name: str) -> Run:
    """The run ``name`` under ``root``, its episodes read (again only when its index changed)."""
    path = list_runs(root).get(checked_name(name, "run"))
    if path is None:
        raise RunNotFound(f"no run {name!r} under the viewer's folder", fix="pick one from the runs page")
    shards = run_folder(path)
    if shards.is_symlink() or not shards.resolve().is_relative_to(root.resolve()):
        raise RunNotFound(f"run {name!r} keeps its trajectories outside the viewer's folder",
                          fix="view that folder itself (agentenv view FOLDER)")
    index = shards / "index.json"
    if index.is_symlink():
        raise RunNotFound(f"run {name!r}: index.json is a symlink, which could lead outside the run: the viewer "
                          "reads a run's own files only", fix="replace the link with the file itself")
    # the index changes with every shard published; without one (a writer killed before writing it), the shards
    stamp = (index.stat().st_mtime_ns, index.stat().st_size) if index.is_file() else \
        (len(found := list(shards.glob(tj.SHARD_GLOB))), sum(p.stat().st_size for p in found))
    key = path.resolve()
    with _LOCK:
        cached = _CACHE.get(key)
        if cached is not None and cached[0] == stamp:
            return cached[1]
    episodes = _episodes(name, shards) if shards.is_dir() else []
    run = Run(name, path, episodes, {t.episode_id: t for t in episodes})
    with _LOCK:
        if len(_CACHE) >= 8:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = (stamp, run)
    return run


def _episodes(name: str, shards: Path) -> list[tj.Trajectory]:
    """The run's trajectories, from the shards its index lists (and those it missed) in its own folder only."""
    for shard in shards.glob(tj.SHARD_GLOB):  # before the index is read, which counts the records of unlisted ones
        with own(shard, name):
            pass
    found: list[tj.Trajectory] = []
    for shard in tj.shard_paths(shards):
        if shard.parent != shards:
            raise RunNotFound(f"run {name!r}: its index names a shard outside the run ({str(shard)[-120:]!r})",
                              fix="an index names the shards beside it by their file names only")
        with own(shard, name) as file:
            found.extend(tj.read(file))
    return found
