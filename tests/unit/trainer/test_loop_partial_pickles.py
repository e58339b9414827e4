"""A checkpoint's paused groups (``paused-groups.pkl``) pickle classes by module path; a run checkpointed before
issue 42 split ``trainer/`` into sub-packages names ``trainer.rollouts.Job``, ``trainer.partial.PausedGroup``,
``trainer.rollouts.Paused`` and ``trainer.tasks.TaskRef``. Its ``--resume`` must still read them."""

from __future__ import annotations

import pickle

from rollout.groups import GroupResult, GroupSpec
from rollout.pausing import Paused
from rollout.trajectory import Trajectory
from trainer.loop.partial import PartialRollouts, PausedGroup, load_groups
from trainer.loop.rollouts import Job
from trainer.loop.tasks import TaskRef

OLD_NAMES = [(b"trainer.loop.partial", b"trainer.partial"), (b"trainer.loop.rollouts", b"trainer.rollouts"),
             (b"trainer.loop.tasks", b"trainer.tasks"), (b"rollout.pausing", b"trainer.rollouts")]


def _groups() -> list[PausedGroup]:
    traj = Trajectory(env_id="agentenv/Lookup-v0", task_id="t1")
    paused = Paused(index=0, traj=traj, messages=[{"role": "user", "content": "hi"}], tools=[],
                    env_state={"snapshot": "snap-1"}, resumes=1)
    job = Job(env_id="agentenv/Lookup-v0", task=TaskRef(task={"id": "t1"}, seed=3), resume=[paused])
    result = GroupResult(GroupSpec("g1", job, "t1", 2, 3, 0), [traj], info={"paused": [paused], "finished": []})
    return [PausedGroup(result, version=4)]


def _as_before_the_move(data: bytes) -> bytes:
    """The same pickle as the code before the move wrote it: protocol 0 names each class by its module path."""
    for new, old in OLD_NAMES:
        data = data.replace(new + b"\n", old + b"\n")
    return data


def test_paused_groups_pickled_under_the_old_module_paths_load(tmp_path):
    old = _as_before_the_move(pickle.dumps(_groups(), protocol=0))
    assert b"trainer.partial\n" in old and b"trainer.rollouts\n" in old and b"trainer.tasks\n" in old
    (groups,) = load_groups(old)
    assert isinstance(groups, PausedGroup) and groups.version == 4
    job = groups.result.spec.task
    assert isinstance(job, Job) and isinstance(job.task, TaskRef) and job.task.seed == 3
    assert isinstance(job.resume[0], Paused) and job.resume[0].env_state == {"snapshot": "snap-1"}

    (tmp_path / "paused-groups.pkl").write_bytes(old)
    partial = PartialRollouts(max_resumes=3)
    assert partial.restore(tmp_path) == 1 and partial.referenced == {"snap-1"}


def test_paused_groups_round_trip_through_dump():
    partial = PartialRollouts(max_resumes=3)
    partial.groups = _groups()
    (back,) = load_groups(partial.dump())
    assert back.result.spec.group_id == "g1" and back.result.info["paused"][0].resumes == 1
