"""The one harness every benchmark uses: timing, one percentile formula, machine info, one JSON layout, one table.

Timing: ``Timer`` (a context manager) and ``time_runs(fn, runs, warmup)``, both on ``time.perf_counter``.
Samples are kept in seconds; every figure written or printed is in milliseconds, and its key says so.

Statistics: ``percentile(xs, q)`` is the only formula, for the median, the p90 and the p99 alike: linear
interpolation between the closest ranks (numpy's default ``"linear"`` method, ``statistics.quantiles(...,
method="inclusive")``, Excel's PERCENTILE.INC). With the sorted samples ``x[0..n-1]`` and ``h = (n - 1) q``:
``x[floor h] + (h - floor h) * (x[floor h + 1] - x[floor h])``. Its median is the usual median, n = 1 gives
the sample itself, and anyone can recompute a figure from ``samples_ms`` with ``numpy.percentile``.

Results: a ``Report`` holds ``Result`` objects (samples, an error text, a note, sub-phase samples, further
fields) keyed by operation, ratios between them, free-form ``info`` and notes; ``Report.write()`` writes one
JSON document atomically (``agentenv.config.write_atomic``: a temporary file renamed) to ``bench/results/<benchmark>.json``::

    {"schema": 1, "benchmark": "sandbox", "started_at": "2025-01-01T12:00:00Z", "duration_s": 81.2,
     "commit": "<git HEAD or 'unknown'>", "dirty": false, "machine": {...}, "args": {...},
     "results": {"<op>": {"n", "median_ms", "p90_ms", "p99_ms", "min_ms", "max_ms", "mean_ms", "samples_ms",
                          "note"?, "error"?, "extra"?: {"<phase>": {stat fields}}, ...further fields}},
     "ratios": {"<name>": {"value", "text": "2.4×", "numerator": "<op>", "denominator": "<op>"}},
     "errors": {"<op>": "<error text>"}, "fatal": null, "info": {...}, "notes": [...]}

An operation that fails keeps its error text and only the samples it really took; no figure is invented.
What a report says of where it ran (the machine, its speed and CPU steal, the commit) is ``bench.machine``'s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from agentenv.config import write_atomic
from bench.machine import cpu_probe, cpu_ticks, git_commit, machine_info

SCHEMA = 1
ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "bench" / "results"
MAX_SAMPLES_IN_JSON = 1000  # longer sample lists (load runs) keep only their statistics

console = Console(width=max(170, shutil.get_terminal_size((170, 40)).columns))


# --- timing ------------------------------------------------------------------------------------------------


class Timer:
    """``with Timer() as t: ...`` then ``t.s`` is the elapsed wall time in seconds (perf_counter)."""

    def __enter__(self) -> Timer:
        self.s = 0.0
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.s = time.perf_counter() - self.t0


def time_runs(fn: Callable[[], object], runs: int, warmup: int = 0,
              sync: Callable[[], object] | None = None) -> list[float]:
    """Seconds of ``runs`` calls of ``fn`` after ``warmup`` untimed ones; ``sync`` (e.g. a CUDA synchronise)
    runs inside the timed span, after each call."""
    for _ in range(warmup):
        fn()
        if sync is not None:
            sync()
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        out.append(time.perf_counter() - t0)
    return out


# --- statistics --------------------------------------------------------------------------------------------


def percentile(xs: Sequence[float], q: float) -> float | None:
    """The q-quantile (0 <= q <= 1) by linear interpolation between closest ranks; None without samples."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be within [0, 1], not {q}")
    if not xs:
        return None
    s = sorted(xs)
    h = (len(s) - 1) * q
    lo = math.floor(h)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (h - lo) * (s[hi] - s[lo])


def median(xs: Sequence[float]) -> float | None:
    return percentile(xs, 0.5)


def ms(seconds: float | None) -> float | None:
    """Seconds -> milliseconds rounded to the microsecond (None stays None)."""
    return None if seconds is None else round(seconds * 1e3, 3)


@dataclass(frozen=True)
class Stat:
    """Summary of samples in seconds; ``to_json`` writes milliseconds under ``*_ms`` keys."""

    n: int
    median: float
    p90: float
    p99: float
    min: float
    max: float
    mean: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> Stat | None:
        if not samples:
            return None
        q = [percentile(samples, x) for x in (0.5, 0.9, 0.99)]
        assert q[0] is not None and q[1] is not None and q[2] is not None
        return cls(n=len(samples), median=q[0], p90=q[1], p99=q[2], min=min(samples), max=max(samples),
                   mean=math.fsum(samples) / len(samples))

    def to_json(self) -> dict[str, Any]:
        return {"n": self.n, "median_ms": ms(self.median), "p90_ms": ms(self.p90), "p99_ms": ms(self.p99),
                "min_ms": ms(self.min), "max_ms": ms(self.max), "mean_ms": ms(self.mean)}


def stat_json(samples: Sequence[float]) -> dict[str, Any]:
    """Statistics and (up to MAX_SAMPLES_IN_JSON) samples in milliseconds; ``{"n": 0}`` without samples."""
    st = Stat.of(samples)
    if st is None:
        return {"n": 0}
    out = st.to_json()
    if len(samples) <= MAX_SAMPLES_IN_JSON:
        out["samples_ms"] = [ms(s) for s in samples]
    return out


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, or None when either is missing or the denominator is not positive."""
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def fmt_ratio(x: float | None) -> str:
    """'2.4×' (one decimal; two significant digits under 0.1), '-' when there is no ratio."""
    if x is None:
        return "-"
    return f"{x:.1f}×" if x >= 0.1 else f"{x:.2g}×"


def fmt_ms(seconds: float | None) -> str:
    """A duration in milliseconds for a table: 2 decimals under 10 ms, 1 under 1 s, none above."""
    if seconds is None:
        return "-"
    v = seconds * 1e3
    return f"{v:.2f}" if v < 10 else f"{v:.1f}" if v < 1000 else f"{v:.0f}"


# --- results -----------------------------------------------------------------------------------------------


@dataclass
class Result:
    """One operation: samples in seconds, the error that stopped it (if any), a note, sub-phase samples."""

    samples: list[float] = field(default_factory=list)
    error: str | None = None
    note: str | None = None
    extra: dict[str, list[float]] = field(default_factory=dict)
    fields: dict[str, Any] = field(default_factory=dict)

    def add(self, seconds: float) -> None:
        self.samples.append(seconds)

    def add_extra(self, name: str, seconds: float) -> None:
        self.extra.setdefault(name, []).append(seconds)

    def fail(self, error: BaseException | str) -> None:
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}".strip()
        self.error = text if self.error is None else f"{self.error}; {text}"

    @property
    def stat(self) -> Stat | None:
        return Stat.of(self.samples)

    def to_json(self) -> dict[str, Any]:
        out = stat_json(self.samples)
        if self.note:
            out["note"] = self.note
        if self.error is not None:
            out["error"] = self.error
        if self.extra:
            out["extra"] = {k: stat_json(v) for k, v in self.extra.items()}
        out.update(self.fields)
        return out


@contextlib.contextmanager
def recording(result: Result, what: str) -> Iterator[None]:
    """Run one benchmark phase; an exception ends the phase and is recorded in ``result``, then printed."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - recorded into the results and printed
        result.fail(e)
        console.print(f"[red]{what} failed:[/red] {type(e).__name__}: {e}", highlight=False)
        console.print(traceback.format_exc(limit=4), style="dim", markup=False, highlight=False)


def write_json_atomic(path: Path, doc: dict[str, Any]) -> Path:
    """Write ``doc`` to ``path`` (its folder made if need be) as the results' JSON, whole, synced and renamed into
    place (``agentenv.config.write_atomic``: a results file reads like any other, ``0o666`` less the umask)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(doc, indent=2, default=str) + "\n", fsync=True)
    return path


def add_output_arg(ap: argparse.ArgumentParser, name: str, *aliases: str) -> None:
    default = RESULTS_DIR / f"{name}.json"
    ap.add_argument("--output", *aliases, dest="output", type=Path, default=default,
                    help=f"JSON results (default {default.relative_to(ROOT)})")


class Report:
    """Everything one benchmark run measured, written as one JSON document (the layout is in the module doc)."""

    def __init__(self, benchmark: str, args: argparse.Namespace | dict[str, Any] | None = None) -> None:
        self.benchmark = benchmark
        self.args = dict(vars(args) if isinstance(args, argparse.Namespace) else args or {})
        self.started = time.time()
        self.commit, self.dirty = git_commit(ROOT)
        self.machine = machine_info()
        self.machine["cpu_probe_ms_start"] = cpu_probe()
        self.ticks = cpu_ticks()
        self.results: dict[str, Result] = {}
        self.ratios: dict[str, dict[str, Any]] = {}
        self.info: dict[str, Any] = {}
        self.notes: list[str] = []
        self.fatal: str | None = None

    def result(self, key: str, note: str | None = None) -> Result:
        """The result of one operation, made on first use."""
        r = self.results.setdefault(key, Result())
        if note is not None:
            r.note = note
        return r

    def add_ratio(self, name: str, numerator: str, denominator: str) -> float | None:
        """median(numerator) / median(denominator), both result keys; stored with its text, None if missing."""
        a, b = (self.results.get(k) for k in (numerator, denominator))
        x = ratio(median(a.samples) if a else None, median(b.samples) if b else None)
        self.ratios[name] = {"value": None if x is None else round(x, 3), "text": fmt_ratio(x),
                             "numerator": numerator, "denominator": denominator}
        return x

    @property
    def errors(self) -> dict[str, str]:
        return {k: r.error for k, r in self.results.items() if r.error is not None}

    def to_json(self) -> dict[str, Any]:
        machine = dict(self.machine)
        with contextlib.suppress(OSError):
            machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        machine["cpu_probe_ms_end"] = cpu_probe()
        now = cpu_ticks()
        if self.ticks and now and now[0] > self.ticks[0]:  # the hypervisor's share of the run's CPU time
            machine["steal_pct"] = round(100 * (now[1] - self.ticks[1]) / (now[0] - self.ticks[0]), 2)
        return {
            "schema": SCHEMA, "benchmark": self.benchmark,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started)),
            "duration_s": round(time.time() - self.started, 1), "commit": self.commit, "dirty": self.dirty,
            "machine": machine, "args": self.args, "results": {k: r.to_json() for k, r in self.results.items()},
            "ratios": self.ratios, "errors": self.errors, "fatal": self.fatal, "info": self.info,
            "notes": self.notes,
        }

    def write(self, path: Path | None = None) -> Path:
        doc = self.to_json()
        out = write_json_atomic(path or RESULTS_DIR / f"{self.benchmark}.json", doc)
        m = doc["machine"]
        console.print(f"machine speed: a fixed Python loop took {m['cpu_probe_ms_start']} ms at the start, "
                      f"{m['cpu_probe_ms_end']} ms at the end; CPU steal {m.get('steal_pct', '-')}%", highlight=False)
        with contextlib.suppress(ValueError):
            out = out.resolve().relative_to(Path.cwd())
        console.print(f"results: {out}", highlight=False)
        return out

    def print_errors(self) -> None:
        for k, v in self.errors.items():
            console.print(f"[red]error[/red] {k}: {v}", highlight=False)
        if self.fatal:
            console.print(f"[red]aborted:[/red] {self.fatal}", highlight=False)


# --- the table ---------------------------------------------------------------------------------------------


@dataclass
class Row:
    """One line of a table: a label, one result per side (None: not measured), a ratio, further cells."""

    label: str
    results: Sequence[Result | None]
    ratio: float | None = None
    cells: dict[str, str] = field(default_factory=dict)


def _median_cell(r: Result | None) -> str:
    if r is None:
        return "-"
    if not r.samples:
        return "[red]ERR[/red]" if r.error else "-"
    return fmt_ms(median(r.samples)) + (" [red]*[/red]" if r.error else "")


def print_table(title: str, rows: Sequence[Row], sides: Sequence[str] = ("",), p99: bool = False,
                ratio_title: str = "ratio") -> None:
    """Median, p90 (and p99) in ms and n for each side, a ratio column when a row has one, then the cells.

    A median marked ``*`` comes from the runs taken before the operation failed (its error is printed below)."""
    table = Table()
    table.add_column("operation", no_wrap=True)
    for side in sides:
        table.add_column(f"{side} med ms".strip(), justify="right", no_wrap=True)
        table.add_column("p90", justify="right", no_wrap=True)
        if p99:
            table.add_column("p99", justify="right", no_wrap=True)
        table.add_column("n", justify="right", no_wrap=True)
    with_ratio = any(r.ratio is not None for r in rows)
    if with_ratio:
        table.add_column(ratio_title, justify="right", no_wrap=True)
    extra = list(dict.fromkeys(k for r in rows for k in r.cells))
    for k in extra:
        table.add_column(k, no_wrap=True)
    for row in rows:
        cells = [row.label]
        for i in range(len(sides)):
            r = row.results[i] if i < len(row.results) else None
            st = r.stat if r is not None else None
            cells += [_median_cell(r), fmt_ms(st.p90 if st else None)]
            if p99:
                cells.append(fmt_ms(st.p99 if st else None))
            cells.append(str(st.n) if st else "-")
        if with_ratio:
            cells.append(fmt_ratio(row.ratio))
        cells += [row.cells.get(k, "") for k in extra]
        table.add_row(*cells)
    console.print(f"[bold]{title}[/bold]", highlight=False)
    console.print(table)
