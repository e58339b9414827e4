"""Lookup-v0 on real sandboxes: check_env, the expert's demonstrations at every level, a GRPO group forked from one
reset; and the Tool-v0 and SWE-v0 experts writing demonstrations through their real envs."""

from __future__ import annotations

import asyncio
import json

import gymnasium
import httpx
import pytest
from gymnasium.utils.env_checker import check_env

import envs  # noqa: F401  (registers the gym ids)
from envs.images import build_image
from envs.lookup_env import make_task, task_ids
from envs.task import shipped_tasks
from envs.tasks.libraries import load_libraries
from envs.tool_env import TASKS_FILE
from policy.client import PolicyClient
from rollout import experts, scripted
from rollout.agent import AgentConfig, LocalTokenizer
from rollout.groups import GroupSpec, run_group
from rollout.trajectory import read

pytestmark = pytest.mark.integration
TOK = LocalTokenizer()


def test_check_env_passes_on_real_sandboxes():
    env = gymnasium.make("agentenv/Lookup-v0")
    try:
        check_env(env.unwrapped, skip_render_check=True)
    finally:
        env.close()


@pytest.mark.parametrize("answer_tool", [True, False])
def test_the_expert_solves_every_level_by_running_commands_in_the_sandbox(tmp_path, answer_tool):
    ids = task_ids("heldout", 8)
    report = experts.write_demonstrations("agentenv/Lookup-v0", ids, tmp_path / "demos", concurrency=2, strict=True,
                                          env_kwargs={"answer_tool": answer_tool})
    assert report.written == 8 and set(report.tokens) == {"all", "lookup-0", "lookup-1", "lookup-2", "lookup-3"}
    for t in read(tmp_path / "demos"):
        task = make_task(*map(int, t.task_id.split("-")[1:]))
        text = TOK.decode(t.token_ids)
        assert t.reward == 1.0 and "## Return of functions.bash:0\n" in text
        if task.level == 2:  # grep over several files prints the file's name before the line
            holder = next(n for n, c in task.files if f"{task.key}=" in c)
            assert f"{holder}:{task.key}={task.answer}\n" in text
        assert text.count(task.answer) >= 2  # shown by the sandbox, then answered


def test_a_group_forks_from_one_reset_and_every_branch_solves_it():
    task = make_task(3, 77)

    async def go():
        app = scripted.create_app(experts.lookup_expert(), TOK)
        async with PolicyClient("http://expert", transport=httpx.ASGITransport(app=app), max_retries=0) as policy:
            spec = GroupSpec(group_id="g", task=task.id, task_id=task.id, group_size=3)
            return await run_group(lambda: gymnasium.make("agentenv/Lookup-v0"), spec, policy, TOK,
                                   AgentConfig(max_turns=5, max_new_tokens=64), env_id="agentenv/Lookup-v0")

    result = asyncio.run(go())
    assert result.rewards == [1.0, 1.0, 1.0]
    prompts = {tuple(t.token_ids[:t.prompt_len]) for t in result.trajectories}
    assert len(prompts) == 1 and all(t.fork_s >= 0 for t in result.trajectories)


def test_the_tool_expert_writes_demonstrations_through_real_sandboxes(tmp_path):
    records = [json.loads(line) for line in TASKS_FILE.read_text().splitlines() if line.strip()]
    chosen = [r for r in records if r["id"] in ("calc-001", "py-001", "py-006", "doc-001", "doc-004", "mix-001")]
    report = experts.write_demonstrations("agentenv/Tool-v0", chosen, tmp_path / "tool", concurrency=3, strict=True)
    assert report.written == 6
    py = next(t for t in read(tmp_path / "tool") if t.task_id == "py-001")
    assert "1229" in TOK.decode(py.token_ids[py.prompt_len:])


def test_the_swe_expert_resolves_a_task_with_its_gold_patch(tmp_path):
    task = next(t for t in shipped_tasks() if t.metadata["library"] == "toolz")
    build_image(next(lib for lib in load_libraries() if lib.name == "toolz").recipe)
    report = experts.write_demonstrations("agentenv/SWE-v0", [task], tmp_path / "swe", strict=True)
    (traj,) = list(read(tmp_path / "swe"))
    assert report.written == 1 and traj.reward == 1.0 and traj.grade["resolved"] is True
    assert len(traj.turns) == 3 and traj.tool_calls == 3
