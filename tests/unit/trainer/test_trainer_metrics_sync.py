"""Metrics (JSONL rewound on resume, torn lines, PNG panels, the live display) and weight sync (the routes and bodies
of our server, SGLang and vLLM; versions; timing; failures named; old files pruned)."""

import json

import httpx
import pytest

from policy.config import k3_mini
from trainer.distributed.sync import Endpoint, SyncError, WeightSync
from trainer.metrics import MetricsLog, Progress, plot, read_jsonl


def test_metrics_log_rewinds_to_the_checkpoint_and_skips_torn_lines(tmp_path):
    path = tmp_path / "m.jsonl"
    log = MetricsLog(path)
    for s in range(1, 6):
        log.write(s, {"loss": 1.0 / s, "reward/train": float("nan"), "step": 99})
    with open(path, "a") as f:
        f.write('{"step": 6, "lo')                        # a crash mid-line
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3, 4, 5]
    assert read_jsonl(path)[0]["reward/train"] is None    # NaN is written as null
    log = MetricsLog(path, resume_step=3)                 # resumed from the step-3 checkpoint
    assert [r["step"] for r in log.rows()] == [1, 2, 3]
    log.write(4, {"loss": 0.2})
    assert [r["step"] for r in log.rows()] == [1, 2, 3, 4]
    assert MetricsLog(path).rows() == []                  # a fresh run starts a fresh log


def test_plot_draws_the_panels_it_has(tmp_path):
    rows = [{"step": s, "reward/train": s / 10, "reward/heldout": s / 20, "pass_rate/train": 0.5, "entropy": 2.0,
             "kl": 0.01 * s, "clip_frac": 0.1, "grad_norm": 1.0, "response_length": 40 + s, "staleness/mean": 0.5,
             "time/env": 1.0, "time/policy": 2.0, "time/train": 0.5, "time/sync": 0.1} for s in range(1, 8)]
    out = plot(rows, tmp_path / "p.png")
    assert out is not None and out.stat().st_size > 5000
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    assert plot(path, tmp_path / "q.png") is not None
    assert plot([{"step": 1}], tmp_path / "none.png") is None


def test_progress_is_optional(tmp_path):
    with Progress(3, enabled=False) as p:
        p.update(1, {"loss": 0.5, "time/train": 1.0})
    with Progress(3, enabled=True) as p:
        p.update(2, {"loss": 0.5, "reward/train": 1.0, "time/env": 2.0, "time/train": 1.0})


class FakeTrainer:
    step_count = 7
    model_cfg = k3_mini()

    def save_weights(self, path):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"weights")
        return path


class FakeEngine:
    def __init__(self):
        self.weight_version, self.loaded = 0, []

    def update_weights(self, path, mode="drain", timeout=600.0):
        self.loaded.append((path, mode))
        self.weight_version += 1
        return self.weight_version


def test_sync_calls_ours_and_in_process_engines(tmp_path):
    """Ours over HTTP (SGLang's and vLLM's routes: test_engine_reload.py, against their schemas) and in process."""
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.host, request.url.path, json.loads(request.content), request.headers.get("authorization")))
        return httpx.Response(200, json={"ok": True, "weight_version": 3})

    client = httpx.Client(transport=httpx.MockTransport(handler))
    local = FakeEngine()
    sync = WeightSync([Endpoint("http://ours:8000", api_key="k"), Endpoint("http://ours2:8000/"), local],
                      str(tmp_path), client=client, mode="abort")
    r = sync.push(FakeTrainer())
    path = str(tmp_path / "step-00000007")          # every server: the same Kimi checkpoint folder
    assert sorted(seen) == [("ours", "/update_weights", {"path": path, "mode": "abort"}, "Bearer k"),
                            ("ours2", "/update_weights", {"path": path, "mode": "abort"}, None)]
    assert local.loaded == [(path, "abort")]
    assert r.versions == {"http://ours:8000": 3, "http://ours2:8000/": 3, f"local:{id(local):x}": 1}
    assert r.version is None                              # the servers disagree: no single version
    assert set(r.load_s) == set(r.versions) and r.total_s >= r.write_s >= 0
    assert r.metrics()["time/sync"] == r.total_s


def test_sync_names_the_servers_that_failed_and_prunes_old_files(tmp_path):
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "bad":
            return httpx.Response(400, json={"detail": "could not load weights: shape mismatch"})
        if request.url.host == "refuses":
            return httpx.Response(400, json={"success": False, "message": "no such folder"})   # as SGLang refuses
        return httpx.Response(200, json={"ok": True, "weight_version": 1})

    client = httpx.Client(transport=httpx.MockTransport(handler))
    ok = WeightSync([Endpoint("http://good")], str(tmp_path), keep=2, client=client)
    t = FakeTrainer()
    for s in range(4):
        t.step_count = s
        assert ok.push(t).version == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000003"]
    for _ in range(3):                                    # the same step pushed again keeps its folder
        ok.push(t)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000003"]
    bad = WeightSync([Endpoint("http://good"), Endpoint("http://bad"), Endpoint("http://refuses", "sglang")],
                     str(tmp_path), client=client)
    with pytest.raises(SyncError) as e:
        bad.push(t)
    assert "http://bad: ReloadError: agentenv at http://bad: POST /update_weights answered HTTP 400: could not load " \
        "weights: shape mismatch" in str(e.value) and "HTTP 400: no such folder" in str(e.value)
    assert "http://good" not in str(e.value)
