"""A harness as the episode's driver (``rollout.harnesses``): mini-swe-agent, unmodified, plays Lookup groups forked
from one reset, each episode in its fork's sandbox and through its own gateway session; the env grades what it
submitted. A scripted engine (token ids in, streamed ids out) answers in K3's tool-call format: ``cat`` the file,
then submit the code. Outcomes are typed, and what is not the policy's doing has no reward; the rollout command
takes ``--harness`` and writes the records."""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import gymnasium
import pytest

import envs  # noqa: F401  (registers the env ids)
from envs.lookup_env import task_id
from policy.tokenizer import load_tokenizer
from rollout import scripted
from rollout import trajectory as tj
from rollout.agent import LocalTokenizer
from rollout.gateway.sessions import Budget
from rollout.groups import GroupSpec, run_group
from rollout.harnesses import GatewayServer, HarnessConfig, HarnessDriver

pytestmark = pytest.mark.integration
TASK = task_id(1, 7)
AGENT = {"step_limit": 6, "system_template": "You solve tasks with bash.",
         "instance_template": "{{task}}\nSubmit with: echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; echo ANSWER"}


def solver(text: str, turn: int) -> str:
    """cat the file the question names, then submit the first word it printed."""
    returns = text.split("## Return of")
    if len(returns) > 1:
        code = re.search(r"<output>\n(\S+)", returns[-1])
        answer = code.group(1) if code else "nothing"
        return "Found it." + scripted.tool_call("bash", {
            "command": f"echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; echo {answer}"})
    name = re.search(r"code is in file (\S+?)\?", text)
    return "Reading." + scripted.tool_call("bash", {"command": f"cat /data/{name.group(1) if name else 'x'}"})


def stubborn(text: str, turn: int) -> str:
    return "Looking." + scripted.tool_call("bash", {"command": "ls"})


def play_group(serve_policy, script, size: int, **harness_kw):
    engine = serve_policy(script)
    server = GatewayServer(engine.url, None, load_tokenizer())
    harness = HarnessConfig("mini-swe-agent", {**AGENT, **harness_kw.pop("agent", {})}, **harness_kw)
    try:
        result = asyncio.run(run_group(lambda: gymnasium.make("agentenv/Lookup-v0"),
                                       GroupSpec("g1", TASK, TASK, group_size=size, seed=3), None, LocalTokenizer(),
                                       env_id="agentenv/Lookup-v0", harness=HarnessDriver(server, harness)))
    finally:
        server.close()
    return result, engine


def test_a_group_of_harness_episodes_is_forked_played_through_the_gateway_and_graded(serve_policy):
    result, engine = play_group(serve_policy, solver, 3)
    assert [t.group_index for t in result.trajectories] == [0, 1, 2] and result.branches == []
    for t in result.trajectories:
        assert t.metadata["outcome"] == "graded" and t.finish_reason == "submitted" and t.reward == 1.0, t.error
        assert t.grade["correct"] and t.grade["answer"] == t.grade["expected"]
        gw = t.metadata["gateway"]
        assert gw["calls"] == 2 and gw["branches"] == 1 and gw["merge_rate"] == 1.0
        assert t.group_id == "g1" and t.task_id == TASK and len(t.turns) == 2
        assert t.metadata["harness_exit"] == "Submitted"
    assert engine.app.state.calls == 6                       # 3 episodes x 2 calls, none resampled
    assert result.fork_s > 0                                 # the episodes were forked from one reset


@pytest.mark.parametrize(("harness_kw", "finish"), [
    ({"agent": {"step_limit": 2}}, "max_turns"),             # the harness's own step limit
    ({"budget": Budget(turns=2)}, "max_turns"),              # the run's budget: the final message, then format errors
])
def test_a_budget_stop_is_a_task_failure_scored_zero(serve_policy, harness_kw, finish):
    result, _ = play_group(serve_policy, stubborn, 1, **harness_kw)
    (t,) = result.trajectories
    assert t.metadata["outcome"] == "budget_stop" and t.finish_reason == finish and t.reward == 0.0


def test_a_harness_past_its_deadline_is_a_timeout_with_no_reward(serve_policy):
    engine = serve_policy(stubborn)
    engine.delay = 3.0                                       # every engine call takes 3 s; the harness has 1 s
    server = GatewayServer(engine.url, None, load_tokenizer())
    try:
        result = asyncio.run(run_group(lambda: gymnasium.make("agentenv/Lookup-v0"),
                                       GroupSpec("g2", TASK, TASK, group_size=1), None, LocalTokenizer(),
                                       env_id="agentenv/Lookup-v0", max_retries=0,
                                       harness=HarnessDriver(server, HarnessConfig(agent=AGENT, timeout_s=1.0))))
    finally:
        server.close()
    (t,) = result.trajectories
    assert t.metadata["outcome"] == "timeout" and t.finish_reason == "timeout" and t.reward is None
    assert t.infra_error


def test_agentenv_rollout_takes_a_harness(serve_policy, tmp_path):
    engine = serve_policy(solver)
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "agentenv", "rollout", "--env", "agentenv/Lookup-v0", "--task", TASK,
                        "--policy-url", engine.url, "--group-size", "2", "--workers", "0", "--out", str(out),
                        "--harness", "mini-swe-agent", "--harness-arg", f"step_limit={AGENT['step_limit']}",
                        "--harness-arg", "system_template=" + json.dumps(AGENT["system_template"]),
                        "--harness-arg", "instance_template=" + json.dumps(AGENT["instance_template"])],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    records = list(tj.read(out))
    assert len(records) == 2 and all(t.reward == 0.0 or t.reward == 1.0 for t in records)
    assert all(t.metadata["outcome"] == "graded" and t.metadata["harness"] == "mini-swe-agent" for t in records)
    run = json.loads((Path(out) / "run.json").read_text())
    assert run["config"]["harness"]["name"] == "mini-swe-agent"


CLI_IMAGE = "agentenv-test/cli-harness:1"


@pytest.fixture(scope="module")
def cli_image():
    """agentenv's base image with a small CLI harness installed (tests/integration/rollout/cli_harness)."""
    import docker

    client = docker.from_env()
    client.images.build(path=str(Path(__file__).parent / "cli_harness"), tag=CLI_IMAGE, rm=True, forcerm=True,
                        network_mode="none", pull=False)
    yield CLI_IMAGE
    client.images.remove(CLI_IMAGE, force=True)


def answer_after_looking(text: str, turn: int) -> str:
    returns = text.split("## Return of")
    if len(returns) > 1:
        return returns[-1].split("\n", 1)[1].split()[0]          # the file's code, as a plain answer
    name = re.search(r"code is in file (\S+?)\?", text)
    return "Reading." + scripted.tool_call("bash", {"command": f"cat /data/{name.group(1) if name else 'x'}"})


def test_a_cli_harness_inside_the_sandbox_reaches_the_gateway_and_nothing_else(serve_policy, cli_image):
    """The harness runs in the sandbox (no network at all) and asks the gateway at an address inside it, streamed;
    the episode is recorded as one merged branch and graded. From the same sandbox, the forward's address reaches
    the gateway only: another session's capability is refused and the host's other loopback ports are not there."""
    engine = serve_policy(answer_after_looking)
    server = GatewayServer(engine.url, None, load_tokenizer())
    probe = ("import urllib.request, urllib.error, os\n"
             "def get(url, key):\n"
             "    try:\n"
             "        r = urllib.request.urlopen(urllib.request.Request(url, headers={'Authorization': 'Bearer ' + key}), timeout=5)\n"
             "        return r.status\n"
             "    except urllib.error.HTTPError as e:\n"
             "        return e.code\n"
             "    except OSError as e:\n"
             "        return type(e).__name__\n"
             "print(get(os.environ['OPENAI_BASE_URL'] + '/models', os.environ['OPENAI_API_KEY']))\n"
             "print(get(os.environ['OPENAI_BASE_URL'].replace(os.environ['SID'], os.environ['OTHER']) + '/models', os.environ['OPENAI_API_KEY']))\n"
             "print(get('http://127.0.0.1:%s/v1/models' % os.environ['ENGINE_PORT'], 'x'))\n")
    other = server.gateway.open()
    harness = HarnessConfig("command", {"command": "python3 /opt/harness/agent.py"}, timeout_s=120)
    try:
        result = asyncio.run(run_group(
            lambda: gymnasium.make("agentenv/Lookup-v0", image=cli_image, answer_tool=False),
            GroupSpec("g3", TASK, TASK, group_size=2, seed=1), None, LocalTokenizer(), env_id="agentenv/Lookup-v0",
            harness=HarnessDriver(server, harness)))
        for t in result.trajectories:
            assert t.metadata["outcome"] == "graded" and t.reward == 1.0, (t.error, t.grade)
            gw = t.metadata["gateway"]
            assert gw["calls"] == 2 and gw["branches"] == 1 and gw["merge_rate"] == 1.0
        env = gymnasium.make("agentenv/Lookup-v0", image=cli_image)
        try:
            env.reset(options={"task": TASK})
            box = env.unwrapped.sandbox
            s = server.gateway.open()
            inside = box.forward(4000, to=("127.0.0.1", server.port))
            r = box.exec(f"python3 -c {shlex.quote(probe)}", env={
                "OPENAI_BASE_URL": f"{inside.url}/s/{s.id}/v1", "OPENAI_API_KEY": s.key, "SID": s.id,
                "OTHER": other.id, "ENGINE_PORT": str(engine.port)}, timeout=60)
            assert r.stdout.split() == ["200", "401", "URLError"], r.stdout + r.stderr
        finally:
            env.close()
    finally:
        server.close()
