"""A two-node Ray cluster on one machine: a worker on each node, each using its own node's ``agentenv serve``;
and the random-weight k3-mini server driving episodes through the whole path, the alignment invariants holding
on every trajectory."""

from __future__ import annotations

import re

import httpx
import pytest
import ray

from policy import chat
from rollout import trajectory
from rollout.agent import AgentConfig, LocalTokenizer, env_tools
from rollout.driver import Rollout
from rollout.workers import RolloutConfig, load_task_refs

from ..server_fixtures import TOKEN, k3_mini_server, threaded_server
from .helpers import labelled, python_script, tool_tasks

pytestmark = pytest.mark.integration
TOK = LocalTokenizer()


def _sandboxes_created(url: str) -> int:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(int(float(m.group(1))) for m in
               re.finditer(r'agentenv_operation_seconds_count\{op="[^"]*(?:create|sandboxes)[^"]*"\} (\S+)', text))


def test_workers_on_two_nodes_each_use_their_own_nodes_env_server(ray_cluster, serve_policy, tmp_path):
    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU")]
    assert len(nodes) == 2
    policy = serve_policy(python_script)
    refs = load_task_refs(tool_tasks(tmp_path / "tasks.jsonl", 4))
    with threaded_server() as url_a, threaded_server() as url_b:
        env_urls = {nodes[0]: url_a, nodes[1]: url_b}
        cfg = RolloutConfig("agentenv/Tool-v0", policy.url, agent=AgentConfig(max_turns=3), env_urls=env_urls,
                            env_token=TOKEN, groups_per_worker=1)
        with Rollout(cfg, workers=2, out=tmp_path / "run") as r:
            results = list(r.groups(refs))
        trajs = [t for g in results for t in g.trajectories]
        assert len(trajs) == 4 and {t.reward for t in trajs} == {1.0}, [t.error for t in trajs]
        used = {t.metadata["node_id"]: t.metadata["env_url"] for t in trajs}
        assert used == env_urls  # both nodes played, each against its own server
        assert {i["node_id"] for i in r.worker_infos} == set(nodes)
        assert _sandboxes_created(url_a) >= 1 and _sandboxes_created(url_b) >= 1
    assert labelled(r.run_id) == {"sandboxes": [], "snapshots": []}


@pytest.fixture(scope="module")
def k3_mini():
    with k3_mini_server("k3-token", ep=1, max_model_len=2048, timeout=300) as spec:
        yield spec


def test_the_random_weight_k3_mini_server_drives_episodes_through_the_whole_path(ray_cluster, k3_mini, tmp_path):
    refs = load_task_refs(tool_tasks(tmp_path / "tasks.jsonl", 2))
    agent = AgentConfig(max_turns=2, max_new_tokens=16, context_limit=2048)
    cfg = RolloutConfig("agentenv/Tool-v0", k3_mini.base_url, policy_token="k3-token", group_size=2, agent=agent,
                        keep_messages=True)
    out = tmp_path / "run"
    with Rollout(cfg, workers=2, out=out) as r:
        list(r.groups(refs))
    trajs = list(trajectory.read(out))
    assert len(trajs) == 4
    from envs import ToolEnv

    with ToolEnv() as env:
        tools = env_tools(env)
    for t in trajs:
        t.check()
        assert t.finish_reason in ("submitted", "max_turns", "max_tokens", "context_limit"), t.error
        assert t.turns and t.generated_tokens == sum(x.generated for x in t.turns) > 0
        gen = [lp for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if m]
        assert all(lp < 0 for lp in gen)  # the model's own logprobs, one per generated token
        for turn in t.turns:  # each turn's generated ids sit where the mask says
            assert t.loss_mask[turn.start: turn.start + turn.generated] == [1] * turn.generated
            assert t.loss_mask[turn.start - 1] == 0
        text = TOK.decode(t.token_ids)  # no re-tokenisation drift: the ids are the template's rendering
        msgs = t.metadata["messages"]
        assert text in (chat.render_chat(msgs, tools, add_generation_prompt=True),
                        chat.render_chat(msgs, tools, add_generation_prompt=False))
    for gid in {t.group_id for t in trajs}:
        group = [t for t in trajs if t.group_id == gid]
        assert len(group) == 2 and len({tuple(t.token_ids[: t.prompt_len]) for t in group}) == 1
