"""Checkpoints survive ``kill -9``: an SFT run over two training processes (EP=2, gloo) is killed mid-run, whole
process group at once; ``--resume`` continues from the last checkpoint with no step lost or repeated, on the same data
positions, and ends on exactly the weights of an uninterrupted run."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from policy.hf_format import read_checkpoint
from rollout.trajectory import write
from trainer.metrics import read_jsonl

sys.path.insert(0, str(Path(__file__).parents[2] / "unit" / "trainer"))
from trainer_helpers import make_traj, tiny_cfg  # noqa: E402

pytestmark = pytest.mark.integration
ROOT = Path(__file__).parents[3]
STEPS = 30


def _cmd(data: Path, cfg: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "trainer", "sft", "--data", str(data), "--out", str(out), "--model-config", str(cfg),
            "--steps", str(STEPS), "--batch-size", "3", "--lr", "1e-2", "--micro-batch-tokens", "40",
            "--world", "2", "--ep", "2", "--no-progress", *extra]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sft")
    rng = random.Random(0)
    write(tmp / "demos", [make_traj(rng, f"g{i}", 0, 1.0, gen=rng.randint(2, 6)) for i in range(7)])
    cfg = tmp / "model.json"
    cfg.write_text(json.dumps(tiny_cfg().to_dict()))
    return tmp / "demos", cfg


def test_kill_9_then_resume_loses_and_repeats_no_step(inputs, tmp_path):
    data, cfg = inputs
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    straight = tmp_path / "straight"
    subprocess.run(_cmd(data, cfg, straight), cwd=ROOT, env=env, check=True, timeout=600)

    run = tmp_path / "killed"
    proc = subprocess.Popen(_cmd(data, cfg, run), cwd=ROOT, env=env, start_new_session=True)
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if metrics.exists() and len(read_jsonl(metrics)) >= 4:
            break
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)     # the whole run: the controller and its training worker
    proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    logged = len(read_jsonl(metrics))
    assert 4 <= logged < STEPS, "the run finished before it could be killed"
    assert not (run / "weights").exists()

    # a fresh run into the same folder is refused; --resume continues
    refused = subprocess.run(_cmd(data, cfg, run), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "--resume" in refused.stderr
    subprocess.run(_cmd(data, cfg, run, "--resume"), cwd=ROOT, env=env, check=True, timeout=600)

    a, b = read_jsonl(straight / "metrics.jsonl"), read_jsonl(metrics)
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))          # every step once
    assert [(r["data/epoch"], r["data/index"]) for r in b] == [(r["data/epoch"], r["data/index"]) for r in a]
    assert [r["nll"] for r in b] == pytest.approx([r["nll"] for r in a], rel=1e-6)
    wa, wb = read_checkpoint(straight / "weights").state, read_checkpoint(run / "weights").state
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-6
    assert all(torch.isfinite(v).all() for v in wb.values())
    assert (run / "metrics.png").exists()
