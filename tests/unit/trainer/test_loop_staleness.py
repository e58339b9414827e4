"""Bounded staleness: trajectories more than k weight versions old are dropped and counted (one more version allowed
per pause of a partial rollout); with k = 0 rollouts and training strictly alternate; with k >= 1 the rollouts for the
next step run while a step trains, never more than k steps ahead."""

import asyncio
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loop_fakes import FakeBackend, loop_with_fakes, run_iterations  # noqa: E402

from rollout import scripted  # noqa: E402
from rollout.trajectory import Trajectory, Turn, read  # noqa: E402
from trainer.algorithm.batch import filter_stale, staleness  # noqa: E402
from trainer.loop.tasks import TaskSource  # noqa: E402


def _traj(versions, resumes=0):
    t = Trajectory(task_id="t", env_id="e", reward=1.0)
    for v in versions:
        t.turns.append(Turn(start=0, generated=0, weight_version=v))
    t.metadata["resumes"] = resumes
    return t


def test_filter_drops_what_is_older_than_the_bound():
    fresh, one, two, partial = _traj([5, 5]), _traj([4, 4]), _traj([3, 5]), _traj([3, 4, 5], resumes=1)
    assert [staleness(t, 5) for t in (fresh, one, two, partial)] == [0, 1, 2, 2]
    assert filter_stale([fresh, one, two, partial], 5, 0) == ([fresh], [one, two, partial])
    assert filter_stale([fresh, one, two, partial], 5, 1) == ([fresh, one, partial], [two])
    assert filter_stale([fresh, one, two, partial], 5, 2) == ([fresh, one, two, partial], [])
    assert filter_stale([_traj([])], 9, 0)[1] == []                      # no turn: nothing stale


def test_task_sources():
    src = TaskSource("ids:a,b,c", seed=1)
    order = [src.at(i).task for i in range(6)]
    assert sorted(order[:3]) == ["a", "b", "c"] and sorted(order[3:]) == ["a", "b", "c"]
    assert order == [TaskSource("ids:a,b,c", seed=1).at(i).task for i in range(6)]    # seeded
    assert [r.task for r in src.first(2)] == ["a", "b"]
    seeds = TaskSource("seeds:10-19", seed=0)
    assert [r.seed for r in seeds.first(3)] == [10, 11, 12] and seeds.values(2) == [10, 11]
    lookup = TaskSource("py:envs.lookup_env:task_ids split=heldout n=4 levels=[1]")
    assert len(lookup) == 4 and lookup.first(1)[0].task == "lookup-1-1000000"


def bash_submit(prompt: str, turn: int) -> str:
    return scripted.tool_call("bash", {"command": "submit" if turn >= 1 else "echo x"})


def test_synchronous_by_default_every_batch_is_on_policy(tmp_path):
    loop, versions, _ = loop_with_fakes(tmp_path, bash_submit, ["rl.iterations=3", "rl.groups_per_iteration=2",
                                                                 "rl.group_size=2"], delay=0.2)
    rows = run_iterations(loop)
    assert [r["version"] for r in rows] == [1.0, 2.0, 3.0] and versions.now == 3
    assert all(r["staleness/max"] == 0 and r["staleness/dropped"] == 0 for r in rows)
    assert [r["version/rollout"] for r in rows] == [0.0, 1.0, 2.0]
    assert len(list(read(tmp_path / "trajectories"))) == 3 * 2 * 2


def test_one_step_off_plays_the_next_batch_while_a_step_trains(tmp_path):
    loop, versions, _ = loop_with_fakes(tmp_path, bash_submit, ["rl.iterations=4", "rl.groups_per_iteration=2",
                                                                 "rl.group_size=2", "rl.max_staleness=1"])
    # step t ends only once batch t + 1 is played (waiting on that state, not on a delay): if the producer did not
    # run ahead, the step would wait in vain and the test fail
    produced = [threading.Event() for _ in range(6)]
    played, step = loop.rollout_batch, loop.trainer.step

    async def rollout_batch():
        got = await played()
        produced[next(i for i, e in enumerate(produced) if not e.is_set())].set()
        return got

    def gated_step(batch):
        t = loop.trainer.step_count
        if t + 1 < 4:
            assert produced[t + 1].wait(120), f"batch {t + 1} was not played while step {t} trained"
        return step(batch)

    loop.rollout_batch, loop.trainer.step = rollout_batch, gated_step
    rows = run_iterations(loop)
    assert versions.now == 4 and [r["iteration"] for r in rows] == [1.0, 2.0, 3.0, 4.0]
    # batch t+1 was played while step t trained: its episodes are one version old when trained on, and kept
    assert max(r["staleness/max"] for r in rows) == 1
    assert all(r["staleness/dropped"] == 0 for r in rows)
    # never more than k steps ahead: the batch trained at step t was played with weights of step t-1 or later
    assert all(r["version/rollout"] >= r["iteration"] - 2 for r in rows)
    assert sum(len(b.samples) for b in loop.trainer.batches) == 4 * 2 * 2


def test_stale_trajectories_are_dropped_and_counted(tmp_path):
    """A batch that waited two updates (e.g. the trainer fell behind) is dropped under k = 1, and counted."""
    loop, versions, _ = loop_with_fakes(tmp_path, bash_submit, ["rl.groups_per_iteration=1", "rl.group_size=2",
                                                                 "rl.max_staleness=1", "rl.iterations=5"])

    async def go():
        await loop.rollout.start()
        try:
            old = await loop.rollout_batch()          # played under v0
            versions.now = loop.version = 2           # two updates landed meanwhile
            return await loop.train_iteration(old, produced_at=0)
        finally:
            await loop.rollout.aclose()

    row = asyncio.run(go())
    assert row["staleness/dropped"] == 2 and loop.counts["stale_dropped"] == 2
    assert loop.trainer.batches == [] and loop.counts["empty_batches"] == 1   # nothing left to train on


def test_a_batch_whose_every_episode_failed_on_infrastructure_stops_the_run(tmp_path):
    """Docker down: every reset fails. Training on nothing for 16 iterations, as a run once did, says nothing is
    wrong; the loop stops at the first such batch and says what failed."""
    import pytest

    from agentenv.errors import AgentEnvError
    from trainer.loop.partial import InfraError

    class DockerDown(FakeBackend):
        def __init__(self) -> None:
            super().__init__()
            outer = self

            class Down:
                def create(self, *a, **k):
                    raise AgentEnvError("the Docker engine does not answer")

                def __getattr__(self, name):
                    return getattr(outer._sandboxes, name)
            self._sandboxes, self.Sandbox = self.Sandbox, Down()

    loop, versions, _ = loop_with_fakes(tmp_path, bash_submit, ["rl.iterations=3", "rl.group_size=2"],
                                        backend=DockerDown())
    with pytest.raises(InfraError, match="Docker engine does not answer"):
        run_iterations(loop)
    assert loop.trainer.batches == [] and versions.now == 0
