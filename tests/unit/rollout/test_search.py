"""Fork-based search on Tool-v0 over a fake backend with a scripted policy: the tree, the best leaf, no leaks."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx

from envs import ToolEnv
from policy.client import PolicyClient
from rollout import scripted, search
from rollout.agent import AgentConfig, LocalTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "envs"))
from fakes import FakeBackend  # noqa: E402

TOK = LocalTokenizer()
CALC = scripted.tool_call("calculator", {"expression": "37 * 1234 - 5678"})
RIGHT = scripted.tool_call("answer", {"answer": "39980"})
WRONG = scripted.tool_call("answer", {"answer": "1"})


def run(coro_fn, script):
    backend = FakeBackend()
    env = ToolEnv(task="calc-001", api=backend)

    async def go():
        app = scripted.create_app(script, TOK)
        async with PolicyClient("http://scripted", transport=httpx.ASGITransport(app=app), max_retries=0) as policy:
            return await coro_fn(env, policy)

    try:
        return asyncio.run(go()), backend
    finally:
        env.close()


def test_beam_search_finds_the_rewarded_leaf_and_closes_every_fork():
    def script(prompt, turn):  # turn 0: wrong, compute, compute; turn 1 (after computing): wrong, right, compute
        return [WRONG, CALC, CALC] if turn == 0 else [WRONG, RIGHT, CALC]

    result, backend = run(lambda env, p: search.beam(env, p, TOK, width=3, depth=3, beam_size=1), script)
    assert result.best.reward == 1.0 and result.best.finish_reason == "submitted"
    by_depth = {}
    for n in result.nodes:
        by_depth.setdefault(n.depth, []).append(n)
    assert len(by_depth[0]) == 1 and len(by_depth[1]) == 3
    assert sum(n.kept for n in by_depth[1]) == 1  # beam of 1
    assert [n.reward for n in by_depth[1] if n.done] == [0.0]  # the wrong answer is a leaf scoring 0
    assert {n.parent for n in by_depth[2]} == {next(n.id for n in by_depth[1] if n.kept)}
    assert any(n.reward == 1.0 for n in by_depth[2])
    assert "reward=1" in result.render()
    assert len(backend.sandboxes) <= 1  # at most the root env's own sandbox; every fork was closed


def test_best_of_n_returns_the_best_episode():
    def script(prompt, turn):
        return [WRONG, RIGHT, WRONG, WRONG]

    result, backend = run(lambda env, p: search.best_of_n(env, p, TOK, 4, config=AgentConfig(max_turns=2)), script)
    assert result.best.reward == 1.0
    assert sorted(t.reward for t in result.leaves) == [0.0, 0.0, 0.0, 1.0]
    assert len(result.nodes) == 5 and all(n.parent == 0 for n in result.nodes[1:])
    assert len(backend.sandboxes) <= 1


def test_search_validates_its_arguments():
    import pytest

    with pytest.raises(ValueError, match="width and depth"):
        asyncio.run(search.beam(None, None, TOK, width=0))  # type: ignore[arg-type]
