"""The Trainer: the served model (``policy.model.K3Model``) trained with expert + data parallelism.

One ``Trainer`` object is the whole training job. Rank 0 runs in the caller's process; with ``world > 1`` ranks
1..world-1 are worker processes (spawned, like the policy engine's), and every call is a typed op
(trainer/distributed/rank.py) broadcast to all ranks by the rank loop the policy engine's ranks run too
(policy/ranks.py), which run it together (gloo on CPU, NCCL on GPU). A loop calls, in order::

    trainer = Trainer(model_cfg, TrainConfig(...), world=2, ep_size=2)
    batch = rl_batch(trajectories, AdvantageConfig(...), current_version=v)     # trainer/algorithm/batch.py
    metrics = trainer.step(batch)                 # one optimizer update (or ``mini_batches`` of them)
    result = sync.push(trainer)        # trainer/distributed/sync.py: safetensors, then every server loads them
    trainer.checkpoint(ckpt_dir, data_state={...})  # model, optimizer, step, RNG, data position
    ...
    data_state = trainer.resume(ckpt_dir)         # after a crash: continue from the last checkpoint

A step: the batch's samples are split over the mini-batches (one optimizer update each), each mini-batch's samples
over the data-parallel ranks (longest first to the least loaded rank), and each rank's share into micro-batches of at
most ``micro_batch_tokens`` padded tokens; gradients accumulate over micro-batches with the token-mean denominator of
the whole mini-batch, are summed over ranks, clipped by their global norm, and AdamW steps. Ranks of one EP group
run the same number of micro-batches (a rank short of data runs a one-token micro-batch with zero loss) so that their
expert all-to-alls pair up, forward and backward.

Log-probs are computed as the serving engine computes them (``trainer.algorithm.losses.token_logprobs``); with
``routing_replay`` the MoE layers use the experts the engine recorded for every position of the episode (prompt,
tool output and generated tokens; ``routing_replay/coverage`` reports the fraction that had a recording). After
each step the routers' balancing bias moves toward balance (trainer/algorithm/balance.py, ``router_bias_rate``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import replace
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from agentenv.config import write_atomic
from policy.config import K3Config
from policy.model import K3Model
from policy.ranks import Op, Ranks, free_port, rank_device, spawn_ranks, threads_per_rank
from trainer import checkpoint as ckpt
from trainer.algorithm.batch import Batch, Sample, chunks, pack, split_ranks
from trainer.algorithm.health import merge, token_means
from trainer.distributed.parallel import init_layout
from trainer.distributed.rank import (
    FullState,
    LoadCheckpoint,
    Plan,
    Rank,
    SaveCheckpoint,
    SaveWeights,
    Score,
    Scored,
    Step,
    TrainConfig,
    serve_rank,
)

log = logging.getLogger(__name__)
R = TypeVar("R")


# --- the controller ------------------------------------------------------------------------------------------------

PLACEMENTS = ("local", "ray")


class TrainerError(RuntimeError):
    """A training rank failed a call."""


class Trainer:
    """The training job (see the module docstring); methods are called on rank 0 and run on every rank."""

    def __init__(self, model_cfg: K3Config, cfg: TrainConfig | None = None, *, world: int = 1, ep_size: int = 1,
                 weights: str | None = None, device: str = "cpu", backend: str | None = None,
                 placement: str = "local") -> None:
        """``weights``: a full safetensors file to start from (e.g. the SFT warm start); otherwise the weights of
        ``K3Model(model_cfg)`` after ``torch.manual_seed(cfg.seed)``, the same as a policy server with that seed.
        ``placement``: where ranks 1..world-1 run: "local" (processes spawned here) or "ray" (actors spread over
        the Ray cluster the caller joined: ``trainer.distributed.ray_ranks``)."""
        if world % ep_size:
            raise ValueError(f"ep_size {ep_size} does not divide world {world}")
        if placement not in PLACEMENTS:
            raise ValueError(f"trainer placement must be one of {PLACEMENTS}, got {placement!r}")
        cfg = cfg or TrainConfig()
        self.model_cfg, self.cfg, self.world, self.ep_size = model_cfg.validate(), cfg, world, ep_size
        self.procs: list[BaseProcess] = []
        self.ray_ranks: Any = None
        backend = backend or ("nccl" if device.startswith("cuda") else "gloo")
        host = self._ray_host() if world > 1 and placement == "ray" else "127.0.0.1"
        port = free_port(host)
        if world > 1 and placement == "ray":
            from trainer.distributed import ray_ranks

            try:
                self.ray_ranks = ray_ranks.start_ranks(world, ep_size, host, port, model_cfg.to_dict(),
                                                       cfg.to_dict(), weights, device, backend)
            except TimeoutError as e:
                raise TrainerError(str(e)) from e
        elif world > 1:
            self.procs = spawn_ranks(world, serve_rank, world, ep_size, port, model_cfg.to_dict(), cfg.to_dict(),
                                     weights, device, backend)
        if world > 1:
            torch.set_num_threads(threads_per_rank(world))
        dev = rank_device(device, 0)         # before the process group: NCCL binds the current device
        layout = init_layout(0, world, ep_size, port, backend, host)
        self._rank = Rank(layout, model_cfg, cfg, weights, dev)
        self._ranks = Ranks(world, self._rank.handle, TrainerError)   # the ranks' failures raise here
        self._closed = False

    @staticmethod
    def _ray_host() -> str:
        """This node's address in the Ray cluster the caller joined, where every rank meets rank 0."""
        import ray

        from trainer.distributed import ray_ranks

        if not ray.is_initialized():
            raise TrainerError("trainer placement 'ray' needs a Ray cluster: ray.init(address=...) first "
                               "(agentenv train --ray-address joins one)")
        host = ray_ranks.node_address()
        ray_ranks.use_interface_of(host)
        return host

    # -- plumbing --
    def _call(self, op: Op[R]) -> list[R]:
        """Run ``op`` on every rank (its ``per_rank[r]`` is rank r's part); returns every rank's result."""
        if self._closed:
            raise TrainerError("the trainer is closed")
        return self._ranks.call(op)

    @property
    def step_count(self) -> int:
        """Optimizer steps taken (``step`` calls), restored by ``resume``."""
        return self._rank.n_steps

    @property
    def model(self) -> K3Model:
        """Rank 0's model (its expert shard only when ``ep_size > 1``)."""
        return self._rank.model

    def lr_at(self, step: int) -> float:
        w = self.cfg.warmup_steps
        return self.cfg.lr * min(1.0, (step + 1) / w) if w > 0 else self.cfg.lr

    def _plan(self, samples: Sequence[Sample], groups: Sequence[Sequence[int]]) -> tuple[list[list[Plan]], list[float]]:
        """Per rank, per group (mini-batch), the micro-batches (lists of samples); and each group's loss tokens."""
        plans: list[list[Plan]] = [[] for _ in range(self.world)]
        denoms = []
        for idx in groups:
            part = [samples[i] for i in idx]
            denoms.append(float(max(1, sum(s.loss_tokens for s in part))))
            per_rank = []
            for ranks_idx in split_ranks([len(s) for s in part], self.world):
                mine = [part[i] for i in ranks_idx]
                per_rank.append([[mine[i] for i in mb] for mb in pack([len(s) for s in mine],
                                                                       self.cfg.micro_batch_tokens)])
            if self.ep_size > 1:   # every rank of an EP group runs as many micro-batches (empty ones: a dummy)
                n = max(len(x) for x in per_rank)
                per_rank = [x + [[] for _ in range(n - len(x))] for x in per_rank]
            for r in range(self.world):
                plans[r].append(per_rank[r])
        return plans, denoms

    # -- the API --
    def step(self, batch: Batch) -> dict[str, float]:
        """One training step on ``batch`` (``kind`` "rl": PPO-clip with TIS; "sft": masked NLL); returns metrics:
        the loss and its parts as token means, entropy, clip fraction, TIS weight, rollout/train mismatch, the
        mean pre-clip grad norm, learning rate, token counts, time, and the batch's own statistics."""
        if not batch.samples:
            raise ValueError("the batch has no sample with loss tokens")
        t0 = time.perf_counter()
        lr = self.lr_at(self.step_count)
        groups = chunks(range(len(batch.samples)), self.cfg.mini_batches if batch.kind == "rl" else 1)
        plans, denoms = self._plan(batch.samples, groups)
        results = self._call(Step(batch.kind, plans, denoms, lr))
        tot: dict[str, float] = {}
        for r in results:
            merge(tot, r)
        tot.pop("router/load_imbalance", None)   # the same figure on every rank: rank 0's below
        updates = max(results[0]["updates"], 1.0)
        elapsed = time.perf_counter() - t0
        out = {"step": float(self.step_count), "loss": tot["loss"] / updates, "lr": lr,
               "grad_norm": results[0]["grad_norm_sum"] / updates, "loss_tokens": tot["tokens"],
               "samples": float(len(batch.samples)), "tokens": float(batch.tokens), "time/train": elapsed,
               "train_tokens_per_s": batch.tokens / elapsed if elapsed > 0 else 0.0}
        out["skipped_updates"] = results[0].get("skipped_updates", 0.0)  # non-finite gradient norms, not stepped
        if "router/load_imbalance" in results[0]:
            out["router/load_imbalance"] = results[0]["router/load_imbalance"]
        out.update(token_means(tot))   # token means of the per-token metrics, extremes, replay coverage
        cov = out.get("routing_replay/coverage")
        if cov is not None and cov < 1.0:
            log.warning("routing replay: %.1f%% of the trained positions had no recorded routing and routed freely "
                        "(episodes recorded without routing, or from an engine that does not return it)",
                        100 * (1 - cov))
        return {**batch.stats, **out}

    def score(self, samples: Sequence[Sample], temperature: float | None = None) -> list[Scored]:
        """Per-token log-probs (as the server computes them, at ``temperature``, the loss's by default), entropies
        and the training forward's routing, for each sample, without training."""
        if not samples:
            return []
        temperature = self.cfg.loss.temperature if temperature is None else temperature
        plans, _ = self._plan(samples, [list(range(len(samples)))])
        results = self._call(Score([p[0] for p in plans], temperature))
        by_id: dict[int, Scored] = {}
        for r, plan in enumerate(p[0] for p in plans):
            for mb, res in zip(plan, results[r], strict=True):
                for s, sc in zip(mb, res, strict=True):
                    by_id[id(s)] = sc
        return [by_id[id(s)] for s in samples]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full (unsharded) model state, as the policy server loads it."""
        state = self._call(FullState())[0]
        assert state is not None
        return state

    def save_weights(self, path: str | os.PathLike[str]) -> Path:
        """Write the full model as a Kimi checkpoint folder at ``path`` (sharded safetensors under the on-disk names
        K3's loaders read, the index, config.json, the tokenizer: policy/hf_format.py), atomically (temporary
        folder, fsync, rename); returns the path."""
        self._call(SaveWeights(str(path)))
        return Path(path)

    def checkpoint(self, root: str | os.PathLike[str], data_state: dict[str, Any] | None = None, keep: int = 2,
                   extra: dict[str, Any] | None = None, files: dict[str, bytes] | None = None) -> Path:
        """Checkpoint the run after ``step_count`` steps: every rank's model shard, optimizer, RNG; the step and the
        caller's ``data_state`` (its data position) in ``meta.json``; ``files`` (name -> bytes) beside them.
        Atomic (trainer/checkpoint.py)."""
        step = self.step_count
        tmp = ckpt.begin(root, step)
        self._call(SaveCheckpoint(str(tmp)))
        for name, data in (files or {}).items():
            write_atomic(tmp / name, data, fsync=True)
        meta = {"data": data_state or {}, "world": self.world, "ep_size": self.ep_size,
                "model_config": self.model_cfg.to_dict(), "train_config": self.cfg.to_dict(), "time": time.time(),
                **(extra or {})}
        return ckpt.commit(root, step, tmp, meta, keep)

    def resume(self, root: str | os.PathLike[str]) -> dict[str, Any] | None:
        """Load the newest complete checkpoint under ``root``; returns its ``meta.json`` (``step``, ``data``, ...),
        or None when there is none (a fresh start)."""
        folder = ckpt.latest(root)
        if folder is None:
            return None
        meta = ckpt.read_meta(folder)
        if (meta.get("world"), meta.get("ep_size")) != (self.world, self.ep_size):
            raise ValueError(f"{folder} was written by world={meta.get('world')} ep_size={meta.get('ep_size')}; "
                             f"this trainer has world={self.world} ep_size={self.ep_size}")
        if K3Config.from_dict(meta.get("model_config", {})) != self.model_cfg:
            raise ValueError(f"{folder} holds a different model configuration")
        self._call(LoadCheckpoint(str(folder)))
        return meta

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.world > 1:
            self._ranks.stop()
            for p in self.procs:
                p.join(timeout=30)
            if self.ray_ranks is not None:
                self.ray_ranks.join()
            dist.destroy_process_group()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def with_loss(cfg: TrainConfig, **loss_overrides: Any) -> TrainConfig:
    """``cfg`` with some loss settings changed."""
    return replace(cfg, loss=replace(cfg.loss, **loss_overrides))
