"""The env-server fleet on the two-node Ray cluster: ``up`` starts one server per node (each with its own sandbox
home, as separate machines have), again keeps them, ``Pool.from_ray`` places sandboxes on both by free capacity,
rollout workers use their own node's server through Ray, ``prewarm`` gets an image onto every server, and ``down``
leaves no actor, port or sandbox."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import ray

import agentenv
from agentenv.errors import Unauthorized
from agentenv.remote import fleet as found
from agentenv.server import fleet
from rollout.agent import AgentConfig
from rollout.driver import Rollout
from rollout.workers import RolloutConfig, load_task_refs

from ..conftest import cleanup, leaked
from ..server_fixtures import TOKEN, write_token_file
from .helpers import python_script, tool_tasks

pytestmark = pytest.mark.integration


@pytest.fixture()
def homes(ray_cluster) -> Iterator[str]:
    """A ``--home`` template: one fresh sandbox home per node; each checked for leaks and removed after."""
    root = Path(tempfile.mkdtemp(prefix="agentenv-fleet-", dir="/var/tmp"))
    root.chmod(0o711)  # sandboxes' unprivileged uids pass through to their files
    yield str(root / "{node}")
    try:
        for home in sorted(p for p in root.iterdir() if p.is_dir()):
            assert leaked(home) == {}, home
    finally:
        fleet.down()
        for home in sorted(p for p in root.iterdir() if p.is_dir()):
            cleanup(home)
        root.rmdir()


def _fleet_names() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == found.NAMESPACE]


def test_up_pool_from_ray_rollout_and_down(ray_cluster, homes, serve_policy, tmp_path):
    nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
    assert len(nodes) == 2
    rows = fleet.up(TOKEN, port=0, home=homes, server={"max_sandboxes": 4})
    assert [r["node_id"] for r in rows] == nodes and all(r["started"] for r in rows)
    urls = {r["node_id"]: r["url"] for r in rows}
    assert len(set(urls.values())) == 2 and all(u.startswith("http://127.0.0.1:") for u in urls.values())
    assert {r["token"] for r in rows} == {found.fingerprint(TOKEN)}  # a fingerprint, never the token itself
    assert all(TOKEN not in repr(r) for r in rows)

    again = fleet.up(TOKEN, port=0, home=homes, server={"max_sandboxes": 4})  # idempotent: the same servers kept
    assert [r["started"] for r in again] == [False, False] and {r["node_id"]: r["url"] for r in again} == urls
    with pytest.raises(found.FleetError, match="other settings"):
        fleet.up(TOKEN, port=0, home=homes, server={"max_sandboxes": 5})
    assert found.urls() == urls

    with pytest.raises(Unauthorized):
        agentenv.Pool.from_ray("not-the-fleet-token")
    with agentenv.Pool.from_ray(TOKEN) as pool:
        assert sorted(c.url for c in pool.clients) == sorted(urls.values())
        boxes = [pool.Sandbox.create(ttl=300) for _ in range(2)]  # the second goes where more is free: the other
        try:
            assert {sb.client.url for sb in boxes} == set(urls.values())
            for sb in boxes:
                node = next(n for n, u in urls.items() if u == sb.client.url)
                assert (Path(homes.replace("{node}", node)) / "sandboxes" / sb.id).exists()  # on that node
                assert sb.exec("echo hi").stdout == "hi\n"
        finally:
            for sb in boxes:
                sb.close()

    policy = serve_policy(python_script)
    refs = load_task_refs(tool_tasks(tmp_path / "tasks.jsonl", 2))
    cfg = RolloutConfig("agentenv/Tool-v0", policy.url, agent=AgentConfig(max_turns=3), env_fleet=True,
                        env_token=TOKEN, groups_per_worker=1)
    with Rollout(cfg, workers=2, out=tmp_path / "run") as r:
        trajs = [t for g in r.groups(refs) for t in g.trajectories]
    assert len(trajs) == 2 and {t.reward for t in trajs} == {1.0}, [t.error for t in trajs]
    assert all(t.metadata["env_url"] == urls[t.metadata["node_id"]] for t in trajs)  # each its node's server

    stopped = fleet.down()
    assert sorted(s["node_id"] for s in stopped) == nodes
    assert _fleet_names() == [] and found.servers() == []
    for url in urls.values():
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=5)


def _cli(*args: str) -> str:
    code = "import sys; from agentenv.cli import main; sys.argv[0] = 'agentenv'; main()"
    r = subprocess.run([sys.executable, "-c", code, "cluster", *args], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "COLUMNS": "200"}, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_the_cli_joins_the_cluster_and_its_servers_outlive_it(ray_cluster, homes, tmp_path):
    token_file = write_token_file(tmp_path)
    args = ("--ray-address", ray_cluster.address, "--token-file", str(token_file), "--port", "0", "--home", homes)
    assert _cli("up", *args).count("started") == 2
    assert _cli("up", *args).count("kept") == 2  # again: the same servers, and still there after the CLI exited
    urls = found.urls()
    assert len(urls) == 2
    warm = _cli("prewarm", "--ray-address", ray_cluster.address, "--token-file", str(token_file), "agentenv/base")
    for url in urls.values():  # every fleet server made sure of the image, with a progress line each
        assert f"{url} agentenv/base: local" in warm, warm
    assert "[2/2]" in warm
    with agentenv.Pool.from_ray(TOKEN) as pool:
        sb = pool.Sandbox.create(ttl=300)
        node = next(n for n, u in urls.items() if u == sb.client.url)
    out = _cli("down", "--ray-address", ray_cluster.address, "--close-sandboxes")
    assert out.count("stopped") == 2 and "closed 1 sandboxes" in out  # the one left open, closed on its node
    assert not (Path(homes.replace("{node}", node)) / "sandboxes" / sb.id).exists()
    assert _fleet_names() == []
