"""The main job's quick variant end to end, as CI runs it: `agentenv train --config trainer/configs/main.toml --quick`
starts the policy server (EP=2), a local Ray with a rollout worker and the trainer, warm-starts k3-mini on scripted
demonstrations, runs GRPO iterations on Lookup-v0 with groups forked from one reset, evaluates on held-out tasks,
plays one SWE-v0 group through the same path, and stops what it started.

It checks that the loop completes, that weight versions advance, and that what the run wrote is well formed
(trajectories, checkpoints, metrics, the figures): not a reward threshold."""

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from policy.config import model_config
from rollout.trajectory import read
from trainer import checkpoint as ckpt
from trainer.train import TrainConfig, Trainer

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[3]


def test_quick_main_job_end_to_end(tmp_path):
    cmd = [sys.executable, "-m", "agentenv", "train", "--config", str(ROOT / "trainer/configs/main.toml"), "--quick",
           "--set", f'out_dir="{tmp_path}"', "--set", 'progress="off"']
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert r.returncode == 0, f"stdout:\n{r.stdout[-4000:]}\nstderr:\n{r.stderr[-4000:]}"
    run = tmp_path / "quick"
    summary = json.loads((run / "summary.json").read_text())
    iterations = summary["config"]["rl"]["iterations"]
    assert summary["iterations"] == iterations
    assert summary["pass_rate_after_sft"] is not None and summary["pass_rate_after_rl"] is not None
    assert "held-out after RL" in r.stdout and "RL gain on held-out" in r.stdout and "time (s)" in r.stdout
    # mean@k with intervals, k samples of each task, and the paired gain
    k, n = summary["config"]["eval"]["samples"], summary["config"]["eval"]["episodes"]
    for tag in ("after_sft", "after_rl"):
        e = summary["heldout"][tag]
        assert e["k"] == k and e["tasks"] == n and e["episodes"] == n * k
        lo, hi = e["mean_at_k_ci"]
        assert lo <= e["mean_at_k"] <= hi and e["mean_at_k"] <= e["pass_at_k"]
    lo, hi = summary["rl_gain_ci"]
    assert lo <= summary["rl_gain"] <= hi

    # weight versions advance: one push per iteration, and one for the SWE step
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [x for x in rows if "version" in x and x.get("eval") is None]
    assert [x["version"] for x in train_rows] == [float(i) for i in range(1, iterations + 1)]
    assert summary["weight_version"] == iterations + 1
    swe = summary["swe"]
    assert swe["episodes"] == summary["config"]["swe"]["group_size"] and swe["graded"] == swe["episodes"]
    assert swe["shared_prompt"] is True and swe["trained"] is True

    # trajectories: well formed, every phase, each turn's version; GRPO groups forked from one reset
    trajs = list(read(run / "trajectories"))
    for t in trajs:
        t.check()
    phases = Counter(t.metadata["phase"] for t in trajs)
    g = summary["config"]["rl"]["group_size"]
    assert phases["train"] == iterations * summary["config"]["rl"]["groups_per_iteration"] * g
    assert phases["eval"] == 2 * n * k and phases["swe"] == swe["episodes"]
    train = [t for t in trajs if t.metadata["phase"] == "train"]
    assert {t.weight_versions[0] for t in train if t.turns} == set(range(iterations))
    groups: dict[str, list] = {}
    for t in train:
        groups.setdefault(t.group_id, []).append(t)
    assert all(len(v) == g for v in groups.values())
    for members in groups.values():
        assert len({tuple(t.token_ids[: t.prompt_len]) for t in members}) == 1   # one reset, one prompt

    # checkpoints load into a trainer; the warm start's weights and the demonstrations are there
    latest = ckpt.latest(run / "checkpoints")
    assert latest is not None
    meta = ckpt.read_meta(latest)
    assert meta["data"]["iteration"] == iterations and meta["step"] == iterations + 1
    with Trainer(model_config("k3-mini"), TrainConfig.from_dict(meta["train_config"])) as trainer:
        assert trainer.resume(run / "checkpoints")["step"] == iterations + 1
        assert trainer.step_count == iterations + 1
    assert (run / "sft" / "weights" / "config.json").is_file() and list(read(run / "demos"))
    for png in ("reward.png", "metrics.png"):
        assert (run / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run / "config.toml").read_text().startswith('name = "quick"')
