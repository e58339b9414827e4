"""harbor (the real package, unmodified, in its own Python >= 3.12 venv: scripts/python3.13.sh builds it) running a
hand-written task of its own format (tests/integration/harbor_task) in an agentenv sandbox, the environment
loaded by import path (``--env agentenv.harness.harbor:AgentenvEnvironment``): its Dockerfile built locally, the
oracle agent's solution earns reward 1 from the task's verifier, the nop agent 0."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TASK = Path(__file__).resolve().parent / "harbor_task"
VENV = Path(os.environ.get("AGENTENV_HARBOR_VENV", ROOT / ".venv-harbor"))
ENV = "agentenv.harness.harbor:AgentenvEnvironment"

if not (VENV / "bin" / "harbor").exists():
    pytest.skip(f"harbor's venv is not at {VENV}: make it with AGENTENV_HARBOR=1 scripts/bootstrap.sh (or "
                f"scripts/python3.13.sh {VENV})", allow_module_level=True)


@pytest.fixture(scope="module")
def built_images() -> Iterator[None]:
    """Remove the task's image that the first trial built (the second reuses it)."""
    from agentenv.host import images

    before = {t for i in images.docker_client().images.list(name="agentenv-harbor/*") for t in i.tags}
    yield
    for image in images.docker_client().images.list(name="agentenv-harbor/*"):
        for tag in set(image.tags) - before:
            images.docker_client().images.remove(tag, force=True)


def trial(agent: str, trials: Path) -> dict:
    """``harbor trials start`` of the task with ``agent``; its result.json."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's agentenv, wherever the venv's points
    run = subprocess.run([str(VENV / "bin" / "harbor"), "trials", "start", "-p", str(TASK), "--agent", agent,
                          "--env", ENV, "--trials-dir", str(trials), "--trial-name", agent],
                         capture_output=True, text=True, env=env, timeout=300, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((trials / agent / "result.json").read_text())
    assert result["exception_info"] is None, result["exception_info"]
    return dict(result)


def test_the_oracle_earns_reward_1_and_the_nop_agent_0(built_images: None, tmp_path: Path) -> None:
    oracle = trial("oracle", tmp_path)
    assert oracle["verifier_result"]["rewards"] == {"reward": 1}
    assert (tmp_path / "oracle" / "verifier" / "reward.txt").read_text().strip() == "1"  # downloaded back
    nop = trial("nop", tmp_path)
    assert nop["verifier_result"]["rewards"] == {"reward": 0}


def test_what_harbor_asks_of_the_environment_is_enforced_or_refused(built_images: None) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([str(VENV / "bin" / "python"), str(Path(__file__).with_name("harbor_probe.py")), str(TASK)],
                         capture_output=True, text=True, env=env, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["refused_gpus"] == "RuntimeError" and seen["refused_compose"] == "ValueError"
    assert seen["whoami"] == ["root\n", "agent\n", "agent\n", "nobody\n"]
    assert seen["ghost"] == "UnknownUser"
    assert seen["pwd"] == "/app\n" and seen["cwd_env"] == "/tmp\ny z\n"
    assert seen["timeout"] == "Command timed out after 1 seconds"
    assert seen["limits"] == [1.0, 256 * 1024 * 1024]
    assert seen["rules_before"] is True  # a later phase needs a network: started with one, everything denied
    assert seen["allow_out_after"] == ["192.0.2.7"]
    assert seen["uploaded_runs"] == "ran\n" and seen["downloaded"] == "deep\n"
    assert seen["is_dir"] == [True, False, False]
