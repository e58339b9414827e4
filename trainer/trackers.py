"""The experiment trackers a run also logs to, through their own libraries: Weights & Biases, TensorBoard, MLflow.

``[metrics] tracker = "wandb" | "tensorboard" | "mlflow"`` (``MetricsConfig``). Each tracker gets every metrics row
(its numbers; ``metrics.jsonl`` stays the record) and, after each evaluation, a table of sample episodes (task,
reward, finish reason, turns, the last reply), as verl and OpenRLHF log them. They write under the run's folder:

- wandb: an offline run in ``<run>/wandb`` (no internet here; ``wandb sync`` uploads it later), unless
  ``WANDB_MODE`` says otherwise;
- tensorboard: event files in ``<run>/tensorboard``; the table as a Markdown text summary;
- mlflow: a local file store in ``<run>/mlruns`` unless ``[metrics] uri`` names a tracking server; the table as a
  JSON artifact (``mlflow.log_table``).

A tracker whose library is missing is refused before the run starts (``require``), never silently skipped.
"""

from __future__ import annotations

import importlib.util
import math
import os
import time
from pathlib import Path
from typing import Any, Protocol

TRACKERS = ("wandb", "tensorboard", "mlflow")
_PIP = {"wandb": "wandb", "tensorboard": "tensorboard", "mlflow": "mlflow-skinny"}  # each imports as its name


class Tracker(Protocol):
    """Where a run's numbers and sample tables also go."""

    def log(self, step: int, metrics: dict[str, Any]) -> None: ...

    def table(self, step: int, name: str, columns: list[str], rows: list[list[Any]]) -> None: ...

    def close(self) -> None: ...


def require(name: str) -> None:
    """Refuse an unknown tracker, or one whose library is not installed, saying how to get it."""
    if name not in TRACKERS:
        raise ValueError(f"metrics.tracker must be one of {TRACKERS} (or empty), got {name!r}")
    if importlib.util.find_spec(name) is None:
        raise ValueError(f"metrics.tracker = {name!r} needs the {_PIP[name]} package: "
                         f"pip install '{_PIP[name]}' (or the project's trackers extra)")


def numbers(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics row (what every tracker plots)."""
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(float(v))}


EPISODE_COLUMNS = ["episode", "task", "group", "reward", "finish", "turns", "generated_tokens", "tool_calls",
                   "malformed_calls", "weight_version"]


def episode_table(trajectories: list[Any], limit: int = 32) -> tuple[list[str], list[list[Any]]]:
    """The first ``limit`` episodes of an evaluation as a table's columns and rows."""
    rows = [[t.episode_id, t.task_id, t.group_id, t.reward, t.finish_reason, len(t.turns),
             sum(u.generated for u in t.turns), t.tool_calls, t.malformed_calls,
             max((u.weight_version for u in t.turns), default=None)] for t in trajectories[:limit]]
    return EPISODE_COLUMNS, rows


def for_run(cfg: Any, run_dir: Path) -> Tracker | None:
    """The tracker a run's ``[metrics]`` names (``trainer.loop.config.MetricsConfig``), or None."""
    import dataclasses

    m = cfg.metrics
    return open_tracker(m.tracker, run_dir, cfg.name, dataclasses.asdict(cfg), m.project, m.uri) if m.tracker else None


def open_tracker(name: str, run_dir: Path, run_name: str, config: dict[str, Any], project: str = "agentenv",
                 uri: str = "") -> Tracker:
    """The tracker ``name`` for the run in ``run_dir`` (``require`` first)."""
    require(name)
    if name == "wandb":
        return WandbTracker(run_dir, run_name, config, project)
    if name == "tensorboard":
        return TensorBoardTracker(run_dir / "tensorboard")
    return MlflowTracker(run_dir, run_name, config, project, uri)


class WandbTracker:
    """A W&B run, offline unless ``WANDB_MODE`` is set."""

    def __init__(self, run_dir: Path, run_name: str, config: dict[str, Any], project: str) -> None:
        import wandb

        run_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, name=run_name, dir=str(run_dir), config=config,
                              mode=os.environ.get("WANDB_MODE", "offline"),  # type: ignore[arg-type]
                              settings=wandb.Settings(silent=True, console="off"))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.run.log(numbers(metrics), step=step)

    def table(self, step: int, name: str, columns: list[str], rows: list[list[Any]]) -> None:
        import wandb

        cols: list[str | int] = [*columns]
        self.run.log({name: wandb.Table(columns=cols, data=rows)}, step=step)

    def close(self) -> None:
        self.run.finish()


class TensorBoardTracker:
    """TensorBoard event files (``torch.utils.tensorboard``)."""

    def __init__(self, folder: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(folder))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for k, v in numbers(metrics).items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def table(self, step: int, name: str, columns: list[str], rows: list[list[Any]]) -> None:
        def cell(v: Any) -> str:
            return str(v).replace("|", "\\|").replace("\n", " ")

        md = "\n".join(["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns),
                        *("| " + " | ".join(cell(v) for v in r) + " |" for r in rows)])
        self.writer.add_text(name, md, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class MlflowTracker:
    """An MLflow run in a local file store (``<run>/mlruns``) or on the tracking server at ``uri``."""

    def __init__(self, run_dir: Path, run_name: str, config: dict[str, Any], project: str, uri: str) -> None:
        import mlflow

        if not uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow's local backend, as mlflow-skinny has
            uri = (run_dir / "mlruns").resolve().as_uri()
        self.client = mlflow.tracking.MlflowClient(uri)
        exp = self.client.get_experiment_by_name(project)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(project)
        self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
        for k, v in _flat(config).items():
            self.client.log_param(self.run_id, k, str(v)[:500])

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k.replace("@", "_at_"), v, now, step) for k, v in numbers(metrics).items()]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)

    def table(self, step: int, name: str, columns: list[str], rows: list[list[Any]]) -> None:
        self.client.log_table(self.run_id, {c: [r[i] for r in rows] for i, c in enumerate(columns)},
                              f"{name}/step-{step:06d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
