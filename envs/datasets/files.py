"""Records from where datasets are published: a JSONL file (one record a line), a JSON file (a list, one record, or
``{"tasks": [...]}``), a Parquet file or folder of them (the Hugging Face hub's layout; read with pyarrow), or a
Hugging Face ``datasets.Dataset`` (local data: the library is only used when the caller already holds such an
object). Each record comes back as plain JSON values (Parquet's timestamps as ISO strings, its lists and structs as
lists and dicts) with where it was read (``file:line``, ``file[index]``), for errors that say where.
"""

from __future__ import annotations

import datetime
import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

PARQUET = (".parquet", ".pq")


class SourceError(ValueError):
    """Records could not be read from a source; ``where`` names the file, line or row."""

    def __init__(self, message: str, where: str | None = None) -> None:
        self.where = where
        super().__init__(f"{where}: {message}" if where else message)


def read_records(source: Any) -> list[tuple[str, Any]]:
    """``[(where, record), ...]`` from a path (JSONL / JSON / Parquet) or a ``datasets.Dataset``."""
    if isinstance(source, str | os.PathLike):
        return _read_path(Path(source))
    if _is_hf_dict(source):
        raise SourceError(f"a DatasetDict of splits {sorted(source)}: pass one split, e.g. dataset['test']")
    if _is_hf_dataset(source):
        name = str(getattr(getattr(source, "info", None), "dataset_name", None) or "dataset")
        return [(f"{name}[{i}]", plain(row, f"{name}[{i}]")) for i, row in enumerate(source)]
    raise SourceError(f"records come from a JSONL, JSON or Parquet file or a datasets.Dataset, got "
                      f"{type(source).__name__}")


def _is_hf_dataset(obj: Any) -> bool:
    return type(obj).__module__.startswith("datasets.") and type(obj).__name__ in ("Dataset", "IterableDataset")


def _is_hf_dict(obj: Any) -> bool:
    return type(obj).__module__.startswith("datasets.") and type(obj).__name__ in ("DatasetDict",
                                                                                  "IterableDatasetDict")


def _read_path(p: Path) -> list[tuple[str, Any]]:
    if not p.exists():
        raise SourceError("no such file or folder", str(p))
    if p.is_dir() or p.suffix in PARQUET:
        return _read_parquet(p)
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise SourceError(f"cannot read the task file: {e}", str(p)) from None
    if p.suffix == ".json" or text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except ValueError as e:
            raise SourceError(f"not valid JSON: {e}", str(p)) from None
        if isinstance(data, Mapping) and "tasks" in data:
            data = data["tasks"]
        if isinstance(data, Mapping):
            data = [data]
        if not isinstance(data, list):
            raise SourceError("a JSON task file holds a list of task records", str(p))
        return [(f"{p}[{i}]", r) for i, r in enumerate(data)]
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                out.append((f"{p}:{n}", json.loads(line)))
            except ValueError as e:
                raise SourceError(f"not valid JSON: {e}", f"{p}:{n}") from None
    return out


def _read_parquet(p: Path) -> list[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise SourceError("reading Parquet needs pyarrow: pip install -e '.[envs]' in the checkout", str(p)) from None
    files = sorted(p.rglob("*.parquet")) if p.is_dir() else [p]
    if not files:
        raise SourceError("no .parquet file in this folder", str(p))
    out = []
    for f in files:
        try:
            rows = pq.read_table(f).to_pylist()
        except (OSError, ValueError) as e:  # pyarrow.ArrowInvalid is a ValueError
            raise SourceError(f"not a readable Parquet file: {e}", str(f)) from None
        out += [(f"{f}[{i}]", plain(row, f"{f}[{i}]")) for i, row in enumerate(rows)]
    return out


def plain(value: Any, where: str, path: str = "") -> Any:
    """``value`` as JSON values: datetimes as ISO strings, tuples and arrays as lists, numpy scalars as numbers.
    A value of any other type (bytes, a NaN, ...) is a SourceError naming the field: nothing is guessed."""
    if value is None or isinstance(value, str | bool | int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise SourceError(f"field {path or '?'!r}: {value} is not a JSON number", where)
        return value
    if isinstance(value, Mapping):
        return {str(k): plain(v, where, f"{path}.{k}" if path else str(k)) for k, v in value.items()}
    if isinstance(value, datetime.datetime | datetime.date):
        return value.isoformat()
    if hasattr(value, "isoformat") and callable(value.isoformat):  # pandas.Timestamp
        return str(value.isoformat())
    if hasattr(value, "tolist") and callable(value.tolist):  # numpy arrays and scalars
        return plain(value.tolist(), where, path)
    if isinstance(value, list | tuple) or (isinstance(value, Iterable) and not isinstance(value, bytes | bytearray)):
        return [plain(v, where, f"{path}[{i}]") for i, v in enumerate(value)]
    raise SourceError(f"field {path or '?'!r}: a {type(value).__name__} is not a JSON value", where)
