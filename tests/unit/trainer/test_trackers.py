"""The experiment trackers (trainer.trackers) through their own libraries: what a run logs is read back with each
library's own reader; an unknown or missing tracker is refused before a run starts."""

from __future__ import annotations

import json
import random
import struct
import sys
from pathlib import Path

import pytest

from trainer.loop.config import ConfigError, RunConfig
from trainer.metrics import MetricsLog
from trainer.trackers import episode_table, open_tracker, require

sys.path.insert(0, str(Path(__file__).parent))
from trainer_helpers import make_traj  # noqa: E402

ROWS = [{"loss": 1.5, "reward/train": 0.25, "eval": "before", "nan": float("nan")}, {"loss": 0.5, "ok": True}]


def _run(name, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    pytest.importorskip({"wandb": "wandb", "tensorboard": "tensorboard", "mlflow": "mlflow"}[name])
    tracker = open_tracker(name, tmp_path / "run", "test-run", {"rl": {"lr": 1e-3}, "seed": 3})
    log = MetricsLog(tmp_path / "run" / "metrics.jsonl", tracker=tracker)
    for step, row in enumerate(ROWS):
        log.write(step, row)
    rng = random.Random(0)
    cols, rows = episode_table([make_traj(rng, "g0", i, float(i % 2)) for i in range(3)])
    tracker.table(1, "samples/heldout", cols, rows)
    log.close()
    assert [json.loads(x)["loss"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == \
        [1.5, 0.5]  # the record stays metrics.jsonl
    return tmp_path / "run"


def test_tensorboard_scalars_and_the_sample_table_read_back(tmp_path, monkeypatch):
    run = _run("tensorboard", tmp_path, monkeypatch)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(0, 1.5), (1, 0.5)]
    assert "nan" not in acc.Tags()["scalars"] and "eval" not in acc.Tags()["scalars"]
    text = acc.Tensors("samples/heldout/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| episode | task |" in text and text.count("\n") == 4  # header, rule, three episodes


def test_mlflow_metrics_params_and_table_read_back(tmp_path, monkeypatch):
    run = _run("mlflow", tmp_path, monkeypatch)
    import mlflow

    client = mlflow.tracking.MlflowClient((run / "mlruns").resolve().as_uri())
    exp = client.get_experiment_by_name("agentenv")
    (r,) = client.search_runs([exp.experiment_id])
    assert [(m.step, m.value) for m in client.get_metric_history(r.info.run_id, "loss")] == [(0, 1.5), (1, 0.5)]
    assert r.data.params["rl.lr"] == "0.001" and r.data.params["seed"] == "3"
    assert r.info.status == "FINISHED"
    table = json.loads(Path(client.download_artifacts(r.info.run_id, "samples/heldout/step-000001.json",
                                                      str(tmp_path / "dl"))).read_text())
    assert table["columns"][:2] == ["episode", "task"] and len(table["data"]) == 3


def _wandb_history(path: Path) -> list[dict]:
    """The history rows of an offline run's ``.wandb`` file: LevelDB log blocks (32 KiB; a 7-byte header of crc,
    length and type per piece, type 1 whole, 2-4 first/middle/last) of W&B's protobuf ``Record``s."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, piece, rows = path.read_bytes(), 7, b"", []
    assert data.startswith(b":W&B")
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        piece, pos = piece + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            r = pb.Record()
            r.ParseFromString(piece)
            piece = b""
            if r.WhichOneof("record_type") == "history":
                rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item})
    return rows


def test_wandb_offline_run_holds_the_history_and_the_table(tmp_path, monkeypatch):
    run = _run("wandb", tmp_path, monkeypatch)
    (offline,) = (run / "wandb").glob("offline-run-*")
    (records,) = offline.glob("run-*.wandb")  # what `wandb sync` uploads
    hist = _wandb_history(records)
    assert [(h["_step"], h["loss"]) for h in hist] == [(0, 1.5), (1, 0.5)]
    assert hist[0]["reward/train"] == 0.25 and "nan" not in hist[0] and "eval" not in hist[0]
    assert hist[1]["samples/heldout/_type"] == "table-file" and hist[1]["samples/heldout/nrows"] == 3
    table = json.loads((offline / "files" / hist[1]["samples/heldout/path"]).read_text())
    assert table["columns"][:2] == ["episode", "task"] and len(table["data"]) == 3


def test_unknown_or_missing_trackers_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="must be one of"):
        require("neptune")
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install 'wandb'"):
        require("wandb")
    cfg = RunConfig()
    cfg.metrics.tracker = "comet"
    with pytest.raises(ConfigError, match="metrics.tracker"):
        cfg.validate()
