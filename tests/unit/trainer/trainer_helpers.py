"""Shared pieces of the trainer tests: a tiny K3 configuration and synthetic trajectories."""

from __future__ import annotations

import random

from policy.config import k3_mini
from rollout.trajectory import Trajectory, Turn

VOCAB = 64


def tiny_cfg(**kw):
    """K3's architecture (dense first layer, KDA + MLA, AttnRes, LatentMoE) at toy size: fast on one CPU core."""
    base = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, intermediate_size=64,
                kda_layers=(1, 2, 3), full_attn_layers=(4,), linear_num_heads=2, linear_head_dim=16, kda_chunk_size=8,
                num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                v_head_dim=8, attn_res_block_size=1, num_experts=8, num_experts_per_token=2,
                moe_intermediate_size=16, routed_expert_hidden_size=16)
    base.update(kw)
    return k3_mini(**base)


def make_traj(rng: random.Random, group: str = "", index: int = 0, reward: float | None = 1.0, prompt: int = 5,
              turns: int = 2, gen: int = 4, tool: int = 3, finish: str = "submitted", version: int = 0,
              routing: tuple[int, int] | None = None) -> Trajectory:
    """A multi-turn episode: prompt, then per turn ``gen`` generated tokens (random log-probs) and a tool output."""
    t = Trajectory(task_id="t", env_id="e", group_id=group, group_index=index, reward=reward, finish_reason=finish)
    t.append([rng.randrange(VOCAB) for _ in range(prompt)], generated=False)
    t.prompt_len = prompt
    for k in range(turns):
        start = len(t.token_ids)
        t.append([rng.randrange(VOCAB) for _ in range(gen)], generated=True,
                 logprobs=[-rng.uniform(0.5, 4.0) for _ in range(gen)])
        t.turns.append(Turn(start=start, generated=gen, weight_version=version))
        if k < turns - 1:
            t.append([rng.randrange(VOCAB) for _ in range(tool)], generated=False)
    if routing is not None:
        layers, k = routing
        t.routing = [[rng.sample(range(8), k) for _ in range(layers)] for _ in range(len(t.token_ids) - 1)]
    return t.check()


def ep_config():
    """The float64 training settings of the parallelism tests (mini-batches, routing replay, KL, TIS)."""
    from trainer.algorithm.losses import LossConfig
    from trainer.train import TrainConfig

    return TrainConfig(lr=1e-3, micro_batch_tokens=40, dtype="float64", mini_batches=2, routing_replay=True,
                       loss=LossConfig(kl_coef=0.1, tis_cap=2.0))


def ep_batches(groups: int, size: int, n: int = 2):
    """``n`` RL batches of ``groups`` groups of ``size`` episodes (seeded), routing recorded for 3 layers x 2."""
    from trainer.algorithm.batch import rl_batch

    rng = random.Random(0)
    out = []
    for b in range(n):
        trajs = [make_traj(rng, f"g{b}-{g}", i, float(rng.random() < 0.5), gen=rng.randint(2, 7),
                           turns=rng.randint(1, 3), routing=(3, 2)) for g in range(groups) for i in range(size)]
        out.append(rl_batch(trajs))
    return out
