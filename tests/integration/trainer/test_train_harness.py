"""The smoke test of training a harness (docs/harnesses.md): `agentenv train` with ``env.harness = "mini-swe-agent"``
runs one iteration end to end (policy server, local Ray, a rollout worker with its gateway, mini-swe-agent unmodified
in each forked sandbox, the env's grading, a step, a push). k3-mini's random weights answer no tool call, so
mini-swe-agent drops each answer it cannot parse and stops on its own format errors: every call after the first is a
labelled branch, and each branch is a sample. What it checks is the path, not learning (the learning runs are
reported in docs/harnesses.md)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollout import trajectory as tj

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[3]


def test_agentenv_train_plays_a_harness_and_trains_on_its_branches(tmp_path):
    cmd = [sys.executable, "-m", "agentenv", "train", "--config", str(ROOT / "trainer/configs/main.toml"), "--quick",
           "--name", "harness", "--set", f'out_dir="{tmp_path}"', "--set", 'progress="off"', "--set",
           "swe.enabled=false", "--set", "sft.enabled=false", "--set", "eval.enabled=false", "--set", "rl.iterations=1",
           "--set", "rl.groups_per_iteration=1", "--set", "rl.group_size=2", "--set", 'env.harness="mini-swe-agent"',
           "--set", 'env.harness_agent={system_template="Use the bash tool.", instance_template="{{task}}", '
                    'step_limit=4}']
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert r.returncode == 0, f"stdout:\n{r.stdout[-4000:]}\nstderr:\n{r.stderr[-4000:]}"
    run = tmp_path / "harness"
    records = list(tj.read(run / "trajectories"))
    episodes = {(t.group_id, t.group_index) for t in records}
    assert len(episodes) == 2 and len(records) >= 2
    for t in records:
        assert t.metadata["harness"] == "mini-swe-agent" and t.metadata["outcome"] == "graded", t.error
        assert t.reward == 0.0 and t.finish_reason == "submitted" and t.generated_tokens > 0
        gw = t.metadata["gateway"]
        assert gw["calls"] >= 1 and set(gw["causes"]) <= {"start", "extend", "answer_dropped"}
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in rows if "loss" in x]
    assert [x["version"] for x in train] == [1.0]
    assert train[0]["episodes"] == 2.0
