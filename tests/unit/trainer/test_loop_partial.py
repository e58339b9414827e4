"""Partial rollouts: episodes still running when the loop has its batch are paused between two turns to the snapshot
store (their conversation kept), resumed by the next iteration from the snapshot under the new weights, and finish
with each turn's own weight version; a group is complete (and written) only when all its episodes are."""

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loop_fakes import FORKY, TOK, FakeBackend, Versions, loop_with_fakes, policy_factory  # noqa: E402

from rollout import scripted  # noqa: E402
from rollout.agent import AgentConfig  # noqa: E402
from rollout.groups import GroupSpec  # noqa: E402
from rollout.ownership import LabelledBackend  # noqa: E402
from rollout.trajectory import read  # noqa: E402
from trainer.rollouts import Job, play_group  # noqa: E402


def four_turns(prompt: str, turn: int) -> str:
    return scripted.tool_call("bash", {"command": "submit" if turn >= 3 else f"echo {turn}"})


def _make(api):
    import gymnasium

    return lambda: gymnasium.make(FORKY, api=api)


def test_a_group_paused_between_turns_resumes_from_the_snapshot_under_new_weights():
    backend, versions = FakeBackend(), Versions()
    api = LabelledBackend(backend, {"agentenv.rollout.run": "unit"})
    policy = policy_factory(four_turns, versions)()
    pause = [False]

    def pausing(prompt: str, turn: int) -> str:
        if turn == 1:
            pause[0] = True          # the loop got its batch while the episodes were on their first or second turn
        return four_turns(prompt, turn)

    spec = GroupSpec("g0", Job(FORKY, "t7", agent=AgentConfig(max_turns=6)), "t7", group_size=3, seed=5)

    async def first():
        p = policy_factory(pausing, versions)()
        try:
            return await play_group(_make(api), spec, spec.task, p, TOK, lambda: pause[0], api)
        finally:
            await p.aclose()

    res = asyncio.run(first())
    assert res.trajectories == []                                    # not complete: nothing to write yet
    paused = res.info["paused"]
    assert [p.index for p in paused] == [0, 1, 2] and res.info["finished"] == []
    assert all(len(p.traj.turns) in (1, 2) and p.env_state["steps"] == len(p.traj.turns) for p in paused)
    before = {p.index: len(p.traj.turns) for p in paused}
    snaps = {p.env_state["snapshot"] for p in paused}
    assert snaps == set(backend.snapshots)                          # paused to the snapshot store ...
    assert backend.sandboxes == {}                                   # ... and nothing left running
    assert all(backend.snapshots[s].files["/testbed/state"] == "task t7" for s in snaps)

    versions.now = 1                                                 # the update landed
    job = Job(FORKY, "t7", agent=AgentConfig(max_turns=6), resume=paused)
    again = GroupSpec("g0", job, "t7", group_size=3, seed=5)

    async def second():
        try:
            return await play_group(_make(api), again, job, policy, TOK, lambda: False, api)
        finally:
            await policy.aclose()

    done = asyncio.run(second())
    assert [t.group_index for t in done.trajectories] == [0, 1, 2]
    for t in done.trajectories:
        t.check()
        assert t.reward == 1.0 and t.finish_reason == "submitted"
        n = before[t.group_index]                                    # each turn keeps the version that generated it
        assert t.weight_versions == [0] * n + [1] * (4 - n)
        assert t.metadata["resumes"] == 1 and t.group_id == "g0"
        assert t.token_ids[: t.prompt_len] == done.trajectories[0].token_ids[: t.prompt_len]
    assert backend.snapshots == {} and backend.sandboxes == {}       # snapshots dropped, envs closed


def test_a_lazy_env_pauses_without_a_sandbox(tmp_path):
    """Tool-v0 starts no sandbox for calculator tasks: its pause keeps the task and the step count only."""
    import gymnasium

    import envs  # noqa: F401
    from trainer.rollouts import pause_env, restore_env

    backend = FakeBackend()
    env = gymnasium.make("agentenv/Tool-v0", api=backend)
    env.reset(options={"task": "calc-001"})
    env.step(scripted.tool_call("calculator", {"expression": "1+1"}))
    state = pause_env(env)
    assert state["steps"] == 1 and state["task"].id == "calc-001" and backend.snapshots == {}
    again = restore_env(lambda: gymnasium.make("agentenv/Tool-v0", api=backend), state)
    _, reward, done, _, _ = again.step(scripted.tool_call("answer", {"answer": "39980"}))
    assert (reward, done, again.unwrapped.steps) == (1.0, True, 2)
    again.close()


def test_the_loop_cuts_the_tail_and_resumes_it_next_iteration(tmp_path):
    """partial_rollouts with extra groups: the iteration trains on the groups complete first; the rest are paused,
    resumed first in the next iteration, and trained on then, with their older turns' versions."""
    slow = {"d"}                                            # task d's episodes need many turns

    def script(prompt: str, turn: int) -> str:
        long = any(f"Do task {t}." in prompt for t in slow)
        return scripted.tool_call("bash", {"command": "submit" if turn >= (7 if long else 0) else "echo x"})

    loop, versions, backend = loop_with_fakes(tmp_path, script, [
        "rl.partial_rollouts=true", "rl.extra_groups=1", "rl.groups_per_iteration=3", "rl.group_size=2",
        "rl.iterations=2", "env.max_turns=8", 'env.train_tasks="ids:a,b,c,d"', "ray.groups_per_worker=8",
        "env.kwargs={max_steps=20}"])
    loop.train_src.at = lambda i: __import__("trainer.tasks", fromlist=["TaskRef"]).TaskRef("abcdabcd"[i], i)

    async def run():
        await loop.rollout.start()
        try:
            first = await loop.rollout_batch()
            await loop._train_iteration(first, produced_at=0)
            second = await loop.rollout_batch()
            await loop._train_iteration(second, produced_at=1)
            return first, second
        finally:
            await loop.rollout.aclose()

    first, second = asyncio.run(run())
    assert len(first.groups) == 3 and first.paused == 2 and {g.spec.task_id for g in first.groups} == {"a", "b", "c"}
    assert second.resumed == 2
    resumed = [g for g in second.groups if g.spec.task_id == "d"]
    assert len(resumed) == 1
    for t in resumed[0].trajectories:
        assert t.weight_versions[0] == 0 and t.weight_versions[-1] == 1 and t.metadata["resumes"] == 1
        assert t.reward == 1.0
    rows = loop.metrics.rows()
    assert rows[0]["partial/paused"] == 2 and rows[1]["partial/resumed"] == 2
    assert rows[1]["staleness/dropped"] == 0          # one pause allows one version more
    on_disk = list(read(tmp_path / "trajectories"))
    assert {t.group_id for t in on_disk} == {g.spec.group_id for g in first.groups + second.groups}
    assert backend.snapshots == {}
