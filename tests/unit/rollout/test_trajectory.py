"""Trajectory records and their shards: invariants, round trips, atomic publication, crash safety."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout import trajectory as tj
from rollout.trajectory import Trajectory, TrajectoryError, Turn


def episode(reward: float | None = 1.0, finish: str = "submitted", turns: int = 2) -> Trajectory:
    t = Trajectory(task_id="toolz-1", env_id="agentenv/SWE-v0", group_id="g1", group_index=0, seed=3)
    t.append([1, 2, 3, 4], generated=False)
    t.prompt_len = 4
    for i in range(turns):
        start = len(t.token_ids)
        t.append([10 + i, 11 + i], generated=True, logprobs=[-0.5, -0.25])
        t.append([7, 8, 9], generated=False)
        t.turns.append(Turn(start=start, generated=2, weight_version=i, tool_calls=1, policy_s=0.1, env_s=0.01))
    t.reward, t.finish_reason = reward, finish
    return t


def test_a_well_formed_episode_checks_and_counts():
    t = episode().check()
    assert t.generated_tokens == 4 and t.weight_versions == [0, 1]
    assert [lp for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if m] == [-0.5, -0.25] * 2


@pytest.mark.parametrize(("mutate", "words"), [
    (lambda t: t.loss_mask.pop(), "one entry per token"),
    (lambda t: t.loss_mask.__setitem__(0, 2), "only 0 and 1"),
    (lambda t: t.logprobs.__setitem__(0, -1.0), "0.0 where the mask is 0"),
    (lambda t: setattr(t, "finish_reason", "crashed"), "is not one of"),
    (lambda t: setattr(t, "turns", t.turns[:1]), "the turns generated"),
    (lambda t: setattr(t, "routing", [[[1, 2]]] * (len(t.token_ids) + 1)), "one per position at most"),
])
def test_broken_records_are_refused_with_the_reason(mutate, words):
    t = episode()
    mutate(t)
    with pytest.raises(TrajectoryError, match=words):
        t.check()


def test_an_infrastructure_failure_carries_no_reward():
    assert episode(reward=None, finish="env_error").check().infra_error
    with pytest.raises(TrajectoryError, match="carries no reward"):
        episode(reward=0.0, finish="policy_error").check()


def test_generated_ids_need_their_logprobs():
    with pytest.raises(TrajectoryError, match="logprobs"):
        Trajectory("t", "e").append([1, 2], generated=True, logprobs=[-1.0])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 200_000), min_size=1, max_size=20),
                          st.lists(st.integers(0, 200_000), max_size=20)), max_size=6),
       st.one_of(st.none(), st.floats(-1, 1)), st.text(max_size=40))
def test_records_round_trip_through_shards(tmp_path_factory, turns, reward, note):
    t = Trajectory(task_id="t", env_id="e", metadata={"note": note})
    for gen, obs in turns:
        start = len(t.token_ids)
        t.append(gen, generated=True, logprobs=[-0.1] * len(gen))
        t.append(obs, generated=False)
        t.turns.append(Turn(start=start, generated=len(gen), weight_version=3))
    t.reward = reward
    folder = tmp_path_factory.mktemp("run")
    assert tj.write(folder, [t, t], records_per_shard=1) == 2
    back = list(tj.read(folder))
    assert back == [t, t]


def test_shards_are_published_whole_and_listed(tmp_path):
    with tj.ShardWriter(tmp_path, records_per_shard=2) as w:
        for i in range(5):
            w.write(episode(turns=1 + i % 2))
        assert [p.name for p in tj.shard_paths(tmp_path)] == ["shard-00000.msgpack", "shard-00001.msgpack"]
    index = json.loads((tmp_path / "index.json").read_text())
    assert [s["records"] for s in index["shards"]] == [2, 2, 1]
    assert len(list(tj.read(tmp_path))) == 5
    with tj.ShardWriter(tmp_path) as w:  # a second writer on the same run continues the numbering
        w.write(episode())
    assert [p.name for p in tj.shard_paths(tmp_path)][-1] == "shard-00003.msgpack"


def test_jsonl_export(tmp_path):
    tj.write(tmp_path / "run", [episode(), episode(reward=None, finish="env_error")])
    assert tj.to_jsonl(tmp_path / "run", tmp_path / "out.jsonl") == 2
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    assert [json.loads(x)["finish_reason"] for x in lines] == ["submitted", "env_error"]


def test_a_writer_killed_mid_run_leaves_only_whole_shards(tmp_path):
    """kill -9 of the writing process: every listed shard reads back whole; the temporary file is not listed."""
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {os.getcwd()!r})
        from tests.unit.rollout.test_trajectory import episode
        from rollout import trajectory as tj
        w = tj.ShardWriter({str(tmp_path)!r}, records_per_shard=3)
        i = 0
        while True:
            w.write(episode())
            i += 1
            if i == 7:
                print("ready", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    records = list(tj.read(tmp_path))
    assert len(records) % 3 == 0 and len(records) >= 6
    assert all(r.check().task_id == "toolz-1" for r in records)
    assert not any(p.name.endswith(".tmp") for p in tj.shard_paths(tmp_path))
