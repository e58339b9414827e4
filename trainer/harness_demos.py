"""Demonstrations in a harness's own format, for the warm start of a run that trains a harness (``env.harness``).

k3-mini from random weights produces no valid action of any harness, so a run that trains mini-swe-agent starts, as
the main job does, from demonstrations, but in mini-swe-agent's format: its prompts, its ``bash`` tool, its
observation template, its submission command. The simplest way to get exactly that format is to let the harness
make the demonstrations itself. mini-swe-agent, unmodified and with the run's own agent settings
(``env.harness_agent``), plays each task through the LLM gateway in front of a scripted engine, and the sessions'
records are the demonstrations. The engine answers as the Lookup expert would (``rollout.experts.lookup_expert``,
shown the command outputs without mini-swe-agent's wrapper) and submits its answer the harness's way (``echo
COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; echo ANSWER``).

With ``one_command`` (the default) the expert looks and submits in one command, ``echo
COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; cat NAME``: the file's content is the submission, so no episode asks the
policy to copy a code out of mini-swe-agent's ``<output>`` wrapper into a 60-token command (one token in about 80,
which a warm start averages away), and what RL then learns is the main job's decision, looking against guessing.
It fits the levels where the named file holds the code (0 and 1); ``one_command=False`` looks, then submits.

As in ``trainer.demos``, the demonstrator is imperfect on purpose: on a fraction ``guess`` of the tasks (drawn per
task, in list order, from the run's seed) it submits a code drawn from the env's whole list without looking. Every
episode is written (token ids, mask, the engine's logprobs, reward); ``demos.json`` counts them. Lookup-v0 only.

    [sft]
    expert = "trainer.harness_demos:write_demonstrations"
    expert_kwargs = {guess = 0.5}
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from policy import chat
from rollout.scripted import Script, tool_call
from rollout.trajectory import Trajectory

LOOKUP = "agentenv/Lookup-v0"
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; echo {answer}"
LOOK_AND_SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; {look}"
_WRAPPED = re.compile(r"<returncode>-?\d+</returncode>\n(?:<exception>.*?</exception>\n)?<output>\n(.*?)</output>",
                      re.DOTALL)


def in_harness(inner: Script, one_command: bool = False) -> Script:
    """``inner`` (a script of our agent loop's format) as a mini-swe-agent expert: it reads the command outputs
    without mini-swe-agent's wrapper, and its final answer (plain text, or an ``answer`` call) becomes a submission.
    With ``one_command``, a first look (``cat NAME``) is itself the submission (``LOOK_AND_SUBMIT``)."""

    def script(prompt: str, turn: int) -> str:
        said = inner(_WRAPPED.sub(lambda m: m.group(1), prompt), turn)
        text = said if isinstance(said, str) else said[0]
        msg = chat.parse_assistant(text)
        looks = [json.loads(c["function"]["arguments"])["command"] for c in msg.tool_calls
                 if c["function"]["name"] == "bash"]
        if looks and one_command and str(looks[0]).startswith("cat "):
            return tool_call("bash", {"command": LOOK_AND_SUBMIT.format(look=looks[0])})
        if looks:
            return text
        given = json.loads(msg.tool_calls[0]["function"]["arguments"]).get("answer", "") if msg.tool_calls \
            else msg.content
        return tool_call("bash", {"command": SUBMIT.format(answer=str(given).strip() or "nothing")})

    return script


def write_demonstrations(env_id: str, tasks: Iterable[Any], out: str | Path, n: int | None = None, *,
                         env_kwargs: Mapping[str, Any] | None = None, harness_agent: Mapping[str, Any] | None = None,
                         guess: float = 0.5, one_command: bool = True, seed: int = 0,
                         concurrency: int = 4) -> dict[str, Any]:
    """Play the (imperfect) demonstrator through mini-swe-agent on the first ``n`` of ``tasks`` and write every
    episode's records to ``out`` (msgpack shards, and ``demos.json``)."""
    from envs.lookup_env import VALUES
    from rollout.experts import lookup_expert
    from rollout.trajectory import ShardWriter
    from trainer.demos import guessing_script

    if env_id != LOOKUP:
        raise ValueError(f"harness demonstrations are written for {LOOKUP} only, not {env_id}")
    chosen = list(tasks)[:n] if n is not None else list(tasks)
    rng = random.Random(seed)
    guessing = [rng.random() < guess for _ in chosen]
    looked = [t for t, g in zip(chosen, guessing, strict=True) if not g]
    guessed = [t for t, g in zip(chosen, guessing, strict=True) if g]
    kwargs, agent = dict(env_kwargs or {}), dict(harness_agent or {})
    episodes = [*play(env_id, looked, in_harness(lookup_expert(), one_command), kwargs, agent, concurrency),
                *play(env_id, guessed, in_harness(guessing_script(list(VALUES), False, seed)), kwargs, agent,
                      concurrency)]
    records = [t for main, others in episodes for t in (main, *others)]
    with ShardWriter(out) as w:
        for t in records:
            if not t.infra_error:
                w.write(t)
    report: dict[str, Any] = {
        "env_id": env_id, "harness": "mini-swe-agent", "episodes": len(episodes), "records": len(records),
        "guess": guess, "one_command": one_command, "guessed": len(guessed), "looked": len(looked),
        "solved": sum(1 for main, _ in episodes if main.reward == 1.0),
        "infra_errors": sum(1 for t in records if t.infra_error),
        "errors": sorted({f"{t.finish_reason}: {t.error}" for t in records if t.infra_error})[:5],
        "outcomes": {o: sum(1 for t in records if t.metadata.get("outcome") == o)
                     for o in sorted({str(t.metadata.get("outcome")) for t in records})}}
    Path(out, "demos.json").write_text(json.dumps(report, indent=1))
    return report


def play(env_id: str, tasks: list[Any], script: Script, env_kwargs: dict[str, Any], agent: dict[str, Any],
         concurrency: int) -> list[tuple[Trajectory, list[Trajectory]]]:
    """Each task as a one-episode group, mini-swe-agent driven by ``script`` through the gateway: each episode's
    record and the records of its other branches."""
    import gymnasium

    import envs  # noqa: F401  (registers the env ids)
    from policy.client import PolicyClient
    from policy.tokenizer import load_tokenizer
    from rollout import scripted
    from rollout.agent import LocalTokenizer
    from rollout.gateway.sessions import Budget
    from rollout.groups import GroupSpec, run_group
    from rollout.harnesses import GatewayServer, HarnessConfig, HarnessDriver, LoopbackServer
    from rollout.workers import task_id_of

    if not tasks:
        return []
    engine = LoopbackServer(scripted.create_app(script, LocalTokenizer()), "scripted engine")
    gateway = GatewayServer(engine.url, None, load_tokenizer())
    driver = HarnessDriver(gateway, HarnessConfig("mini-swe-agent", agent, Budget(turns=10, tokens=65_536)))

    async def all_groups() -> list[tuple[Trajectory, list[Trajectory]]]:
        gate = asyncio.Semaphore(concurrency)
        async with PolicyClient(engine.url) as policy:
            async def one(i: int, task: Any) -> tuple[Trajectory, list[Trajectory]]:
                async with gate:
                    result = await run_group(lambda: gymnasium.make(env_id, **env_kwargs),
                                             GroupSpec(f"demo-{i:05d}", task, task_id_of(task)), policy,
                                             LocalTokenizer(), env_id=env_id, harness=driver)
                return result.trajectories[0], result.branches
            return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks))))

    try:
        return asyncio.run(all_groups())
    finally:
        gateway.close()
        engine.close()
