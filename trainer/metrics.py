"""Training metrics: one JSON line per iteration, PNG plots, a live progress display, an optional tracker.

``MetricsLog`` appends ``{"step": N, "time": ..., <metric>: value, ...}`` lines (flushed and fsynced). On resume it
is opened with the checkpoint's step and drops the lines of later steps (steps a killed run logged but did not
checkpoint), so that the file lists every step once. ``plot`` draws the standard panels (whichever the log has):
reward and pass rate on training and validation tasks (the held-out figures with their intervals are in
``reward.png``), response length, entropy, KL, clip fraction, grad norm,
staleness, and the time breakdown (environment / policy / training / weight sync) as stacked areas; the RL health
panels (ratio and TIS extremes, advantages, malformed calls, routing-replay coverage) are trainer/algorithm/health.py's.

Metric names the loop and the trainer share: ``reward/train``, ``reward/<split>``, ``pass_rate/train``,
``pass_rate/<split>`` (an evaluation's mean@k; ``_lo`` / ``_hi``: its 95% interval; split heldout or validation),
``pass_at_k/<split>``, ``response_length``, ``entropy``, ``kl``, ``clip_frac``, ``grad_norm``, ``staleness/mean``,
``time/env``, ``time/policy``, ``time/train``, ``time/sync``.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentenv.config import replacing

if TYPE_CHECKING:
    from trainer.trackers import Tracker

PANELS: list[tuple[str, list[str]]] = [
    ("reward", ["reward/train", "reward/validation"]),
    ("pass rate", ["pass_rate/train", "pass_rate/validation"]),
    ("response length (tokens)", ["response_length"]),
    ("entropy", ["entropy"]),
    ("KL", ["kl", "rollout_kl"]),
    ("clip fraction", ["clip_frac", "tis_clip_frac"]),
    ("grad norm", ["grad_norm"]),
    ("staleness (versions)", ["staleness/mean", "staleness/max"]),
    ("loss", ["loss", "nll", "pg_loss"]),
]
TIME_KEYS = ["time/env", "time/policy", "time/train", "time/sync"]


def _clean(v: Any) -> Any:
    """JSON-safe values: NaN and infinities become null."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class MetricsLog:
    """Per-iteration JSONL; ``resume_step`` drops lines of steps after it (rewritten atomically). With a
    ``tracker`` (``trainer.trackers``: W&B, TensorBoard, MLflow), every row also goes there."""

    def __init__(self, path: str | os.PathLike[str], resume_step: int | None = None,
                 tracker: Tracker | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tracker = tracker
        if self.path.exists():
            keep = [r for r in read_jsonl(self.path) if resume_step is not None and r.get("step", 0) <= resume_step]
            with replacing(self.path, text=True, fsync=True) as f:
                for r in keep:
                    f.write(json.dumps(r) + "\n")

    def write(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        row = {"step": step, "time": time.time(), **{k: _clean(v) for k, v in metrics.items() if k != "step"}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self.tracker is not None:
            self.tracker.log(step, metrics)
        return row

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.close()

    def rows(self) -> list[dict[str, Any]]:
        return read_jsonl(self.path)


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The complete lines of a metrics file (a torn last line, from a crash mid-write, is skipped)."""
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def plot(rows: Sequence[dict[str, Any]] | str | os.PathLike[str], out: str | os.PathLike[str],
         title: str = "training", panels: Sequence[tuple[str, list[str]]] = PANELS, with_time: bool = True
         ) -> Path | None:
    """Draw the ``panels`` the rows have data for (and the time breakdown, ``with_time``) into one PNG (written
    atomically); None when there is nothing."""
    data: list[dict[str, Any]] = read_jsonl(rows) if isinstance(rows, str | os.PathLike) else list(rows)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(key: str) -> tuple[list[float], list[float]]:
        pts = [(r["step"], r[key]) for r in data if isinstance(r.get(key), int | float)]
        return [p[0] for p in pts], [float(p[1]) for p in pts]

    drawn = [(name, [k for k in keys if series(k)[0]]) for name, keys in panels]
    drawn = [(n, ks) for n, ks in drawn if ks]
    has_time = with_time and any(series(k)[0] for k in TIME_KEYS)
    n = len(drawn) + has_time
    if n == 0:
        return None
    cols = min(3, n)
    nrows = math.ceil(n / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.2 * nrows), squeeze=False)
    flat = list(axes.flat)
    for ax, (name, keys) in zip(flat, drawn, strict=False):
        for k in keys:
            xs, ys = series(k)
            ax.plot(xs, ys, label=k, marker="." if len(xs) < 30 else None)
        ax.set_title(name)
        ax.set_xlabel("step")
        if len(keys) > 1:
            ax.legend(fontsize=7)
    if has_time:
        ax = flat[len(drawn)]
        steps = [r["step"] for r in data]
        stacks = [[float(r.get(k) or 0.0) for r in data] for k in TIME_KEYS]
        ax.stackplot(steps, stacks, labels=[k.split("/")[1] for k in TIME_KEYS])
        ax.set_title("time per iteration (s)")
        ax.set_xlabel("step")
        ax.legend(fontsize=7, loc="upper left")
    for ax in flat[n:]:
        ax.axis("off")
    fig.suptitle(title)
    return save_figure(fig, out)


def save_figure(fig: Any, out: str | os.PathLike[str]) -> Path:
    """Write a matplotlib figure as PNG atomically (by rename) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with replacing(out) as f:
        fig.savefig(f, dpi=90, format="png")
    plt.close(fig)
    return out


DISPLAY_KEYS = ["loss", "reward/train", "pass_rate/train", "entropy", "kl", "clip_frac", "grad_norm",
                "response_length", "staleness/mean", "train_tokens_per_s"]


class Progress:
    """A live display of a run (rich): a progress bar over the steps and a table of the latest metrics and the
    time breakdown. ``enabled=False`` (or no terminal, with ``auto``) prints nothing."""

    def __init__(self, total: int, title: str = "training", enabled: bool | None = None,
                 keys: Iterable[str] = DISPLAY_KEYS) -> None:
        from rich.console import Console
        self.console = Console()
        self.enabled = self.console.is_terminal if enabled is None else enabled
        self.total, self.title, self.keys = total, title, list(keys)
        self.live: Any = None
        self.last: dict[str, Any] = {}
        self.step = 0
        from rich import progress as rp
        self.bar = rp.Progress(rp.TextColumn("[bold]{task.description}"), rp.BarColumn(), rp.MofNCompleteColumn(),
                               rp.TimeElapsedColumn(), rp.TimeRemainingColumn(), console=self.console)
        self.task = self.bar.add_task(title, total=total)

    def _render(self) -> Any:
        from rich.console import Group
        from rich.table import Table
        t = Table(show_header=True, box=None)
        t.add_column("metric")
        t.add_column("value", justify="right")
        for k in self.keys:
            v = self.last.get(k)
            if isinstance(v, int | float):
                t.add_row(k, f"{v:.4g}")
        times = [(k.split("/")[1], self.last.get(k)) for k in TIME_KEYS]
        times = [(k, v) for k, v in times if isinstance(v, int | float)]
        if times:
            t.add_row("time (s)", "  ".join(f"{k} {v:.2f}" for k, v in times))
        return Group(self.bar, t)

    def __enter__(self) -> Progress:
        if self.enabled:
            from rich.live import Live
            self.live = Live(self._render(), console=self.console, refresh_per_second=4)
            self.live.__enter__()
        return self

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        self.step, self.last = step, metrics
        self.bar.update(self.task, completed=step)
        if self.live is not None:
            self.live.update(self._render())

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.__exit__(None, None, None)
            self.live = None


# --- summaries of a loop's run (bench/train.py reads them) ---------------------------------------------------------

def iteration_split(rows: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Median seconds per iteration in each phase (environment, policy, training, weight sync), its share of their
    sum, and the median wall time between two iterations (less than the sum when rollouts overlap training);
    None when the rows carry no phase times."""
    med = {}
    for k in TIME_KEYS:
        xs = [float(r[k]) for r in rows if isinstance(r.get(k), int | float)]
        if xs:
            med[k.split("/")[1]] = statistics.median(xs)
    total = sum(med.values())
    if not med or total <= 0:
        return None
    stamps = [float(r["time"]) for r in rows if isinstance(r.get("time"), int | float)]
    walls = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return {"median_s": med, "share": {k: v / total for k, v in med.items()}, "iterations": len(rows),
            "wall_s": statistics.median(walls) if walls else None}


def rollout_to_train(rows: Sequence[dict[str, Any]]) -> dict[str, float] | None:
    """Per staleness bound (the row's ``staleness/bound``, else its ``staleness/max``): the summed rollout time
    (environment + policy) over the summed training time, as a ratio; None without both."""
    by: dict[str, list[float]] = {}
    for r in rows:
        bound = r.get("staleness/bound", r.get("staleness/max"))
        env, pol, train = (r.get(k) for k in ("time/env", "time/policy", "time/train"))
        if bound is None or not isinstance(train, int | float) or train <= 0:
            continue
        acc = by.setdefault(str(int(bound)), [0.0, 0.0])
        acc[0] += float(env or 0.0) + float(pol or 0.0)
        acc[1] += float(train)
    return {k: v[0] / v[1] for k, v in sorted(by.items())} or None
