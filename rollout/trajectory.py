"""Trajectories: one record per episode, in the token-in/token-out form the RL frameworks train on.

A record holds the whole conversation as ``token_ids`` with a ``loss_mask`` (1 = a token the policy
generated, 0 = prompt, template, tool output) and ``logprobs`` aligned to it (the server's log-prob of
each generated token, 0.0 where the mask is 0); the policy ``weight_version`` of every turn; the reward
and the grader's details; why the episode ended; per-turn timings; counts of tool calls and malformed
calls; and, for MoE policies, the experts every position was routed to (routing replay): ``routing[p]`` is
``[moe layer][k]`` global expert ids at position p of ``token_ids`` (prompt, tool output or generated), as the
serving engine computed it when that position was first fed; None where it was not recorded. The last token is
never fed (nothing follows it), nor is a tool output after the last turn, so ``len(routing) <= len(token_ids)``.

An infrastructure failure is never a task failure: an episode that ends in ``env_error`` or
``policy_error`` has ``reward = None`` (not 0), so a trainer leaves it out of group statistics.

On disk: a run folder of msgpack shards (``shard-00000.msgpack`` ...), each written to a hidden
temporary file and renamed into place when complete, plus ``index.json`` (rewritten atomically) that
lists them. A crash (``kill -9`` included) loses at most the records of the shard being written and
never leaves a half shard listed. ``read`` streams the records back; ``to_jsonl`` exports them for people.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgpack

from agentenv.config import replacing, write_json

SCHEMA = 1
FinishReason = Literal["submitted", "max_turns", "max_tokens", "context_limit", "env_error", "policy_error",
                       "harness_error", "timeout"]
FINISH_REASONS: tuple[str, ...] = ("submitted", "max_turns", "max_tokens", "context_limit", "env_error",
                                   "policy_error", "harness_error", "timeout")
# not the policy's doing: no reward (None, never 0). ``harness_error``: a harness driving the episode crashed
# (rollout.harnesses); ``timeout``: it did not finish within the run's deadline
INFRA_ERRORS = frozenset({"env_error", "policy_error", "harness_error", "timeout"})
SHARD_GLOB = "shard-*.msgpack"


class TrajectoryError(ValueError):
    """A record that breaks the format's invariants, or a run folder that cannot be read."""


@dataclass
class Turn:
    """One policy call and the environment step that followed it."""

    start: int                      # index in token_ids where this turn's prompt part begins
    generated: int                  # tokens the policy generated in this turn
    weight_version: int             # the policy weights that generated them
    tool_calls: int = 0
    malformed: bool = False
    policy_s: float = 0.0           # seconds waiting for the policy
    env_s: float = 0.0              # seconds in env.step
    finish: str = ""                # the server's finish reason for this generation ("stop", "length", ...)


@dataclass
class Trajectory:
    """One episode (see the module docstring for the invariants ``check`` enforces)."""

    task_id: str
    env_id: str
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    reward: float | None = None
    finish_reason: str = "submitted"
    grade: dict[str, Any] = field(default_factory=dict)
    group_id: str = ""
    group_index: int = 0
    seed: int | None = None
    prompt_len: int = 0             # tokens of the first prompt (system, tools, task); shared by a group
    routing: list[Any] | None = None  # per position: [moe layer][k] expert ids, when the server gives them
    fork_s: float = 0.0             # seconds this episode's env took to fork from its group's state
    tool_calls: int = 0
    malformed_calls: int = 0
    error: str = ""                 # what failed, for env_error / policy_error
    metadata: dict[str, Any] = field(default_factory=dict)
    episode_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    created_at: float = field(default_factory=time.time)
    schema: int = SCHEMA

    # --- the record's own figures -------------------------------------------------------------

    @property
    def generated_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def weight_versions(self) -> list[int]:
        return [t.weight_version for t in self.turns]

    @property
    def infra_error(self) -> bool:
        return self.finish_reason in INFRA_ERRORS

    def append(self, ids: list[int], *, generated: bool, logprobs: list[float] | None = None) -> None:
        """Extend the conversation: ``generated`` ids carry the server's ``logprobs``; others get 0.0."""
        if generated and (logprobs is None or len(logprobs) != len(ids)):
            raise TrajectoryError(f"{len(ids)} generated ids need as many logprobs, got "
                                  f"{None if logprobs is None else len(logprobs)}")
        self.token_ids.extend(ids)
        self.loss_mask.extend([1 if generated else 0] * len(ids))
        self.logprobs.extend(logprobs if generated and logprobs is not None else [0.0] * len(ids))

    def check(self) -> Trajectory:
        """Raise TrajectoryError unless the record keeps the format's invariants; returns itself."""
        n = len(self.token_ids)
        if len(self.loss_mask) != n or len(self.logprobs) != n:
            raise TrajectoryError(f"token_ids ({n}), loss_mask ({len(self.loss_mask)}) and logprobs "
                                  f"({len(self.logprobs)}) must have one entry per token")
        if any(m not in (0, 1) for m in self.loss_mask):
            raise TrajectoryError("loss_mask holds only 0 and 1")
        if any(lp != 0.0 for lp, m in zip(self.logprobs, self.loss_mask, strict=True) if m == 0):
            raise TrajectoryError("logprobs are 0.0 where the mask is 0")
        if self.finish_reason not in FINISH_REASONS:
            raise TrajectoryError(f"finish_reason {self.finish_reason!r} is not one of {', '.join(FINISH_REASONS)}")
        if self.infra_error and self.reward is not None:
            raise TrajectoryError(f"an episode that ended in {self.finish_reason} carries no reward (None, not 0)")
        if sum(t.generated for t in self.turns) != self.generated_tokens:
            raise TrajectoryError(f"the turns generated {sum(t.generated for t in self.turns)} tokens but the "
                                  f"mask marks {self.generated_tokens}")
        if self.routing is not None and len(self.routing) > n:
            raise TrajectoryError(f"routing has {len(self.routing)} entries for {n} tokens (one per position at most)")
        return self

    def record_routing(self, positions: list[Any] | None) -> None:
        """Extend ``routing`` from a policy answer's routing of positions ``0..len(positions) - 1`` (its prompt
        positions, then the positions that produced its output tokens): positions recorded already keep the routing
        they were first fed with (the state every later turn attends to)."""
        if positions is None:
            return
        have = self.routing or []
        self.routing = have + list(positions[len(have):])

    def routing_coverage(self) -> float:
        """Fraction of the positions that shape a generated token (those before the last one; later positions,
        such as a last tool output the policy never read, shape nothing) with a recorded routing."""
        n = max((i for i, m in enumerate(self.loss_mask) if m), default=0)
        return sum(1 for r in (self.routing or [])[:n] if r is not None) / n if n else 1.0

    # --- the wire -----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trajectory:
        if d.get("schema") != SCHEMA:
            raise TrajectoryError(f"trajectory schema {d.get('schema')!r}; this reader knows {SCHEMA}")
        names = {f.name for f in dataclasses.fields(cls)}
        turn_names = {f.name for f in dataclasses.fields(Turn)}
        kw = {k: v for k, v in d.items() if k in names}
        kw["turns"] = [Turn(**{k: v for k, v in t.items() if k in turn_names}) for t in d.get("turns", [])]
        return cls(**kw)


# --- shards ----------------------------------------------------------------------------------------

class ShardWriter:
    """Writes trajectories into a run folder, ``records_per_shard`` to a shard, each shard published
    atomically; ``flush()`` publishes what is pending now (the driver calls it as episodes finish)."""

    def __init__(self, folder: str | os.PathLike[str], records_per_shard: int = 64) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.records_per_shard = records_per_shard
        self._pending: list[bytes] = []
        self._index = _load_index(self.folder)
        self._next = 1 + max((int(s["name"][6:11]) for s in self._index["shards"]), default=-1)

    def write(self, traj: Trajectory) -> None:
        self._pending.append(msgpack.packb(traj.check().to_dict(), use_bin_type=True))
        if len(self._pending) >= self.records_per_shard:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        name = f"shard-{self._next:05d}.msgpack"
        with replacing(self.folder / name, fsync=True) as f:
            for rec in self._pending:
                f.write(rec)
        self._index["shards"].append({"name": name, "records": len(self._pending)})
        write_json(self.folder / "index.json", self._index, indent=1)
        self._next += 1
        self._pending = []

    def close(self) -> None:
        self.flush()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _load_index(folder: Path) -> dict[str, Any]:
    """The run's index; shards published after the index was last written (a crash between the two
    renames) are picked up from the folder."""
    try:
        index: dict[str, Any] = json.loads((folder / "index.json").read_text())
    except FileNotFoundError:
        index = {"schema": SCHEMA, "shards": []}
    except json.JSONDecodeError as e:
        raise TrajectoryError(f"{folder / 'index.json'} is not valid JSON ({e})") from None
    listed = {s["name"] for s in index["shards"]}
    for p in sorted(folder.glob(SHARD_GLOB)):
        if p.name not in listed:
            index["shards"].append({"name": p.name, "records": sum(1 for _ in _records(p))})
    return index


def _records(path: Path) -> Iterator[dict[str, Any]]:
    with open(path, "rb") as f:
        unpacker = msgpack.Unpacker(f, raw=False, strict_map_key=True, max_buffer_size=1 << 30)
        yield from unpacker


def shard_paths(path: str | os.PathLike[str]) -> list[Path]:
    """The shards of a run folder in order (or a single shard file)."""
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise TrajectoryError(f"no run folder or shard at {p}")
    return [p / s["name"] for s in _load_index(p)["shards"]]


def read(path: str | os.PathLike[str]) -> Iterator[Trajectory]:
    """Stream the trajectories of a run folder (or one shard), oldest shard first."""
    for shard in shard_paths(path):
        for rec in _records(shard):
            yield Trajectory.from_dict(rec)


def write(path: str | os.PathLike[str], trajectories: Iterable[Trajectory], records_per_shard: int = 64) -> int:
    """Write trajectories into a run folder; returns how many."""
    n = 0
    with ShardWriter(path, records_per_shard) as w:
        for t in trajectories:
            w.write(t)
            n += 1
    return n


def to_jsonl(path: str | os.PathLike[str], out: str | os.PathLike[str]) -> int:
    """Export a run as JSON lines (one trajectory a line) for people and other tools; returns how many."""
    n = 0
    with replacing(out, text=True) as f:
        for t in read(path):
            f.write(json.dumps(t.to_dict(), ensure_ascii=False) + "\n")
            n += 1
    return n


def cleanup_temporaries(folder: str | os.PathLike[str]) -> list[str]:
    """Remove temporary files a crashed writer left in a run folder; returns their names."""
    removed = []
    for p in Path(folder).glob(".*.tmp"):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
            removed.append(p.name)
    return removed
