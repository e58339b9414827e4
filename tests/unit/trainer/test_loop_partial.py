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
from rollout.groups import GroupSpec, run_group  # noqa: E402
from rollout.ownership import LabelledBackend  # noqa: E402
from rollout.trajectory import read  # noqa: E402
from trainer.loop.rollouts import Job  # noqa: E402


def four_turns(prompt: str, turn: int) -> str:
    return scripted.tool_call("bash", {"command": "submit" if turn >= 3 else f"echo {turn}"})


def _make(api):
    import gymnasium

    return lambda: gymnasium.make(FORKY, api=api)


def play_group(make_env, spec, job, policy, tokenizer, should_pause, api):
    """The group player on a ``Job``, as a ``LoopWorker`` plays it."""
    from dataclasses import replace

    return run_group(make_env, replace(spec, task=job.task), policy, tokenizer, job.agent, env_id=job.env_id,
                     memory=job.memory_fork, partial=job.partial(should_pause, None, api))


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


def test_a_job_is_played_by_the_group_player_with_its_retries():
    """``agentenv train``'s worker plays a Job with the player of ``agentenv rollout``: an env failure is played
    again from a new fork (it was recorded as ``env_error`` before the two shared one player)."""
    from rollout.workers import RolloutConfig
    from trainer.loop.rollouts import LoopWorker

    backend, versions = FakeBackend(), Versions()
    cfg = RolloutConfig(FORKY, "http://scripted", backend_factory=lambda: backend,
                        policy_factory=policy_factory(four_turns, versions), tokenizer_factory=lambda: TOK)
    job = Job(FORKY, "t3", env_kwargs={"failures": [1]}, agent=AgentConfig(max_turns=6))
    spec = GroupSpec("g", job, "t3", group_size=2)

    async def go():
        worker = LoopWorker(cfg, "w0", "unit")
        try:
            return await worker.run_group(spec)
        finally:
            await worker.shutdown(wait=0)

    r = asyncio.run(go())
    assert r.spec is spec and [t.reward for t in r.trajectories] == [1.0, 1.0]
    assert sorted(t.metadata["attempt"] for t in r.trajectories) == [1, 2]
    assert all(t.metadata["phase"] == "train" and t.metadata["worker"] == "w0" for t in r.trajectories)
    assert backend.sandboxes == {}


def test_a_lazy_env_pauses_without_a_sandbox(tmp_path):
    """Tool-v0 starts no sandbox for calculator tasks: its pause keeps the task and the step count only."""
    import gymnasium

    import envs  # noqa: F401
    from rollout.pausing import pause_env, restore_env

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


class Gates:
    """Holds chosen policy calls back until the state they wait for is reached (no sleeps, no timing).

    Batch 1: the calls of task d wait until the loop asked the workers to pause, and the other tasks' calls wait
    until both of d's episodes are waiting; so a, b, c complete first and d is paused after exactly one turn.
    Batch 2: d's resumed calls wait until every new episode is waiting in its first call, and those wait until the
    loop received d's complete group; so d completes in batch 2 and no new episode is paused before its first turn.
    """

    def __init__(self, batch: int = 1, new_episodes: int = 6) -> None:
        self.batch, self.new_episodes = batch, new_episodes
        self.d_waiting = self.new_waiting = 0
        self.d_ready, self.new_ready = asyncio.Event(), asyncio.Event()
        self.paused, self.d_done = asyncio.Event(), asyncio.Event()

    async def __call__(self, prompt: str) -> None:
        d = "Do task d." in prompt
        if self.batch == 1:
            if d:
                self.d_waiting += 1
                if self.d_waiting == 2:
                    self.d_ready.set()
                await self.paused.wait()
            else:
                await self.d_ready.wait()
        elif self.batch == 2:
            if d:
                await self.new_ready.wait()
            else:
                self.new_waiting += 1
                if self.new_waiting == self.new_episodes:
                    self.new_ready.set()
                await self.d_done.wait()

    def watch(self, loop) -> None:
        """Set ``paused`` when the loop pauses the workers, ``d_done`` when d's complete group comes back."""
        pause, stream = loop.rollout.pause, loop.rollout.stream

        async def pausing():
            await pause()
            self.paused.set()

        async def streaming(specs):
            async for r in stream(specs):
                if r.spec.task_id == "d" and not r.info.get("paused"):
                    self.d_done.set()
                yield r

        loop.rollout.pause, loop.rollout.stream = pausing, streaming


def d_is_long(prompt: str, turn: int) -> str:
    """Tasks a, b, c submit on their first turn; task d on its second."""
    long = "Do task d." in prompt
    return scripted.tool_call("bash", {"command": "submit" if turn >= (1 if long else 0) else "echo x"})


PARTIAL = ["rl.partial_rollouts=true", "rl.extra_groups=1", "rl.groups_per_iteration=3", "rl.group_size=2",
           "rl.iterations=2", "env.max_turns=8", 'env.train_tasks="ids:a,b,c,d"', "ray.groups_per_worker=8",
           "env.kwargs={max_steps=20}"]


def _gated_loop(tmp_path, overrides, gates, **kw):
    from trainer.loop.tasks import TaskRef

    loop, versions, backend = loop_with_fakes(tmp_path, d_is_long, PARTIAL + overrides, gate=gates, **kw)
    loop.train_src.at = lambda i: TaskRef("abcdabcd"[i], i)
    gates.watch(loop)
    return loop, versions, backend


def test_the_loop_cuts_the_tail_and_resumes_it_next_iteration(tmp_path):
    """partial_rollouts with extra groups: the iteration trains on the groups complete first; the rest are paused,
    resumed first in the next iteration, and trained on then, with their older turns' versions."""
    gates = Gates()
    loop, versions, backend = _gated_loop(tmp_path, [], gates)

    async def run():
        await loop.rollout.start()
        try:
            first = await loop.rollout_batch()
            await loop.train_iteration(first, produced_at=0)
            gates.batch = 2
            second = await loop.rollout_batch()
            await loop.train_iteration(second, produced_at=1)
            return first, second
        finally:
            await loop.rollout.aclose()

    first, second = asyncio.run(run())
    assert len(first.groups) == 3 and first.paused == 2 and {g.spec.task_id for g in first.groups} == {"a", "b", "c"}
    assert second.resumed == 2 and second.paused == 0 and len(second.groups) == 4
    resumed = [g for g in second.groups if g.spec.task_id == "d"]
    assert len(resumed) == 1
    for t in resumed[0].trajectories:
        assert t.weight_versions == [0, 1] and t.metadata["resumes"] == 1
        assert t.metadata["paused_versions"] == 1              # one push happened while it was paused
        assert t.reward == 1.0
    rows = loop.metrics.rows()
    assert rows[0]["partial/paused"] == 2 and rows[1]["partial/resumed"] == 2
    assert rows[1]["staleness/dropped"] == 0          # the version pushed during the pause is allowed
    on_disk = list(read(tmp_path / "trajectories"))
    assert {t.group_id for t in on_disk} == {g.spec.group_id for g in first.groups + second.groups}
    assert backend.snapshots == {}                    # the resumed snapshots went once a checkpoint no longer named them


def test_a_group_resumed_before_any_push_gets_no_extra_staleness(tmp_path):
    """max_staleness 1: the producer resumes a paused group in its next batch before new weights exist; the pause
    cost it no version, so its bound stays k (one allowance per pause would have been k + 1)."""
    from trainer.algorithm.batch import allowed_staleness, filter_stale

    gates = Gates()
    loop, versions, _ = _gated_loop(tmp_path, ["rl.max_staleness=1"], gates)

    async def run():
        await loop.rollout.start()
        try:
            await loop.rollout_batch()
            gates.batch = 2
            return await loop.rollout_batch()       # the producer's next batch: no push in between
        finally:
            await loop.rollout.aclose()

    second = asyncio.run(run())
    d = [t for g in second.groups if g.spec.task_id == "d" for t in g.trajectories]
    assert len(d) == 2 and all(t.weight_versions == [0, 0] and t.metadata["resumes"] == 1 for t in d)
    assert [t.metadata["paused_versions"] for t in d] == [0, 0]
    assert [allowed_staleness(t, 1) for t in d] == [1, 1]
    assert filter_stale(d, 1, 1) == (d, [])
    assert filter_stale(d, 2, 1) == ([], d)           # two versions old is over the bound of 1


def test_resume_restores_the_paused_groups_and_the_trained_batchs_task_cursor(tmp_path):
    """max_staleness 1: batch 2 is played (resuming d, handing out tasks 4-6) before step 1 trains; the run dies
    after step 1's checkpoint. --resume hands tasks 4-6 out again (batch 2 was never trained on) and resumes d from
    the snapshot it was paused to in batch 1, which survived the sweeps because the checkpoint names it."""
    from trainer import checkpoint as ckpt
    from trainer.loop.partial import PAUSED_FILE, snapshot_ids

    gates = Gates()
    loop, versions, backend = _gated_loop(tmp_path, ["rl.max_staleness=1", "rl.iterations=4"], gates)

    async def first_run():
        await loop.rollout.start()
        try:
            first = await loop.rollout_batch()
            gates.batch = 2
            await loop.rollout_batch()                 # the producer is one batch ahead
            assert loop.task_cursor == 7
            await loop.train_iteration(first, produced_at=0)
        finally:
            await loop.rollout.aclose()                 # the run ends here (killed after the checkpoint)

    asyncio.run(first_run())
    folder = ckpt.latest(tmp_path / "t" / "checkpoints")
    assert folder is not None and (folder / PAUSED_FILE).is_file()
    data = ckpt.read_meta(folder)["data"]
    assert data["task_cursor"] == 4 and data["iteration"] == 1
    named = loop.partial.referenced
    assert len(named) == 2 and named <= set(backend.snapshots)     # swept at exit: all but these

    gates2 = Gates(batch=2)
    again, _, _ = _gated_loop(tmp_path, ["rl.max_staleness=1", "rl.iterations=4"], gates2, backend=backend,
                              resume=True)
    again.restore_data(data, folder)
    assert again.task_cursor == 4 and again.iteration == 1 and again.group_seq == data["group_seq"]
    assert [g.result.spec.task_id for g in again.partial.groups] == ["d"]
    assert snapshot_ids(again.partial.groups) == named and again.rollout.keep_snapshots == named

    async def second_run():
        await again.rollout.start()
        try:
            got = await again.rollout_batch()
            await again.train_iteration(got, produced_at=0)
            return got
        finally:
            await again.rollout.aclose()

    got = asyncio.run(second_run())
    assert sorted(g.spec.task_id for g in got.groups) == ["a", "b", "c", "d"]    # tasks 4, 5, 6 and the resumed d
    d = [t for g in got.groups if g.spec.task_id == "d" for t in g.trajectories]
    assert [(t.finish_reason, t.error) for t in d] == [("submitted", "")] * 2
    assert [t.weight_versions for t in d] == [[0, 0], [0, 0]] and all(t.reward == 1.0 for t in d)
    assert again.task_cursor == 7
    assert backend.snapshots == {}                  # resumed, trained, checkpointed: nothing names them now
