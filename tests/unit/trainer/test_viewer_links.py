"""The trajectory viewer against a run folder someone else wrote (issue 40, finding 11): every file it reads of a run
(summary.json, run.json, the index and its shards, metrics.jsonl, config.toml) is that run's own, never one that a
symlink or a shard name of the index leads out of the run to (a file of the host that the viewer's user may read)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from rollout import trajectory as tj
from trainer.viewer import data as viewer
from trainer.viewer import runs as viewer_runs
from trainer.viewer import web as viewer_web

from .test_viewer import episode

TOKEN = "viewer-links-token-" + "q" * 20
SECRET = "host-secret-not-in-any-run"


@pytest.fixture()
def runs(tmp_path: Path) -> Path:
    """A folder of runs (``roll``, a rollout run; ``train``, a train run), and beside it, outside, the host's files."""
    outside = tmp_path / "host"
    outside.mkdir()
    (outside / "secret.json").write_text(json.dumps({"groups": SECRET, "reward_mean": SECRET, "started_at": SECRET}))
    (outside / "metrics.jsonl").write_text(json.dumps({"step": 0, SECRET: 1.0}) + "\n")
    (outside / "config.toml").write_text(f'[rl]\nbaseline = "{SECRET}"\n')
    tj.write(outside / "shards", [episode("host", 0, 1.0)])
    root = tmp_path / "runs"
    tj.write(root / "roll", [episode("g1", 0, 1.0)])
    tj.write(root / "train" / "trajectories", [episode("t1", 0, 1.0), episode("t1", 1, 0.0)])
    (root / "train" / "metrics.jsonl").write_text(json.dumps({"step": 0, "loss": 0.5}) + "\n")
    return root


def test_a_runs_summary_and_run_file_linked_out_of_it_are_not_read(runs: Path) -> None:
    host = runs.parent / "host"
    (runs / "roll" / "summary.json").symlink_to(host / "secret.json")
    (runs / "roll" / "run.json").symlink_to(host / "secret.json")
    (runs / "train" / "summary.json").symlink_to(host / "secret.json")
    for name in ("roll", "train"):
        assert SECRET not in json.dumps(viewer_runs.brief(name, runs / name))
        assert SECRET not in json.dumps(viewer_runs.load(runs, name).summary())
    c = TestClient(viewer_web.create_app(runs, TOKEN), base_url="http://127.0.0.1:8701", follow_redirects=False)
    assert c.post("/console/login", data={"token": TOKEN}).status_code == 303
    listed = c.get("/console/api/runs")
    assert listed.status_code == 200 and SECRET not in listed.text
    assert {r["name"] for r in listed.json()["runs"]} == {"roll", "train"}  # the runs themselves still listed
    (runs / "roll" / "summary.json").unlink()
    os.mkfifo(runs / "roll" / "summary.json")  # nor is a FIFO opened to wait on: no writer would ever come
    assert viewer_runs.brief("roll", runs / "roll")["groups"] is None


def test_a_shard_metrics_or_config_linked_out_of_a_run_is_refused(runs: Path) -> None:
    host = runs.parent / "host"
    (runs / "roll" / "shard-00777.msgpack").symlink_to(host / "shards" / "shard-00000.msgpack")
    with pytest.raises(viewer_runs.RunNotFound, match="outside"):
        viewer_runs.load(runs, "roll")
    c = TestClient(viewer_web.create_app(runs, TOKEN), base_url="http://127.0.0.1:8701", follow_redirects=False)
    assert c.post("/console/login", data={"token": TOKEN}).status_code == 303
    r = c.get("/console/api/runs/roll/episodes")
    assert r.status_code == 404 and "symlink" in r.json()["message"] and "host" not in r.text
    (runs / "roll" / "shard-00777.msgpack").unlink()
    os.mkfifo(runs / "roll" / "shard-00888.msgpack")  # never opened to wait on a writer
    with pytest.raises(viewer_runs.RunNotFound, match="not a regular file"):
        viewer_runs.load(runs, "roll")
    (runs / "roll" / "shard-00888.msgpack").unlink()
    index = json.loads((runs / "roll" / "index.json").read_text())  # the index naming a shard out of the run
    index["shards"].append({"name": "../../host/shards/shard-00000.msgpack", "records": 1})
    (runs / "roll" / "index.json").write_text(json.dumps(index))
    with pytest.raises(viewer_runs.RunNotFound, match="outside"):
        viewer_runs.load(runs, "roll")
    (runs / "train" / "metrics.jsonl").unlink()
    (runs / "train" / "metrics.jsonl").symlink_to(host / "metrics.jsonl")
    (runs / "train" / "config.toml").symlink_to(host / "config.toml")
    train = viewer_runs.load(runs, "train")
    with pytest.raises(viewer_runs.RunNotFound, match="outside"):
        viewer.metrics(train)
    with pytest.raises(viewer_runs.RunNotFound, match="outside"):
        viewer.group(train, "t1", lambda ids: "", lambda text: (text, []))
