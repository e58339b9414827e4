"""The parts of a training run (trainer/loop/core.py), built from its settings as torchtitan's ``TrainSpec`` builds a
trainer's: the trainer (``build_trainer``, with ``train_config``), the weight sync (``build_weight_sync``), the
rollout workers (``build_rollout``) and what they play (``agent_config``, ``job``: a phase's agent settings, a
group's job).

The loop's two parts that a unit test stands in for are typed by what the loop asks of them: ``Steps`` (the
trainer, ``trainer.train.Trainer``) and ``Pushes`` (the weight sync, ``trainer.distributed.sync.WeightSync``); the fakes of
tests/unit/trainer/loop_fakes.py satisfy them too. tests/typecheck/loop_parts.py holds the real classes to them.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from rollout.agent import AgentConfig
from rollout.harnesses import HarnessConfig
from rollout.workers import RolloutConfig
from trainer.loop.config import RunConfig
from trainer.loop.rollouts import Job, LoopRollout
from trainer.loop.tasks import TaskRef, step_limit

if TYPE_CHECKING:
    from trainer.algorithm.batch import Batch
    from trainer.distributed.sync import SyncResult, WeightSync
    from trainer.train import TrainConfig, Trainer


class Steps(Protocol):
    """What the loop asks of its trainer (``trainer.train.Trainer``): a step on a batch, checkpoints, the steps
    taken (each push names them), and a close at the end."""

    @property
    def step_count(self) -> int: ...

    def step(self, batch: Batch) -> dict[str, float]: ...

    def checkpoint(self, root: str | os.PathLike[str], data_state: dict[str, Any] | None = None, keep: int = 2, *,
                   files: dict[str, bytes] | None = None) -> Path: ...

    def close(self) -> None: ...


class Pushes(Protocol):
    """What the loop asks of its weight sync (``trainer.distributed.sync.WeightSync``): the trainer's weights to the policy
    server(s), and a close at the end."""

    def push(self, trainer: Steps) -> SyncResult: ...

    def close(self) -> None: ...


T = TypeVar("T")


def started(part: T | None, name: str) -> T:
    """``part`` once the run started it (a unit test sets its own)."""
    if part is None:
        raise RuntimeError(f"the loop's {name} has not started")
    return part


def train_config(cfg: RunConfig) -> TrainConfig:
    """The trainer's settings of a run: ``rl.*`` (the loss among them, at the rollouts' temperature), the dtype and
    the seed."""
    from trainer.algorithm.losses import LossConfig
    from trainer.train import TrainConfig

    loss = LossConfig(eps_low=cfg.rl.eps_low, eps_high=cfg.rl.eps_high,
                      tis_cap=cfg.rl.tis_cap if cfg.rl.tis_cap > 0 else None, kl_coef=cfg.rl.kl_coef,
                      temperature=cfg.env.temperature, dual_clip=cfg.rl.dual_clip)
    return TrainConfig(lr=cfg.rl.lr, warmup_steps=cfg.rl.warmup_steps, grad_clip=cfg.rl.grad_clip,
                       micro_batch_tokens=cfg.rl.micro_batch_tokens, mini_batches=cfg.rl.mini_batches,
                       routing_replay=cfg.rl.routing_replay, router_bias_rate=cfg.rl.router_bias_rate,
                       dtype=cfg.trainer.dtype, loss=loss, seed=cfg.seed)


def build_trainer(cfg: RunConfig, weights: str | None) -> Trainer:
    """The trainer (``trainer.*``: its ranks and where they run) of the policy preset, on ``weights`` (None: the
    seed's)."""
    from policy.config import model_config
    from trainer.train import Trainer

    return Trainer(model_config(cfg.policy.preset), train_config(cfg), world=cfg.trainer.world, ep_size=cfg.trainer.ep,
                   weights=weights, device=cfg.trainer.device, placement=cfg.trainer.placement)


def build_weight_sync(cfg: RunConfig, url: str, token: str | None, run_dir: Path) -> WeightSync:
    """The weight sync to the policy endpoint ``url``; pushed weights go to ``run_dir/weights``."""
    from trainer.distributed.sync import Endpoint, WeightSync

    return WeightSync([Endpoint(url, cfg.policy.kind, token)], str(run_dir / "weights"), mode=cfg.policy.sync_mode)


def build_rollout(cfg: RunConfig, url: str, token: str | None, run_dir: Path) -> LoopRollout:
    """The rollout workers (``ray.*``) on the policy endpoint ``url``; trajectories go to ``run_dir/trajectories``."""
    rc = RolloutConfig(cfg.env.id, url, policy_token=token, policy_model=cfg.policy.model or None,
                       agent=AgentConfig(), env_urls={"*": cfg.ray.env_url} if cfg.ray.env_url else None,
                       env_fleet=cfg.ray.env_fleet,
                       groups_per_worker=cfg.ray.groups_per_worker, worker_cpus=cfg.ray.worker_cpus,
                       memory_fork=cfg.ray.memory_fork, seed=cfg.seed)
    return LoopRollout(rc, workers=cfg.ray.workers, out=run_dir / "trajectories",
                       ray_address=cfg.ray.address or None, run_id=f"{cfg.name}-{time.strftime('%H%M%S')}")


def agent_config(cfg: RunConfig, phase: str) -> AgentConfig:
    """The agent's limits and sampling of a phase (train / eval / swe): evaluations sample at ``eval.temperature``
    and are not trained on, so they record no routing."""
    e = cfg.env
    route = cfg.rl.routing_replay and phase != "eval"   # trained episodes record every position's experts
    if phase == "swe":
        s = cfg.swe
        return AgentConfig(max_turns=s.max_turns, max_new_tokens=s.max_new_tokens,
                           max_total_tokens=s.max_total_tokens, context_limit=s.context_limit,
                           temperature=e.temperature, top_p=e.top_p, return_routed_experts=route)
    return AgentConfig(max_turns=e.max_turns, max_new_tokens=e.max_new_tokens, max_total_tokens=e.max_total_tokens,
                       context_limit=e.context_limit,
                       temperature=cfg.eval.temperature if phase == "eval" else e.temperature,
                       top_p=1.0 if phase == "eval" else e.top_p, system_prompt=e.system_prompt or None,
                       return_routed_experts=route)


def job(cfg: RunConfig, ref: TaskRef, phase: str, iteration: int, version: int, env_id: str | None = None) -> Job:
    """What a group of ``phase`` plays of the task ``ref`` (on ``env_id``, else ``env.id``), launched in
    ``iteration`` under weight ``version``."""
    env_id = env_id or cfg.env.id
    turns = cfg.swe.max_turns if phase == "swe" else cfg.env.max_turns
    kwargs = dict(cfg.swe.env_kwargs if phase == "swe" else cfg.env.kwargs)
    agent = agent_config(cfg, phase)
    return Job(env_id, ref.task, {**step_limit(env_id, turns), **kwargs}, agent, phase, iteration,
               cfg.ray.memory_fork, weight_version=version, harness=harness_config(cfg, agent))


def harness_config(cfg: RunConfig, agent: AgentConfig) -> HarnessConfig | None:
    """The harness that plays a phase's episodes (``env.harness``), held to that phase's limits; None: the loop."""
    e = cfg.env
    if not e.harness:
        return None
    return replace(HarnessConfig.for_loop(e.harness, dict(e.harness_agent), agent), timeout_s=e.harness_timeout_s)
