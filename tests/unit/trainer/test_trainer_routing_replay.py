"""Routing replay end to end, on the real engine in-process (our server app through ``httpx.ASGITransport``): the
agent loop records the experts of EVERY position of a multi-turn episode (prompt, tool output, generated; reused
prefix states included), exactly as a plain forward of the whole episode routes them; the trainer replays all of
them (coverage 1); ``rl.routing_replay`` makes the loop ask for them."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx
import pytest
import torch

from envs import ToolEnv
from policy.client import PolicyClient
from policy.config import k3_mini
from policy.engine import Engine
from policy.model import K3Model
from policy.server import create_app
from rollout.agent import AgentConfig, LocalTokenizer, run_episode
from trainer.algorithm.batch import Batch, Sample
from trainer.loop.config import load
from trainer.train import TrainConfig, Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "envs"))
from fakes import FakeBackend  # noqa: E402

TOK = LocalTokenizer()


@pytest.fixture(scope="module")
def engine():
    cfg = k3_mini(vocab_size=TOK._tok.vocab_size, eos_token_id=TOK.eos_id)
    eng = Engine(cfg, TOK._tok, seed=0, max_context=1024)
    yield eng
    eng.close()


def _episode(engine, route: bool):
    env = ToolEnv(task="calc-001", api=FakeBackend())
    app = create_app(engine, "t")
    config = AgentConfig(max_turns=3, max_new_tokens=8, max_total_tokens=64, context_limit=1024, temperature=0.0,
                         return_routed_experts=route)

    async def go():
        async with PolicyClient("http://engine", "t", transport=httpx.ASGITransport(app=app), max_retries=0) as p:
            return await run_episode(env, p, TOK, config, env_id="agentenv/Tool-v0")

    try:
        return asyncio.run(go())
    finally:
        env.close()


def test_every_position_of_a_multi_turn_episode_has_the_routing_a_plain_forward_has(engine):
    before = engine.metrics()["prefill_tokens_saved"]
    t = _episode(engine, route=True)
    assert len(t.turns) >= 2 and t.finish_reason in ("max_turns", "max_tokens", "submitted")
    assert engine.metrics()["prefill_tokens_saved"] > before        # later turns reused the kept prefix state
    n = max(i for i, m in enumerate(t.loss_mask) if m)    # positions 0..n-1 shape the generated tokens
    assert t.routing is not None and len(t.routing) >= n and None not in t.routing[:n]
    assert t.routing_coverage() == 1.0
    assert any(m == 0 for m in t.loss_mask[t.prompt_len:n])   # tool-output positions between the turns
    torch.manual_seed(0)
    model = K3Model(engine.cfg).eval()
    with torch.no_grad():
        model(torch.tensor([t.token_ids[:n]]))
    plain = model.last_routing(1, n)[0].tolist()
    assert t.routing[:n] == plain            # prompt, tool-output and generated positions alike
    # the trainer replays every fed position: coverage 1, and it routes exactly as recorded
    s = Sample.from_trajectory(t, advantage=1.0)
    assert s.routing == t.routing
    with Trainer(engine.cfg, TrainConfig(seed=0, routing_replay=True)) as tr:
        sc = tr.score([s])[0]
        assert sc.routing is not None and sc.routing[:n].tolist() == t.routing[:n]
        m = tr.step(Batch([s]))
    assert m["routing_replay/coverage"] == 1.0 and m["routing_replay/coverage_loss"] == 1.0


def test_coverage_reports_positions_without_recorded_routing(engine):
    t = _episode(engine, route=False)
    assert t.routing is None and t.routing_coverage() == 0.0
    s = Sample.from_trajectory(t, advantage=1.0)
    with Trainer(engine.cfg, TrainConfig(seed=0, routing_replay=True)) as tr:
        m = tr.step(Batch([s]))
    assert m["routing_replay/coverage"] == 0.0


def test_the_loop_asks_for_routing_when_routing_replay_is_on(tmp_path):
    from trainer.loop.core import Loop

    on = Loop(load(overrides=[f'out_dir="{tmp_path}"', "rl.routing_replay=true"]))
    assert on.agent_config("train").return_routed_experts and on.agent_config("swe").return_routed_experts
    assert not on.agent_config("eval").return_routed_experts          # not trained on
    off = Loop(load(overrides=[f'out_dir="{tmp_path}"']))
    assert not off.agent_config("train").return_routed_experts
