"""Checkpoint folders, made atomic by rename.

A checkpoint of step N is the folder ``ROOT/step-0000000N`` holding one ``rank-XXXXX.pt`` per training rank (its model
shard, optimizer state, RNG states) and ``meta.json`` (step, data position, layout, configs). It is written as a hidden
``ROOT/.tmp-step-...`` folder, every file fsynced, then renamed into place; ``ROOT/latest`` (rewritten atomically)
names the newest (highest step). A run killed at any moment (``kill -9`` included) leaves either the previous checkpoint or the new
one, never a half one; leftovers of an interrupted write are removed by the next ``begin``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch

from agentenv.config import write_atomic, write_json

LATEST = "latest"
META = "meta.json"


def step_dir(root: str | os.PathLike[str], step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def rank_file(folder: str | os.PathLike[str], rank: int) -> Path:
    return Path(folder) / f"rank-{rank:05d}.pt"


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsync a file or a folder (so that a rename into it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def begin(root: str | os.PathLike[str], step: int) -> Path:
    """A fresh temporary folder for step ``step``'s files (and the removal of any an earlier crash left)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for old in root.glob(".tmp-step-*"):
        shutil.rmtree(old, ignore_errors=True)
    tmp = root / f".tmp-step-{step:08d}-{os.getpid()}"
    tmp.mkdir()
    return tmp


def save_rank(tmp: Path, rank: int, state: dict[str, Any]) -> None:
    """One rank's part, fsynced (called on every rank, into the folder ``begin`` made)."""
    path = rank_file(tmp, rank)
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def commit(root: str | os.PathLike[str], step: int, tmp: Path, meta: dict[str, Any], keep: int = 2) -> Path:
    """Write ``meta.json``, rename the folder into place, point ``latest`` at it, and keep the newest ``keep``."""
    root = Path(root)
    write_json(tmp / META, {**meta, "step": step}, indent=1, fsync=True)
    fsync_path(tmp)
    final = step_dir(root, step)
    if final.exists():   # a step redone after a crash between this rename and the next ``latest``
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_path(root)
    if keep > 0:
        for old in complete(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    newest = latest(root)
    assert newest is not None
    write_atomic(root / LATEST, newest.name, fsync=True)
    fsync_path(root)
    return final


def complete(root: str | os.PathLike[str]) -> list[Path]:
    """The complete checkpoint folders under ``root`` (those with their ``meta.json``), oldest first."""
    root = Path(root)
    return sorted(p for p in root.glob("step-*") if (p / META).is_file()) if root.is_dir() else []


def latest(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint (``latest`` names it too, for people and other tools)."""
    found = complete(root)
    return found[-1] if found else None


def read_meta(folder: str | os.PathLike[str]) -> dict[str, Any]:
    meta: dict[str, Any] = json.loads((Path(folder) / META).read_text())
    return meta


def rng_state() -> dict[str, Any]:
    """Every random state a training rank uses (torch CPU and CUDA, Python's ``random``, numpy's when present)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    with contextlib.suppress(ImportError):
        import numpy as np
        state["numpy"] = np.random.get_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        with contextlib.suppress(ImportError):
            import numpy as np
            np.random.set_state(state["numpy"])
