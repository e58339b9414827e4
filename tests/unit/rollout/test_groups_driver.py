"""The rollout driver in process (workers=0, no Ray) on the fake backend: streaming as groups finish, shards and
summary in the run folder, backpressure on a lazy task stream, labels on every sandbox, the policy going away."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from agentenv.host import ksm
from rollout import trajectory
from rollout.agent import AgentConfig
from rollout.driver import Rollout
from rollout.ownership import RUN_LABEL, WORKER_LABEL, LabelledBackend, node_env_url, sweep
from rollout.workers import PolicyUnavailable, RolloutConfig, load_task_refs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout_fakes import FORKY, FakeBackend, FlakyTransport, bash_then_submit, policy_factory  # noqa: E402


def config(backend, script=bash_then_submit, transport=None, **kw) -> RolloutConfig:
    return RolloutConfig(FORKY, "http://scripted", backend_factory=lambda: backend,
                         policy_factory=policy_factory(script, transport), agent=AgentConfig(max_turns=4), **kw)


def test_groups_stream_into_shards_with_a_summary(tmp_path):
    backend = FakeBackend()
    out = tmp_path / "run"
    seen = []
    with Rollout(config(backend, group_size=3), workers=0, out=out, flush_interval=0) as r:
        for result in r.groups(["a", "b", "c", "d"]):
            seen.append(result.spec.task_id)
            # already on disk when yielded (with any other group that finished at the same time)
            assert sum(1 for _ in trajectory.read(out)) >= 3 * len(seen)
    assert sorted(seen) == ["a", "b", "c", "d"]
    trajs = list(trajectory.read(out))
    assert len(trajs) == 12 and {t.reward for t in trajs} == {1.0}
    by_group: dict[str, list] = {}
    for t in trajs:
        by_group.setdefault(t.group_id, []).append(t)
    assert len(by_group) == 4 and all(sorted(t.group_index for t in g) == [0, 1, 2] for g in by_group.values())
    assert all(t.metadata["worker"] == f"{r.run_id}-w0" for t in trajs)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["episodes"] == 12 and summary["reward_mean"] == 1.0 and summary["groups"] == 4
    assert summary["finish_reasons"] == {"submitted": 12} and 0 <= summary["env_share"] <= 1
    # what ksmd cost this host while the run ran (the groups' shared memory): None only where there is no ksmd
    assert (summary["ksmd_cpu_s"] is None) is (ksm.ksmd_pid() is None)
    assert summary["ksmd_cpu_s"] is None or summary["ksmd_cpu_s"] >= 0
    assert r.summary()["ksmd_cpu_s"] == summary["ksmd_cpu_s"]  # held at the run's end
    assert json.loads((out / "run.json").read_text())["run_id"] == r.run_id
    assert backend.sandboxes == {} and backend.snapshots == {}


def test_backpressure_reads_the_task_stream_lazily(tmp_path):
    backend = FakeBackend()
    taken = []

    def tasks():
        for i in range(20):
            taken.append(i)
            yield f"t{i}"

    r = Rollout(config(backend, groups_per_worker=2), workers=0)
    it = r.groups(tasks())
    next(it)
    assert len(taken) <= 3  # two in flight, and at most one more read when the first finished
    rest = list(it)
    assert len(rest) == 19 and len(taken) == 20 and r.stats.episodes == 20


def test_the_policy_going_away_stops_the_run_with_a_clear_error(tmp_path):
    backend = FakeBackend()
    flaky = FlakyTransport(None, fail_after=6)  # three groups of one (two calls each), then refused
    out = tmp_path / "run"
    r = Rollout(config(backend, transport=flaky, groups_per_worker=1), workers=0, out=out, probe_timeout=2)
    with pytest.raises(PolicyUnavailable, match="http://scripted") as e:
        list(r.groups([f"t{i}" for i in range(10)]))
    assert "not played" in str(e.value)
    trajs = list(trajectory.read(out))
    assert [t.finish_reason for t in trajs] == ["submitted"] * 3 + ["policy_error"]
    assert backend.sandboxes == {}


def test_an_unreachable_policy_fails_before_anything_starts(tmp_path):
    flaky = FlakyTransport(None)
    flaky.down = True
    r = Rollout(config(FakeBackend(), transport=flaky), workers=0, out=tmp_path / "run", probe_timeout=2)
    with pytest.raises(PolicyUnavailable, match="does not answer"):
        list(r.groups(["t"]))


def test_every_sandbox_and_snapshot_carries_the_run_and_worker_labels_and_sweep_finds_them():
    backend = FakeBackend()
    api = LabelledBackend(backend, {RUN_LABEL: "r1", WORKER_LABEL: "w1"}, ttl=60)
    sb = api.Sandbox.create("img", labels={"mine": "1"})
    kids = sb.fork(2)
    snap = kids[0].snapshot(labels={"x": "y"})
    again = api.Sandbox.restore(snap)
    other = backend.Sandbox.create("img", labels={RUN_LABEL: "r2"})
    assert all(s.labels[RUN_LABEL] == "r1" and s.labels[WORKER_LABEL] == "w1" for s in [sb, *kids, again])
    assert sb.labels["mine"] == "1" and snap.labels == {"x": "y", RUN_LABEL: "r1", WORKER_LABEL: "w1"}
    assert backend.created[0][1]["ttl"] == 60
    assert [s.ttl for s in [*kids, again]] == [60, 60, 60]  # the run's deadline on forks and restores too
    swept = sweep(backend, {RUN_LABEL: "r1"})
    assert len(swept["sandboxes"]) == 4 and swept["snapshots"] == [snap.id]
    assert list(backend.sandboxes) == [other.id]


def test_the_runs_deadline_wins_over_the_envs_when_the_env_asks_and_moves_it_on():
    """The run sets its sandboxes' deadlines (issue 43): an env asking for its own ttl, at a create, a fork, a
    restore or when a step moves it on, gets the run's; with none set by the run, the env's holds."""
    backend = FakeBackend()
    api = LabelledBackend(backend, {RUN_LABEL: "r1"}, ttl=4 * 3600.0)
    sb = api.Sandbox.create("img", ttl=300.0)
    kid, = sb.fork(1, ttl=300.0)
    again = api.Sandbox.restore(sb.snapshot(), ttl=300.0)
    kid.set_ttl(300.0)
    assert [s.ttl for s in (sb, kid, again)] == [4 * 3600.0] * 3 and kid.ttl_moves == [4 * 3600.0]
    own = LabelledBackend(backend, {RUN_LABEL: "r2"}, ttl=None).Sandbox.create("img", ttl=300.0)
    own.set_ttl(300.0)
    assert own.ttl == 300.0 and own.ttl_moves == [300.0]
    sweep(backend, {RUN_LABEL: "r1"})
    sweep(backend, {RUN_LABEL: "r2"})


def test_task_files_load_as_records(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"id": "a", "question": "q", "answer": "1"}\n\n{"id": "b", "question": "q", "answer": "2"}\n')
    assert [t["id"] for t in load_task_refs(p)] == ["a", "b"]
    q = tmp_path / "t.json"
    q.write_text('[{"instance_id": "x"}]')
    assert load_task_refs(q) == [{"instance_id": "x"}]


def test_a_worker_finds_its_nodes_env_server(monkeypatch):
    monkeypatch.delenv("AGENTENV_URL", raising=False)
    urls = {"node-a": "http://a:8700", "10.0.0.2": "http://b:8700"}
    assert node_env_url(urls, "node-a", "10.0.0.1") == "http://a:8700"   # by Ray node id
    assert node_env_url(urls, "node-b", "10.0.0.2") == "http://b:8700"   # by node IP
    assert node_env_url(urls, "node-c", "10.0.0.3") is None              # none: local sandboxes
    assert node_env_url({**urls, "*": "local"}, "node-c", "10.0.0.3") == "local"
    monkeypatch.setenv("AGENTENV_URL", "http://mine:8700")                # set on the node (ray start's env)
    assert node_env_url(None, "node-c", "10.0.0.3") == "http://mine:8700"
    assert node_env_url(urls, "node-a", None) == "http://a:8700"
