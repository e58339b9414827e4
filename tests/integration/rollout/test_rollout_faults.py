"""Faults of a Ray rollout: a worker killed mid-episode (restarted, its groups played again, its sandboxes
closed), the policy server going away (a clear error, no hang, nothing leaked), and ``kill -9`` of the driver
(the shards written so far read back whole)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest
import ray

from rollout import trajectory
from rollout.agent import AgentConfig
from rollout.driver import Rollout
from rollout.workers import PolicyUnavailable, RolloutConfig, load_task_refs

from .helpers import calc_script, labelled, python_script, tool_tasks, wait_for

pytestmark = pytest.mark.integration


def test_a_worker_killed_mid_episode_is_restarted_its_groups_replayed_and_its_sandboxes_closed(
        ray_cluster, serve_policy, tmp_path):
    policy = serve_policy(python_script)
    policy.delay = 1.0  # the second policy call of each episode waits: the kill lands while the sandbox lives
    refs = load_task_refs(tool_tasks(tmp_path / "tasks.jsonl", 3))
    cfg = RolloutConfig("agentenv/Tool-v0", policy.url, agent=AgentConfig(max_turns=3), groups_per_worker=3)
    r = Rollout(cfg, workers=1, out=tmp_path / "run")
    results, errors = [], []

    def drive():
        try:
            results.extend(r.groups(refs))
        except BaseException as e:  # noqa: BLE001 - checked below
            errors.append(e)

    thread = threading.Thread(target=drive)
    thread.start()
    try:
        wait_for(lambda: labelled(r.run_id)["sandboxes"], limit=120)
        pid = ray.get(ray.get_actor(f"rollout-{r.run_id}-w0").info.remote(), timeout=60)["pid"]
        os.kill(pid, signal.SIGKILL)
        policy.delay = 0.0
    finally:
        thread.join(timeout=240)
    assert not thread.is_alive() and not errors, errors
    trajs = [t for g in results for t in g.trajectories]
    assert len(trajs) == 3 and {t.reward for t in trajs} == {1.0}, [t.error for t in trajs]
    assert r.stats.worker_failures >= 1 and max(t.metadata["attempt"] for t in trajs) == 2
    [info] = r.worker_infos
    assert info["restarted"] and info["swept"]["sandboxes"], info  # the new worker closed what the dead one left
    assert info["pid"] != pid
    assert labelled(r.run_id) == {"sandboxes": [], "snapshots": []}
    assert len(list(trajectory.read(tmp_path / "run"))) == 3


def test_the_policy_server_going_away_stops_the_run_with_a_clear_error(ray_cluster, serve_policy, tmp_path):
    policy = serve_policy(python_script)
    policy.delay = 0.5
    refs = load_task_refs(tool_tasks(tmp_path / "tasks.jsonl", 12))
    cfg = RolloutConfig("agentenv/Tool-v0", policy.url, agent=AgentConfig(max_turns=3, policy_timeout=60),
                        groups_per_worker=2)
    out = tmp_path / "run"
    r = Rollout(cfg, workers=2, out=out, probe_timeout=5)
    it = r.groups(refs)
    first = next(it)
    assert first.trajectories[0].reward == 1.0
    policy.stop()
    with pytest.raises(PolicyUnavailable, match=policy.url.replace(".", r"\.")) as e:
        list(it)
    assert "not played" in str(e.value)
    recorded = list(trajectory.read(out))
    assert recorded[0].reward == 1.0 and len(recorded) < 12
    assert any(t.finish_reason == "policy_error" and t.reward is None for t in recorded)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["not_run_groups"] > 0
    assert labelled(r.run_id) == {"sandboxes": [], "snapshots": []}


def test_shards_survive_kill_9_of_the_driver(ray_cluster, serve_policy, tmp_path):
    policy = serve_policy(calc_script)
    policy.delay = 0.2
    tasks = tool_tasks(tmp_path / "tasks.jsonl", 40)
    out = tmp_path / "run"
    code = "import sys; from agentenv.cli import main; sys.argv[0] = 'agentenv'; main()"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "rollout", "--env", "agentenv/Tool-v0", "--tasks", str(tasks), "--policy-url",
         policy.url, "--workers", "1", "--groups-per-worker", "2", "--out", str(out), "--ray-address",
         ray_cluster.address], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=dict(os.environ))
    try:
        wait_for(lambda: proc.poll() is None and len(trajectory.shard_paths(out)) >= 2, limit=120)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    shards = trajectory.shard_paths(out)
    recorded = list(trajectory.read(out))
    assert len(shards) >= 2 and 0 < len(recorded) < 40
    assert all(t.check() and t.reward == 1.0 for t in recorded)
    run_id = json.loads((out / "run.json").read_text())["run_id"]
    trajectory.cleanup_temporaries(out)
    swept = subprocess.run([sys.executable, "-c", code, "rollout", "cleanup", str(out)], capture_output=True,
                           text=True, timeout=120, check=True)
    assert "closed 0 sandboxes" in swept.stdout
    assert labelled(run_id) == {"sandboxes": [], "snapshots": []}
