"""SWE-v0 through Ray rollout workers with a scripted policy: the gold patch (applied with the tools, then submit)
earns 1.0 for every episode of a forked group, a no-op solution 0.0; and a group's children start byte-identical,
processes included (memory fork)."""

from __future__ import annotations

import secrets

import pytest

from envs.images import build_image
from envs.swe_env import SWEEnv
from envs.task import shipped_tasks
from envs.tasks.libraries import load_libraries
from rollout import scripted, trajectory
from rollout.agent import AgentConfig
from rollout.driver import Rollout
from rollout.groups import branch
from rollout.workers import RolloutConfig

from .helpers import labelled

pytestmark = pytest.mark.integration
TREE_HASH = ("cd /testbed && { git rev-parse HEAD; git status --porcelain; find . -path ./.git -prune -o -type f "
             "-print0 | sort -z | xargs -0 sha256sum; } | sha256sum")
# A process whose state lives only in its memory: it writes its random number when asked, never before.
HOLDER = ("python3 -c \"import os, random, time\nx = random.getrandbits(64)\nopen('/tmp/ready', 'w').close()\n"
          "while True:\n"
          "    if os.path.exists('/tmp/ask'):\n        open('/tmp/said.tmp', 'w').write(str(x))\n"
          "        os.rename('/tmp/said.tmp', '/tmp/said'); os.remove('/tmp/ask')\n    time.sleep(0.02)\n\"")


@pytest.fixture(scope="module")
def task():
    t = next(t for t in shipped_tasks() if t.metadata["library"] == "toolz")
    lib = next(lib for lib in load_libraries() if lib.name == "toolz")
    build_image(lib.recipe)  # cached: seconds when present
    return t


def gold_script(task):
    def script(prompt: str, turn: int) -> str:
        assert task.problem_statement.strip() in prompt
        if turn == 0:
            return "I apply the fix." + scripted.tool_call("create", {"path": "/testbed/.fix.patch",
                                                                      "file_text": task.patch})
        if turn == 1:
            return scripted.tool_call("bash", {"command": "git apply .fix.patch && rm .fix.patch && echo applied"})
        return scripted.tool_call("submit", {})

    return script


def noop_script(prompt: str, turn: int) -> str:
    return scripted.tool_call("bash", {"command": "git status"}) if turn == 0 else scripted.tool_call("submit", {})


def test_the_gold_patch_earns_one_and_a_no_op_zero_through_ray_workers(ray_cluster, serve_policy, task, tmp_path):
    gold, noop = serve_policy(gold_script(task)), serve_policy(noop_script)
    agent = AgentConfig(max_turns=5, max_new_tokens=4096)
    out = tmp_path / "gold"
    cfg = RolloutConfig("agentenv/SWE-v0", gold.url, group_size=2, agent=agent)
    with Rollout(cfg, workers=1, out=out) as r:
        results = list(r.groups([task.instance_id]))
        run_id = r.run_id
    [g] = results
    trajs = list(trajectory.read(out))
    assert [(t.finish_reason, t.reward) for t in trajs] == [("submitted", 1.0)] * 2, [t.error for t in trajs]
    assert all(t.grade["resolved"] is True for t in trajs)
    # one group: the same group id and the same prompt ids, forked from one reset
    assert {t.group_id for t in trajs} == {g.spec.group_id} and sorted(t.group_index for t in trajs) == [0, 1]
    assert trajs[0].prompt_len == trajs[1].prompt_len
    assert trajs[0].token_ids[: trajs[0].prompt_len] == trajs[1].token_ids[: trajs[1].prompt_len]
    assert all(t.metadata["node_id"] and t.metadata["env_url"] == "local" for t in trajs)
    assert labelled(run_id) == {"sandboxes": [], "snapshots": []}

    cfg = RolloutConfig("agentenv/SWE-v0", noop.url, group_size=1, agent=agent)
    with Rollout(cfg, workers=1, out=tmp_path / "noop") as r:
        [g] = list(r.groups([task.instance_id]))
    [t] = g.trajectories
    assert (t.finish_reason, t.reward, t.grade["resolved"]) == ("submitted", 0.0, False)
    assert labelled(r.run_id) == {"sandboxes": [], "snapshots": []}


def test_a_groups_children_share_the_tree_and_the_memory_of_a_process_started_before_the_fork(task):
    parent = SWEEnv(task=task)
    kids: list = []
    try:
        parent.reset()
        box = parent.box()
        box.write_file("/testbed/.state", secrets.token_hex(32))  # state the image does not have
        box.spawn(HOLDER)
        ready = box.exec("for i in $(seq 200); do test -e /tmp/ready && break; sleep 0.05; done; ls /tmp/ready",
                         timeout=30)
        assert ready.exit_code == 0  # the process holds its number (and has not written it anywhere)
        kids = branch(parent, 3, memory=True, make_env=lambda: SWEEnv(task=task), seed=None)
        hashes = {env.box().exec(TREE_HASH, timeout=60).stdout for env in [parent, *kids]}
        assert len(hashes) == 1 and len(next(iter(hashes))) > 64
        said = set()
        for env in [parent, *kids]:
            sb = env.box()
            assert sb.exec("test -e /tmp/said", timeout=10).exit_code != 0  # never written before the fork
            sb.exec("touch /tmp/ask", timeout=10)
            said.add(sb.exec("for i in $(seq 200); do test -e /tmp/said && break; sleep 0.05; done; cat /tmp/said",
                             timeout=30).stdout.strip())
        assert len(said) == 1 and next(iter(said)).isdigit()
    finally:
        for env in kids:
            env.close()
        parent.close()
