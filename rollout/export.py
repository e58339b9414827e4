"""Trajectories out: a rollout or train run's shards as JSONL or parquet rows that other RL stacks read.

``agentenv rollout export RUN --format jsonl|parquet --schema neutral|verl|trl|slime --out PATH`` writes one row
per trajectory. Every schema splits a record the same way: the *prompt* is the first prompt (``prompt_len``
tokens: system, tools, task; shared by a GRPO group), the *response* is everything after it, a multi-turn
response holding the tool outputs and chat-template tokens between the policy's turns. The loss mask over the
response is taken from the trajectory's turns (``Turn.start`` .. ``start + generated`` are the tokens the policy
generated: 1; everything else: 0) and checked against the recorded ``loss_mask``; it is never recomputed from
text. Logprobs are the serving engine's, aligned to the response (0.0 where the mask is 0).

The schemas only name and shape those columns for the reader (see docs/rollouts.md for the lines each reader
needs):

- ``neutral``: ``prompt_ids``, ``response_ids``, ``loss_mask``, ``logprobs``, ``reward`` and the metadata.
- ``verl``: ``prompts``, ``responses``, ``response_mask``, ``input_ids``, ``attention_mask``,
  ``rollout_log_probs``, ``token_level_scores`` / ``token_level_rewards`` (the reward on the last generated
  token, as verl's reward managers place it), ``uid`` (the GRPO group, verl's grouping key), ``data_source``.
- ``trl``: ``input_ids`` with ``completion_mask`` and ``assistant_masks`` over the whole sequence (0 on the
  prompt and the tool outputs), so ``SFTTrainer`` builds its labels from them; ``prompt`` / ``completion``
  text with ``--text``.
- ``slime``: the fields of ``slime.utils.types.Sample``: ``tokens``, ``response_length``, ``loss_mask`` and
  ``rollout_log_probs`` over the response, ``reward``, ``status``, ``group_index``, ``index``,
  ``weight_versions``, ``metadata``.

An episode that ended in an infrastructure error has no reward (None, not 0): it is left out unless
``keep_errors`` is set, and then its reward columns are null. Dict columns (``grade``, ``metadata``) are JSON
text in parquet (a parquet struct needs one shape for every row) and objects in JSONL.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from agentenv.config import replacing
from rollout import trajectory as tj
from rollout.trajectory import Trajectory

FORMATS: tuple[str, ...] = ("jsonl", "parquet")
SCHEMAS: tuple[str, ...] = ("neutral", "verl", "trl", "slime")
DICT_COLUMNS = frozenset({"grade", "metadata"})
# slime's Sample.Status values for our finish reasons
SLIME_STATUS = {"submitted": "completed", "max_turns": "truncated", "max_tokens": "truncated",
                "context_limit": "truncated", "env_error": "aborted", "policy_error": "aborted",
                "harness_error": "aborted", "timeout": "aborted"}


class ExportError(ValueError):
    """A run that cannot be exported: no trajectories, or a record whose turns and mask disagree."""


@dataclass
class Split:
    """One trajectory cut into prompt and response, with the response's mask and logprobs."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]

    @property
    def last_generated(self) -> int:
        """Index in the response of the last generated token (-1 when none was generated)."""
        return max((i for i, m in enumerate(self.loss_mask) if m), default=-1)


def split(t: Trajectory) -> Split:
    """Cut ``t`` after its first prompt; the mask comes from the turns and must match the recorded one."""
    t.check()
    n = len(t.token_ids)
    mask = [0] * n
    for turn in t.turns:
        if turn.start < 0 or turn.start + turn.generated > n:
            raise ExportError(f"episode {t.episode_id}: turn at {turn.start} (+{turn.generated}) lies outside its "
                              f"{n} tokens")
        mask[turn.start:turn.start + turn.generated] = [1] * turn.generated
    if mask != t.loss_mask:
        raise ExportError(f"episode {t.episode_id}: the turns' generated spans do not match its loss_mask")
    cut = t.prompt_len or (t.turns[0].start if t.turns else n)
    if any(mask[:cut]):
        raise ExportError(f"episode {t.episode_id}: generated tokens inside its prompt ({cut} tokens)")
    return Split(list(t.token_ids[:cut]), list(t.token_ids[cut:]), mask[cut:], [float(x) for x in t.logprobs[cut:]])


def _meta(t: Trajectory) -> dict[str, Any]:
    return {"episode_id": t.episode_id, "task_id": t.task_id, "env_id": t.env_id, "group_id": t.group_id,
            "group_index": t.group_index, "seed": t.seed, "finish_reason": t.finish_reason,
            "weight_versions": t.weight_versions, "turns": len(t.turns), "tool_calls": t.tool_calls,
            "malformed_calls": t.malformed_calls, "grade": t.grade, "metadata": t.metadata}


def neutral(t: Trajectory, s: Split, i: int, decode: Callable[[list[int]], str] | None) -> dict[str, Any]:
    row: dict[str, Any] = {"prompt_ids": s.prompt_ids, "response_ids": s.response_ids, "loss_mask": s.loss_mask,
                           "logprobs": s.logprobs, "reward": t.reward, **_meta(t)}
    if decode is not None:
        row["prompt_text"], row["response_text"] = decode(s.prompt_ids), decode(s.response_ids)
    return row


def _token_rewards(t: Trajectory, s: Split) -> list[float] | None:
    if t.reward is None:
        return None
    out = [0.0] * len(s.response_ids)
    if s.last_generated >= 0:
        out[s.last_generated] = float(t.reward)
    return out


def verl(t: Trajectory, s: Split, i: int, decode: Callable[[list[int]], str] | None) -> dict[str, Any]:
    rewards = _token_rewards(t, s)
    meta = _meta(t)
    row: dict[str, Any] = {"prompts": s.prompt_ids, "responses": s.response_ids, "response_mask": s.loss_mask,
                           "input_ids": s.prompt_ids + s.response_ids,
                           "attention_mask": [1] * (len(s.prompt_ids) + len(s.response_ids)),
                           "rollout_log_probs": s.logprobs, "token_level_scores": rewards,
                           "token_level_rewards": rewards, "reward": t.reward, "uid": t.group_id or t.episode_id,
                           "data_source": t.env_id, **{k: v for k, v in meta.items() if k != "env_id"}}
    if decode is not None:
        row["prompt"], row["response"] = decode(s.prompt_ids), decode(s.response_ids)
    return row


def trl(t: Trajectory, s: Split, i: int, decode: Callable[[list[int]], str] | None) -> dict[str, Any]:
    full_mask = [0] * len(s.prompt_ids) + s.loss_mask
    row: dict[str, Any] = {"input_ids": s.prompt_ids + s.response_ids, "completion_mask": full_mask,
                           "assistant_masks": full_mask, "logprobs": [0.0] * len(s.prompt_ids) + s.logprobs,
                           "reward": t.reward, **_meta(t)}
    if decode is not None:
        row["prompt"], row["completion"] = decode(s.prompt_ids), decode(s.response_ids)
    return row


def slime(t: Trajectory, s: Split, i: int, decode: Callable[[list[int]], str] | None) -> dict[str, Any]:
    meta = _meta(t)
    row: dict[str, Any] = {"tokens": s.prompt_ids + s.response_ids, "response_length": len(s.response_ids),
                           "loss_mask": s.loss_mask, "rollout_log_probs": s.logprobs, "reward": t.reward,
                           "status": SLIME_STATUS[t.finish_reason], "index": i,
                           "weight_versions": [str(v) for v in t.weight_versions], "label": None,
                           "metadata": {**t.metadata, **{k: v for k, v in meta.items()
                                                         if k not in ("metadata", "weight_versions")}}}
    if decode is not None:
        row["prompt"], row["response"] = decode(s.prompt_ids), decode(s.response_ids)
    return row


ROWS: dict[str, Callable[[Trajectory, Split, int, Callable[[list[int]], str] | None], dict[str, Any]]] = {
    "neutral": neutral, "verl": verl, "trl": trl, "slime": slime}


def run_folder(path: str | os.PathLike[str]) -> Path:
    """The shards' folder of ``path``: a rollout run folder or one shard as given, a train run's
    ``trajectories/`` folder when ``path`` is the train run."""
    p = Path(path)
    if p.is_dir() and not any(p.glob(tj.SHARD_GLOB)) and not (p / "index.json").exists() \
            and (p / "trajectories").is_dir():
        return p / "trajectories"
    return p


def rows(path: str | os.PathLike[str], schema: str = "neutral", *, decode: Callable[[list[int]], str] | None = None,
         keep_errors: bool = False, skipped: list[str] | None = None) -> Iterator[dict[str, Any]]:
    """The rows of a run in ``schema``; infrastructure-error episodes are left out (their ids appended to
    ``skipped``) unless ``keep_errors``."""
    if schema not in ROWS:
        raise ExportError(f"schema {schema!r} is not one of {', '.join(SCHEMAS)}")
    make = ROWS[schema]
    groups: dict[str, int] = {}
    i = 0
    for t in tj.read(run_folder(path)):
        if t.infra_error and not keep_errors:
            if skipped is not None:
                skipped.append(t.episode_id)
            continue
        row = make(t, split(t), i, decode)
        if schema == "slime":  # slime's group_index is the group's number in the batch
            row["group_index"] = groups.setdefault(t.group_id or t.episode_id, len(groups))
        i += 1
        yield row


def _jsonable(row: dict[str, Any]) -> dict[str, Any]:
    return {k: (json.dumps(v, ensure_ascii=False) if k in DICT_COLUMNS and v is not None else v)
            for k, v in row.items()}


def write_jsonl(records: Iterable[dict[str, Any]], out: Path) -> int:
    """JSON lines, one record a line; ``out`` is written (whole, by rename) only where there is a record."""
    first, records = _peek(records)
    if first is None:
        return 0
    n = 0
    with replacing(out, text=True) as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
            n += 1
    return n


def _peek(records: Iterable[dict[str, Any]]) -> tuple[dict[str, Any] | None, Iterator[dict[str, Any]]]:
    """The first record (None where there is none) and all of them, that one included."""
    it = iter(records)
    first = next(it, None)
    return first, (it if first is None else itertools.chain([first], it))


def write_parquet(records: Iterable[dict[str, Any]], out: Path, rows_per_group: int = 1024) -> int:
    """Parquet in row groups of ``rows_per_group``. The first group fixes the schema; a column that is null in
    all of it (the rewards of infrastructure errors) takes its type from ``nullable``, so later groups fit.
    ``out`` is written (whole, by rename) only where there is a record."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    first, records = _peek(records)
    if first is None:
        return 0

    nullable = {"reward": pa.float64(), "seed": pa.int64(), "token_level_scores": pa.list_(pa.float64()),
                "token_level_rewards": pa.list_(pa.float64())}
    n = 0
    writer: Any = None
    batch: list[dict[str, Any]] = []

    def flush(sink: BinaryIO) -> None:
        nonlocal writer
        table = pa.Table.from_pylist([_jsonable(r) for r in batch])
        if writer is None:
            fields = [pa.field(f.name, nullable.get(f.name, pa.string())) if pa.types.is_null(f.type) else f
                      for f in table.schema]
            writer = pq.ParquetWriter(sink, pa.schema(fields))
        writer.write_table(table.cast(writer.schema))
        batch.clear()

    with replacing(out) as f:
        try:
            for r in records:
                batch.append(r)
                n += 1
                if len(batch) >= rows_per_group:
                    flush(f)
            if batch:
                flush(f)
        finally:
            if writer is not None:
                writer.close()
    return n


def export(path: str | os.PathLike[str], out: str | os.PathLike[str], fmt: str = "jsonl", schema: str = "neutral",
           *, decode: Callable[[list[int]], str] | None = None, keep_errors: bool = False) -> dict[str, Any]:
    """Write the run at ``path`` to ``out``; returns what was written (rows, skipped infrastructure errors)."""
    if fmt not in FORMATS:
        raise ExportError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    skipped: list[str] = []
    target = Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    records = rows(path, schema, decode=decode, keep_errors=keep_errors, skipped=skipped)
    n = write_jsonl(records, target) if fmt == "jsonl" else write_parquet(records, target)
    if n == 0:
        why = f" ({len(skipped)} infrastructure-error episodes left out; --keep-errors writes them)" if skipped else ""
        raise ExportError(f"{path} holds no trajectory to export{why}")
    return {"rows": n, "skipped_infra_errors": len(skipped), "out": str(target), "format": fmt, "schema": schema}
