"""Run by harbor's own interpreter (its venv, Python >= 3.12) from test_harness_harbor.py: the environment made
through harbor's own factory by import path, then what harbor asks of it that the trials do not (users by name
and uid, an unknown user, cwd, env, a timeout, a later phase's network policy, files both ways) and what it must
refuse at construction (GPUs, compose files). Prints one JSON object of what it saw."""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from harbor.environments.factory import EnvironmentFactory
from harbor.models.task.config import EnvironmentConfig, NetworkMode, NetworkPolicy
from harbor.models.trial.paths import TrialPaths

IMPORT_PATH = "agentenv.harness.harbor:AgentenvEnvironment"


def make(task: Path, tmp: Path, config: EnvironmentConfig, **kwargs: Any) -> Any:
    paths = TrialPaths(trial_dir=tmp / "trial")
    paths.mkdir()
    return EnvironmentFactory.create_environment_from_import_path(
        IMPORT_PATH, environment_dir=task / "environment", environment_name="harbor_task",
        session_id="probe__env", trial_paths=paths, task_env_config=config, **kwargs)


def refused(task: Path, tmp: Path, config: EnvironmentConfig) -> str:
    try:
        make(task, tmp, config)
    except (RuntimeError, ValueError) as e:
        return type(e).__name__
    return "accepted"


async def main(task: Path) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp())
    seen: dict[str, Any] = {"refused_gpus": refused(task, tmp, EnvironmentConfig(gpus=1))}
    compose = tmp / "compose_task"
    (compose / "environment").mkdir(parents=True)
    (compose / "environment" / "docker-compose.yaml").write_text("services: {}\n")
    seen["refused_compose"] = refused(compose, tmp, EnvironmentConfig())
    env = make(task, tmp, EnvironmentConfig(cpus=1, memory_mb=256),
               network_policy=NetworkPolicy(network_mode=NetworkMode.NO_NETWORK),
               phase_network_policies=[NetworkPolicy(network_mode=NetworkMode.NO_NETWORK),
                                       NetworkPolicy(network_mode=NetworkMode.ALLOWLIST,
                                                     allowed_hosts=["192.0.2.7"])])
    await env.start(force_build=False)
    try:
        seen["whoami"] = [(await env.exec("id -un", user=u)).stdout for u in (None, "agent", 1500, "nobody")]
        try:
            await env.exec("id", user="ghost")
            seen["ghost"] = "accepted"
        except LookupError as e:
            seen["ghost"] = type(e).__name__
        seen["pwd"] = (await env.exec("pwd")).stdout
        seen["cwd_env"] = (await env.exec("pwd; echo $X", cwd="/tmp", env={"X": "y z"})).stdout
        try:
            await env.exec("sleep 30", timeout_sec=1)
            seen["timeout"] = "returned"
        except RuntimeError as e:
            seen["timeout"] = str(e)
        limits = env.sandbox.info().limits
        seen["limits"] = [limits.cpus, limits.memory]
        seen["rules_before"] = env.sandbox.info().network is not None
        await env.set_network_policy(NetworkPolicy(network_mode=NetworkMode.ALLOWLIST, allowed_hosts=["192.0.2.7"]))
        seen["allow_out_after"] = list(env.sandbox.info().network.allow_out)
        (tmp / "up").mkdir()
        (tmp / "up" / "run.sh").write_text("echo ran\n")
        (tmp / "up" / "run.sh").chmod(0o755)
        await env.upload_dir(tmp / "up", "/data/in")
        seen["uploaded_runs"] = (await env.exec("/data/in/run.sh")).stdout
        await env.exec("mkdir -p /data/out/sub && echo deep > /data/out/sub/f.txt")
        await env.download_dir("/data/out", tmp / "down")
        seen["downloaded"] = (tmp / "down" / "sub" / "f.txt").read_text()
        seen["is_dir"] = [await env.is_dir("/data/out"), await env.is_file("/data/out"), await env.is_file("/nope")]
    finally:
        await env.stop(delete=True)
    return seen


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(Path(sys.argv[1])))))
