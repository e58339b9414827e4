"""The whole loop survives ``kill -9``: `agentenv train` (policy server, local Ray, rollout worker, trainer) is killed,
process group at once, after its first RL checkpoint; the same command with ``--resume`` continues from that
checkpoint and ends with every iteration taken exactly once, each on the next weight version."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer import checkpoint as ckpt

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[3]
ITERATIONS = 3


def _cmd(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "agentenv", "train", "--config", str(ROOT / "trainer/configs/main.toml"), "--quick",
            "--name", "resume", "--set", f'out_dir="{out}"', "--set", 'progress="off"', "--set", "swe.enabled=false",
            "--set", f"rl.iterations={ITERATIONS}", "--set", "eval.enabled=false", *extra]


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


def test_kill9_then_resume_takes_every_iteration_once(tmp_path):
    run = tmp_path / "resume"
    log = (tmp_path / "first.log").open("w")
    proc = subprocess.Popen(_cmd(tmp_path), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 600
        while ckpt.latest(run / "checkpoints") is None:
            assert proc.poll() is None, (tmp_path / "first.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "no checkpoint within 10 minutes"
            time.sleep(0.2)
    finally:
        _kill_group(proc)   # the driver, the trainer, the policy server and Ray's processes at once
    killed_at = ckpt.read_meta(ckpt.latest(run / "checkpoints"))["data"]["iteration"]
    assert 1 <= killed_at < ITERATIONS

    r = subprocess.run(_cmd(tmp_path, "--resume"), cwd=ROOT, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert r.returncode == 0, f"stdout:\n{r.stdout[-4000:]}\nstderr:\n{r.stderr[-4000:]}"
    assert f"resumed at iteration {killed_at}" in r.stdout

    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in rows if "iteration" in x and x.get("eval") is None and "loss" in x]
    assert [x["iteration"] for x in train] == [float(i) for i in range(1, ITERATIONS + 1)]   # none lost, none twice
    assert [x["version"] for x in train] == [float(i) for i in range(1, ITERATIONS + 1)]
    meta = ckpt.read_meta(ckpt.latest(run / "checkpoints"))
    assert meta["step"] == ITERATIONS and meta["data"]["iteration"] == ITERATIONS
    summary = json.loads((run / "summary.json").read_text())
    assert summary["iterations"] == ITERATIONS and summary["weight_version"] == ITERATIONS
