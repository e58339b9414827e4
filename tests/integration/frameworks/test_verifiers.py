"""verifiers (``verifiers.v1``): an agentenv sandbox as a v1 ``Runtime`` (start, run, read, write, with_env,
with_user, stop), and SWE-v0 / Lookup-v0 tasks from our tasksets, set up and scored by verifiers' own
``Task.setup`` / ``Task.score`` on a real trace, with our grader as the reward: gold patch 1, none 0; the right
code 1, a wrong one 0."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

vf = pytest.importorskip("verifiers.v1")

from envs.frameworks.verifiers import (  # noqa: E402
    ANSWER_PATH,
    AgentenvConfig,
    AgentenvRuntime,
    LookupTaskset,
    SWETaskset,
)
from envs.task import Task  # noqa: E402

from .conftest import GOLD_PATH  # noqa: E402

pytestmark = pytest.mark.integration


def new_trace(task: Any) -> Any:
    """The trace a verifiers rollout opens for ``task`` (as ``verifiers.v1.rollout.Rollout`` builds it)."""
    return vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                    agent=vf.AgentInfo(config=vf.AgentConfig()))


async def scored(task: Any, act: Any) -> tuple[Any, float]:
    """Set the task up in an agentenv runtime, let ``act(runtime, trace)`` be the agent, score; the reward."""
    runtime = AgentenvRuntime(AgentenvConfig())
    trace = new_trace(task)
    try:
        await runtime.start()
        await task.setup(trace, runtime)
        await act(runtime, trace)
        await task.score(trace, runtime)
    finally:
        await runtime.stop()
    assert runtime.sandbox is None and runtime.stopped
    return trace, trace.reward


def test_an_agentenv_sandbox_as_a_verifiers_runtime() -> None:
    async def go() -> None:
        runtime = AgentenvRuntime(AgentenvConfig(cpus=0.5, memory="256m"))
        runtime.env = {"TASK_VAR": "t"}
        try:
            await runtime.start()
            assert runtime.info.id and await runtime.alive()
            r = await runtime.run(["sh", "-c", 'echo "$TASK_VAR $CALL_VAR" "$0"; echo err >&2; exit 3', "a b"],
                                  {"CALL_VAR": "c"})
            assert (r.exit_code, r.stdout, r.stderr) == (3, "t c a b\n", "err\n")
            await runtime.write("/tmp/x/data.bin", b"\x00\x01hello")
            assert await runtime.read("/tmp/x/data.bin") == b"\x00\x01hello"
            assert await runtime.read("/tmp/x/data.bin", max_bytes=7) == b"\x00\x01hello"
            with pytest.raises(vf.SandboxError, match="byte limit"):
                await runtime.read("/tmp/x/data.bin", max_bytes=3)
            view = runtime.with_env({"TASK_VAR": "other"})
            assert (await view.run(["sh", "-c", "echo $TASK_VAR"], {})).stdout == "other\n"
            nobody = runtime.with_user("nobody", home="/tmp")
            assert (await nobody.run(["id", "-un"], {})).stdout.strip() == "nobody"
            with pytest.raises(NotImplementedError):
                await runtime.open_process(["true"], {})
        finally:
            await runtime.stop()
        assert runtime.sandbox is None and not await runtime.alive()

    asyncio.run(go())


def test_swe_v0_through_verifiers_setup_and_score(swe_task: Task) -> None:
    (task,) = list(SWETaskset([swe_task]))
    assert task.data.prompt == swe_task.problem_statement.strip() and task.data.idx == 0

    async def gold(runtime: Any, trace: Any) -> None:
        await runtime.write(GOLD_PATH, swe_task.patch.encode())
        r = await runtime.run(["sh", "-c", f"cd /testbed && git apply {GOLD_PATH} && rm {GOLD_PATH}"], {})
        assert r.exit_code == 0, r.stderr

    async def nothing(runtime: Any, trace: Any) -> None:
        assert (await runtime.run(["git", "-C", "/testbed", "status", "--short"], {})).stdout == ""

    trace, reward = asyncio.run(scored(task, gold))
    assert reward == 1.0 and trace.rewards["resolved"].value == 1.0
    assert swe_task.problem_statement.strip() in trace.info["observation"]
    assert asyncio.run(scored(task, nothing))[1] == 0.0


def test_lookup_v0_through_verifiers_setup_and_score(lookup_task: Any) -> None:
    (task,) = list(LookupTaskset([lookup_task.id]))
    assert task.data.prompt == lookup_task.question

    def replying(answer: str | None, in_file: bool = False) -> Any:
        async def act(runtime: Any, trace: Any) -> None:
            shown = (await runtime.run(["cat", f"/data/{lookup_task.key}"], {})).stdout.strip()
            assert shown == lookup_task.answer  # the env's files, in the runtime's box
            text = shown if answer is None else answer
            if in_file:
                await runtime.write(ANSWER_PATH, text.encode())
            else:
                trace.root_reply = text  # the agent's reply, as a harness records it
        return act

    assert asyncio.run(scored(task, replying(None)))[1] == 1.0
    assert asyncio.run(scored(task, replying(None, in_file=True)))[1] == 1.0
    wrong = next(w for w in ("python", "project") if w != lookup_task.answer)
    trace, reward = asyncio.run(scored(task, replying(wrong)))
    assert reward == 0.0 and trace.rewards["correct"].value == 0.0


def test_a_network_rule_a_resource_or_another_runtime_is_refused(lookup_task: Any) -> None:
    (task,) = list(LookupTaskset([lookup_task.id]))

    async def setup(t: Any, runtime: Any) -> None:
        try:
            await t.setup(new_trace(t), runtime)
        finally:
            await runtime.stop()

    for update, match in (({"network_block": ["example.com"]}, "network"),
                          ({"resources": vf.TaskResources(cpu=2)}, "resources")):
        with pytest.raises(vf.TaskError, match=match):
            asyncio.run(setup(task.with_data(**update), AgentenvRuntime()))
    with pytest.raises(vf.TaskError, match="AgentenvRuntime"):
        asyncio.run(setup(task, vf.runtimes.SubprocessRuntime(vf.SubprocessConfig())))
