"""Demonstrations for the warm start from an *imperfect* demonstrator, so that RL has something to learn from reward.

``write_demonstrations(env_id, tasks, out, n, env_kwargs=..., guess=0.5)`` plays the scripted expert of
``rollout.experts`` through the real env and agent loop (``rollout.experts.play_demonstrations``), except that on a
fraction ``guess`` of the episodes — drawn per task from a seeded generator, so that nothing in the question tells
the two behaviours apart — the demonstrator does not look: it answers at once with a code drawn from the env's whole code list
(``envs.lookup_env.VALUES``), right only by luck (1 in 40). Every episode is
written (as RL data: token ids, loss mask, logprobs, reward), the failed guesses too: the warm start imitates a
demonstrator that skips the lookup half of the time, as an impatient person would.

Why: on the main job's budget (minutes of two CPU cores) k3-mini, trained from random initialisation, learns the
format and part of the copying skill from demonstrations, and RL cannot improve a copying skill much in a dozen
iterations. What RL can and does learn in that budget is a *decision* the reward tells apart: looking up the code
(right whenever the copy is right) against guessing (right 1 time in 40). The held-out pass rate after
RL rises above the pass rate after SFT because the policy learned, from reward alone, to look before answering —
the demonstrations never said which of the two behaviours is better. ``guess = 0`` is the plain expert.

Lookup-v0 only (the guess needs the env's code list); other envs get the plain expert of ``rollout.experts``.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

LOOKUP = "agentenv/Lookup-v0"


def guessing_script(codes: list[str], answer_tool: bool, seed: int = 0) -> Any:
    """A demonstrator that does not look: it answers at once with a code drawn from ``codes``, by a generator
    seeded with ``seed`` and the prompt, so that a run's demonstrations repeat whatever order episodes run in."""
    from rollout.scripted import tool_call

    def script(prompt: str, turn: int) -> str | list[str]:
        code = random.Random(f"{seed}:{prompt}").choice(codes)
        return tool_call("answer", {"answer": code}) if answer_tool else code

    return script


def write_demonstrations(env_id: str, tasks: Iterable[Any], out: str | Path, n: int | None = None, *,
                         env_kwargs: Mapping[str, Any] | None = None, guess: float = 0.5, seed: int = 0,
                         concurrency: int = 4) -> dict[str, Any]:
    """Play the (imperfect) demonstrator on the first ``n`` of ``tasks`` and write every episode to ``out``
    (msgpack shards, and ``demos.json``: episodes, how many guessed, how many solved)."""
    from rollout.agent import LocalTokenizer
    from rollout.experts import lookup_expert, play_demonstrations
    from rollout.experts import write_demonstrations as plain
    from rollout.trajectory import ShardWriter

    chosen = list(tasks)[:n] if n is not None else list(tasks)
    kwargs = dict(env_kwargs or {})
    if env_id != LOOKUP or guess <= 0:
        return plain(env_id, chosen, out, None, env_kwargs=kwargs).to_json()
    from envs.lookup_env import VALUES

    codes = list(VALUES)        # the demonstrator does not know which codes this task family draws from
    rng = random.Random(seed)   # which episodes guess: drawn per task in list order, so a task list gives one set
    guessing = [rng.random() < guess for _ in chosen]
    looked_tasks = [t for t, g in zip(chosen, guessing, strict=True) if not g]
    guessed_tasks = [t for t, g in zip(chosen, guessing, strict=True) if g]
    answer_tool = bool(kwargs.get("answer_tool", True))

    async def play_both() -> list[Any]:
        looked = await play_demonstrations(env_id, looked_tasks, lookup_expert(), LocalTokenizer(),
                                           env_kwargs=kwargs, concurrency=concurrency)
        guessed = await play_demonstrations(env_id, guessed_tasks, guessing_script(codes, answer_tool, seed),
                                            LocalTokenizer(), env_kwargs=kwargs, concurrency=concurrency)
        return [*looked, *guessed]

    trajs = asyncio.run(play_both())
    with ShardWriter(out) as w:
        for t in trajs:
            if not t.infra_error:
                w.write(t)
    looked = [t for t in trajs if len(t.turns) > 1]
    report: dict[str, Any] = {"env_id": env_id, "episodes": len(trajs), "guess": guess,
              "guessed": len(trajs) - len(looked), "looked": len(looked),
              "solved": sum(1 for t in trajs if t.reward == 1.0),
              "solved_looking": sum(1 for t in looked if t.reward == 1.0),
              "infra_errors": sum(1 for t in trajs if t.infra_error)}
    Path(out, "demos.json").write_text(json.dumps(report, indent=1))
    return report
