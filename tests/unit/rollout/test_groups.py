"""GRPO groups (rollout.groups.run_group, the one group player) on the fake backend: one reset, G forked children,
shared group id and prompt ids, retries from a new fork, infrastructure failures recorded, everything closed (also on
cancel); pause and resume, a resumed play that fails retried from its snapshot; a training Job played with retries."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from envs import ToolEnv
from rollout import scripted
from rollout.agent import AgentConfig
from rollout.groups import GroupSpec, run_group
from rollout.pausing import Partial

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout_fakes import (  # noqa: E402
    TOK,
    FakeBackend,
    FlakyTransport,
    ForkyEnv,
    bash_then_submit,
    policy_factory,
    solve_calc,
)


def play(make_env, spec, script, transport=None, **kw):
    async def go():
        async with policy_factory(script, transport)() as policy:
            return await run_group(make_env, spec, policy, TOK, AgentConfig(max_turns=4), **kw)

    return asyncio.run(go())


def test_a_group_forks_one_reset_and_shares_group_id_and_prompt():
    backend = FakeBackend()
    resets = []

    def make_env():
        env = ForkyEnv(api=backend)
        resets.append(env)
        return env

    r = play(make_env, GroupSpec("g1", task="t7", group_size=4, seed=3), bash_then_submit, env_id="test/Forky-v0")
    assert len(resets) == 1  # one reset; the children are forks of it
    assert len(backend.created) == 1
    ts = r.trajectories
    assert [t.group_index for t in ts] == [0, 1, 2, 3] and {t.group_id for t in ts} == {"g1"}
    assert {t.task_id for t in ts} == {"t7"} and {t.reward for t in ts} == {1.0}
    prompts = {tuple(t.token_ids[: t.prompt_len]) for t in ts}
    assert len(prompts) == 1 and ts[0].prompt_len > 0
    assert all(t.metadata["attempt"] == 1 and t.metadata["first_step_at"] is not None for t in ts)
    assert r.attempts == 1 and r.fork_s >= 0 and r.reset_s > 0
    assert backend.sandboxes == {}  # parent and children closed


def test_a_lazy_env_without_a_sandbox_branches_by_fresh_resets_and_starts_no_sandbox():
    backend = FakeBackend()
    r = play(lambda: ToolEnv(api=backend), GroupSpec("g", task="calc-001", group_size=3), solve_calc)
    assert [t.reward for t in r.trajectories] == [1.0, 1.0, 1.0]
    assert backend.created == [] and backend.sandboxes == {}


def test_a_failed_episode_is_played_again_from_a_new_fork_then_recorded():
    backend = FakeBackend()
    failures = [1]
    r = play(lambda: ForkyEnv(api=backend, failures=failures), GroupSpec("g", group_size=2), bash_then_submit)
    assert [t.reward for t in r.trajectories] == [1.0, 1.0]
    assert sorted(t.metadata["attempt"] for t in r.trajectories) == [1, 2] and r.attempts == 2
    assert len(backend.created) == 1 and backend.sandboxes == {}

    failures[0] = 100
    r = play(lambda: ForkyEnv(api=backend, failures=failures), GroupSpec("g", group_size=2), bash_then_submit,
             max_retries=2)
    assert [(t.finish_reason, t.reward) for t in r.trajectories] == [("env_error", None)] * 2
    assert all(t.metadata["attempt"] == 3 and "went away" in t.error for t in r.trajectories)
    assert backend.sandboxes == {}


def test_a_lone_episode_is_retried_by_a_new_reset():
    backend, failures = FakeBackend(), [1]
    r = play(lambda: ForkyEnv(api=backend, failures=failures), GroupSpec("g", group_size=1), bash_then_submit)
    assert [t.reward for t in r.trajectories] == [1.0] and r.trajectories[0].metadata["attempt"] == 2
    assert len(backend.created) == 2 and backend.sandboxes == {}


def test_a_reset_that_keeps_failing_records_every_episode_as_env_error():
    backend = FakeBackend()
    spec = GroupSpec("g", task="t1", task_id="t1", group_size=3)
    always = [10]
    r = play(lambda: ForkyEnv(api=backend, reset_failures=always), spec, bash_then_submit, max_retries=1)
    assert [(t.finish_reason, t.reward, t.group_index) for t in r.trajectories] == [
        ("env_error", None, 0), ("env_error", None, 1), ("env_error", None, 2)]
    assert "image is gone" in r.error and all(t.task_id == "t1" for t in r.trajectories)
    once = [1]
    ok = play(lambda: ForkyEnv(api=backend, reset_failures=once), spec, bash_then_submit)
    assert [t.reward for t in ok.trajectories] == [1.0] * 3 and backend.sandboxes == {}


def test_a_policy_server_that_went_away_is_not_retried_and_is_reported():
    backend = FakeBackend()
    flaky = FlakyTransport(None, fail_after=0)
    r = play(lambda: ForkyEnv(api=backend), GroupSpec("g", group_size=2), bash_then_submit, transport=flaky)
    assert r.policy_down and [t.finish_reason for t in r.trajectories] == ["policy_error"] * 2
    assert all(t.metadata["attempt"] == 1 and t.reward is None for t in r.trajectories)
    assert backend.sandboxes == {}


def test_a_cancelled_group_closes_its_sandboxes():
    backend = FakeBackend()

    def slow(prompt, turn):
        import time

        time.sleep(0.2)
        return bash_then_submit(prompt, turn)

    async def go():
        async with policy_factory(slow)() as policy:
            task = asyncio.create_task(run_group(lambda: ForkyEnv(api=backend), GroupSpec("g", group_size=3), policy,
                                                 TOK, AgentConfig()))
            while len(backend.sandboxes) < 4 and not task.done():   # wait on state: the fork happened
                await asyncio.sleep(0.01)
            assert len(backend.sandboxes) == 4  # the parent and three children
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(go())
    assert backend.sandboxes == {}


def test_a_paused_group_resumes_and_a_resumed_play_that_fails_is_retried_from_its_snapshot():
    backend, failures, pause = FakeBackend(), [0], [False]

    def script(prompt, turn):
        if turn == 1:
            pause[0] = True            # asked to pause while the episodes are on their first or second turn
        return scripted.tool_call("bash", {"command": "submit" if turn >= 2 else f"echo {turn}"})

    def make():
        return ForkyEnv(api=backend, failures=failures)

    spec = GroupSpec("g", task="t1", group_size=2, seed=1)
    first = play(make, spec, script, partial=Partial(lambda: pause[0], store=backend))
    paused = first.info["paused"]
    assert first.trajectories == [] and [p.index for p in paused] == [0, 1] and first.info["finished"] == []
    assert backend.sandboxes == {} and {p.env_state["snapshot"] for p in paused} == set(backend.snapshots)
    failures[0] = 1                    # the first step after the resume fails: that play starts from its snapshot again
    done = play(make, spec, script, partial=Partial(resume=paused, store=backend))
    assert [(t.group_index, t.reward) for t in done.trajectories] == [(0, 1.0), (1, 1.0)]
    assert sorted(t.metadata["attempt"] for t in done.trajectories) == [1, 2] and done.attempts == 2
    assert all(t.metadata["resumes"] == 1 for t in done.trajectories)
    assert backend.snapshots == {} and backend.sandboxes == {}   # resumed from, done: dropped; every env closed



def test_a_cancelled_resumed_group_closes_its_envs_and_keeps_its_snapshots():
    backend = FakeBackend()
    first = play(lambda: ForkyEnv(api=backend), GroupSpec("g", task="t1", group_size=2), bash_then_submit,
                 partial=Partial(lambda: True, store=backend))          # paused before its first turn
    paused = first.info["paused"]
    assert len(paused) == 2 and len(backend.snapshots) == 2 and backend.sandboxes == {}

    def slow(prompt, turn):
        import time

        time.sleep(0.2)
        return bash_then_submit(prompt, turn)

    async def go():
        async with policy_factory(slow)() as policy:
            task = asyncio.create_task(run_group(lambda: ForkyEnv(api=backend), GroupSpec("g", task="t1", group_size=2),
                                                 policy, TOK, AgentConfig(), partial=Partial(resume=paused,
                                                                                             store=backend)))
            while len(backend.sandboxes) < 2 and not task.done():   # wait on state: both episodes restored
                await asyncio.sleep(0.01)
            assert len(backend.sandboxes) == 2
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(go())
    assert backend.sandboxes == {} and len(backend.snapshots) == 2   # closed; the snapshots left for a later try
