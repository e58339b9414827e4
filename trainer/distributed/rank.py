"""One training process (rank) of the Trainer: its shard of the model, its optimizer, its step.

``Rank`` holds what a rank owns (the model with its experts sharded over the EP group, AdamW over its parameters)
and handles the controller's ops (``RankOp``): a step over its share of the batch (micro-batches, gradient
all-reduce, clip, update, the router bias), scoring, saving and loading. Rank 0 lives in the Trainer's process
(trainer/train.py); ``serve_rank`` runs ranks 1..world-1, spawned processes (or Ray actors) that take each op by
broadcast in ``policy.ranks``'s loop and report their failures to rank 0.
"""


from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from agentenv.config import replacing
from policy.config import K3Config
from policy.ep import shard_state_dict
from policy.hf_format import load_state, save_model
from policy.model import K3Model
from policy.ranks import Op, rank_device, serve, threads_per_rank
from trainer import checkpoint as ckpt
from trainer.algorithm.balance import expert_load, reduce_load, update_router_bias
from trainer.algorithm.batch import MicroBatch, Sample, collate
from trainer.algorithm.health import merge, replay_coverage
from trainer.algorithm.losses import LossConfig, policy_loss, sft_loss, token_logprobs
from trainer.distributed.parallel import Layout, all_reduce_grads, grad_norm, init_layout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    """Optimiser, batching and loss settings of a training run."""

    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.01
    adam_eps: float = 1e-8
    warmup_steps: int = 0           # linear warm-up of the learning rate over the first steps
    grad_clip: float = 1.0          # max global grad norm (<= 0: no clipping)
    micro_batch_tokens: int = 4096  # padded tokens (samples x longest) per forward/backward
    mini_batches: int = 1           # optimizer updates per batch; > 1 computes the old log-probs first
    routing_replay: bool = False    # replay the rollout's recorded expert routing in the forward pass
    router_bias_rate: float = 0.0   # aux-loss-free balancing: bias step per training step (0: the bias stays)
    dtype: str = "float32"          # parameter dtype ("float64" for exact comparisons in tests)
    deterministic: bool = True      # deterministic kernels: with 2 threads the CPU backward of indexing adds in any
    # order, and the warm start of one seed drifted to a held-out mean@8 of 0.26 against 0.47 (~25% slower steps)
    loss: LossConfig = field(default_factory=LossConfig)
    seed: int = 0                   # initial weights (the same seed gives the policy server's initial weights)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        d = dict(d)
        if "loss" in d:
            d["loss"] = LossConfig(**d["loss"])
        if "betas" in d:
            d["betas"] = tuple(d["betas"])
        return cls(**d)


@dataclass
class Scored:
    """A sample scored by the training forward: per-position log-probs and entropy (index t scores token t;
    index 0 is 0.0) and, per position that produced a token, the experts the training forward routed it to."""

    logprobs: list[float]
    entropy: list[float]
    routing: torch.Tensor | None      # (len - 1, MoE layers, k): position t - 1 produced token t


# --- the ops rank 0 sends (policy.ranks broadcasts them); ``per_rank[r]``: rank r's part ------------------------------

Plan = list[list[Sample]]   # micro-batches of samples


@dataclass(frozen=True)
class Step(Op[dict[str, float]]):
    """A training step: per rank, per mini-batch, its micro-batches; each mini-batch's loss tokens; the lr."""

    kind: str
    per_rank: list[list[Plan]]
    denoms: list[float]
    lr: float


@dataclass(frozen=True)
class Score(Op[list[list["Scored"]]]):
    """Score each rank's micro-batches at ``temperature``, without training."""

    per_rank: list[Plan]
    temperature: float


@dataclass(frozen=True)
class SaveWeights(Op[None]):
    """The full model as a Kimi checkpoint folder at ``path`` (policy/hf_format.py; written by global rank 0)."""

    path: str


@dataclass(frozen=True)
class FullState(Op[dict[str, torch.Tensor] | None]):
    """The unsharded model state (on global rank 0; None elsewhere)."""


@dataclass(frozen=True)
class SaveCheckpoint(Op[None]):
    """Every rank's file of a checkpoint in the folder ``tmp``."""

    tmp: str


@dataclass(frozen=True)
class LoadCheckpoint(Op[int]):
    """Every rank's file of the checkpoint ``folder``; the step it was taken at."""

    folder: str


RankOp = Step | Score | SaveWeights | FullState | SaveCheckpoint | LoadCheckpoint


# --- one rank ------------------------------------------------------------------------------------------------------

class Rank:
    """A training rank: its model shard, optimizer, and the work of every call."""

    def __init__(self, layout: Layout, model_cfg: K3Config, cfg: TrainConfig, weights: str | None, device: str) -> None:
        self.layout, self.cfg, self.model_cfg = layout, cfg, model_cfg
        self.device = torch.device(device)
        torch.use_deterministic_algorithms(cfg.deterministic, warn_only=True)
        torch.manual_seed(cfg.seed)
        full = K3Model(model_cfg)                 # identical on every rank, and to a policy server's of this seed
        own = shard_state_dict(full.state_dict(), layout.ep) if layout.ep.world > 1 else full.state_dict()
        self.model = K3Model(model_cfg, layout.ep) if layout.ep.world > 1 else full
        self.model.load_state_dict(load_state(weights, model_cfg, layout.ep) if weights else own)
        self.dtype = getattr(torch, cfg.dtype)
        self.model.to(self.device, self.dtype).train()
        self.ref: K3Model | None = None
        if cfg.loss.kl_coef > 0:
            self.ref = K3Model(model_cfg, layout.ep if layout.ep.world > 1 else None)
            self.ref.load_state_dict(self.model.state_dict())
            self.ref.to(self.device, self.dtype).eval().requires_grad_(False)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.adam_eps,
                                     weight_decay=cfg.weight_decay)
        self.n_steps = 0
        moes = self.model.moe_layers()
        self.routing_shape = (len(moes), moes[0].router.k) if moes else None

    # -- forward helpers --
    @contextlib.contextmanager
    def _replay(self, model: K3Model, mb: MicroBatch | None) -> Iterator[None]:
        moes = model.moe_layers()
        if mb is not None and mb.routing is not None and self.cfg.routing_replay:
            for i, m in enumerate(moes):
                m.replay = mb.routing[:, :, i].reshape(-1, mb.routing.shape[-1])
        try:
            yield
        finally:
            for m in moes:
                m.replay = None

    def _collate(self, samples: Sequence[Sample]) -> MicroBatch:
        shape = self.routing_shape if self.cfg.routing_replay else None
        return collate(samples, self.model_cfg.pad_token_id, shape).to(self.device)

    def _logits(self, model: K3Model, mb: MicroBatch) -> torch.Tensor:
        with self._replay(model, mb):
            logits, _ = model(mb.input_ids)
        return logits

    def _dummy(self, model: K3Model) -> torch.Tensor:
        """Logits of a one-token forward (a rank with no data this round keeps its EP group's all-to-alls paired)."""
        ids = torch.full((1, 1), self.model_cfg.pad_token_id, dtype=torch.long, device=self.device)
        logits, _ = model(ids)
        return logits

    # -- calls --
    def step(self, kind: str, plan: list[list[list[Sample]]], denoms: list[float], lr: float) -> dict[str, float]:
        """One step: for each mini-batch, accumulate its micro-batches' gradients, reduce, clip, update."""
        t0 = time.perf_counter()
        temperature = self.cfg.loss.temperature if kind == "rl" else 1.0
        old: list[list[torch.Tensor | None]] | None = None
        if kind == "rl" and len(plan) > 1:   # log-probs before any update of this step: the PPO ratio's denominator
            with torch.no_grad():
                old = [[self._old_logprobs(samples, temperature) for samples in mini] for mini in plan]
        sums: dict[str, float] = defaultdict(float)
        norms = []
        load: torch.Tensor | None = None
        for j, mini in enumerate(plan):
            self.opt.zero_grad(set_to_none=False)
            for i, samples in enumerate(mini):
                if not samples:
                    if self.ref is not None and kind == "rl":
                        with torch.no_grad():
                            self._dummy(self.ref)
                    (self._dummy(self.model).sum() * 0.0).backward()
                    continue
                mb = self._collate(samples)
                ref_lp = None
                if self.ref is not None and kind == "rl":
                    with torch.no_grad():
                        ref_lp, _ = token_logprobs(self._logits(self.ref, mb), mb.targets, temperature)
                logp, entropy = token_logprobs(self._logits(self.model, mb), mb.targets, temperature)
                got = expert_load(self.model, mb.positions)
                load = got if load is None else load + got
                if self.cfg.routing_replay and mb.routing is not None:
                    merge(sums, replay_coverage(mb))
                if kind == "sft":
                    loss = sft_loss(logp, mb.mask, denoms[j])
                    with torch.no_grad():
                        s = {"tokens": float(mb.mask.sum()), "nll": float(-(logp * mb.mask).sum()),
                             "entropy": float((entropy * mb.mask).sum())}
                else:
                    old_lp = old[j][i] if old is not None else logp.detach()
                    assert old_lp is not None
                    loss, s = policy_loss(logp, old_lp, mb.rollout_logprobs, mb.advantages, mb.mask, self.cfg.loss,
                                          denoms[j], ref_lp, entropy)
                loss.backward()
                merge(sums, s)
                sums["loss"] += float(loss.detach())
            for p in self.model.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            all_reduce_grads(self.model, self.layout)
            norm = grad_norm(self.model, self.layout)  # reduced: every rank sees the same figure, so all skip
            if not math.isfinite(float(norm)):  # clipping by nan is no clip (min(1, nan) is 1): the weights would be
                sums["skipped_updates"] += 1.0  # non-finite from here on, and pushed to the server
                log.warning("a non-finite gradient norm (%s): this update is skipped", float(norm))
                continue
            norms.append(float(norm))
            if self.cfg.grad_clip > 0:
                coef = min(1.0, self.cfg.grad_clip / (float(norm) + 1e-6))
                if coef < 1.0:
                    for p in self.model.parameters():
                        if p.grad is not None:
                            p.grad.mul_(coef)
            for g in self.opt.param_groups:
                g["lr"] = lr
            self.opt.step()
        if kind == "rl" and self.routing_shape is not None:   # every rank joins the reduction, with or without data
            total = reduce_load(load, (self.routing_shape[0], self.model_cfg.num_experts), self.layout.distributed)
            sums.update(update_router_bias(self.model, total, self.cfg.router_bias_rate if norms else 0.0))
        self.n_steps += 1
        sums["grad_norm_sum"] = sum(norms)
        sums["updates"] = float(len(norms))
        sums["rank_train_s"] = time.perf_counter() - t0
        return dict(sums)

    def _old_logprobs(self, samples: Sequence[Sample], temperature: float) -> torch.Tensor | None:
        if not samples:
            self._dummy(self.model)
            return None
        return self._score(samples, temperature)[0]

    def _score(self, samples: Sequence[Sample], temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mb = self._collate(samples)
        logp, entropy = token_logprobs(self._logits(self.model, mb), mb.targets, temperature)
        routing = self.model.last_routing(*mb.input_ids.shape)
        return logp, entropy, routing

    @torch.no_grad()
    def score(self, plan: list[list[Sample]], temperature: float) -> list[list[Scored]]:
        """Log-probs, entropies and routing of each micro-batch's samples (an empty micro-batch: a dummy)."""
        out: list[list[Scored]] = []
        for samples in plan:
            if not samples:
                self._dummy(self.model)
                out.append([])
                continue
            logp, entropy, routing = self._score(samples, temperature)
            res = []
            for b, s in enumerate(samples):
                n = len(s) - 1
                res.append(Scored([0.0, *logp[b, :n].cpu().tolist()], [0.0, *entropy[b, :n].cpu().tolist()],
                                  routing[b, :n].cpu() if routing.numel() else None))
            out.append(res)
        return out

    def full_state(self) -> dict[str, torch.Tensor] | None:
        """The unsharded model state on global rank 0 (expert shards gathered over the EP group); None elsewhere."""
        state = {k: v.detach() for k, v in self.model.state_dict().items()}
        if self.layout.ep.world > 1:
            for name, t in list(state.items()):
                if ".experts." in name:
                    parts = [torch.empty_like(t) for _ in range(self.layout.ep.world)]
                    dist.all_gather(parts, t.contiguous(), group=self.layout.ep.group)
                    state[name] = torch.cat(parts)
        return {k: v.cpu().contiguous() for k, v in state.items()} if self.layout.rank == 0 else None

    def save_weights(self, path: str) -> None:
        state = self.full_state()
        if state is not None:
            save_model(state, self.model_cfg, path)

    def save_checkpoint(self, tmp: str) -> None:
        ckpt.save_rank(Path(tmp), self.layout.rank, {
            "model": self.model.state_dict(), "optimizer": self.opt.state_dict(), "step": self.n_steps,
            "rng": ckpt.rng_state(), "ref": self.ref.state_dict() if self.ref is not None else None})

    def load_checkpoint(self, folder: str) -> int:
        state = torch.load(ckpt.rank_file(folder, self.layout.rank), map_location=self.device, weights_only=False)
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        if self.ref is not None and state.get("ref") is not None:
            self.ref.load_state_dict(state["ref"])
        self.n_steps = int(state["step"])
        ckpt.set_rng_state(state["rng"])
        return self.n_steps

    def handle(self, op: RankOp) -> object:
        """Run one op of rank 0's on this rank, with this rank's part of it."""
        if isinstance(op, Step):
            return self.step(op.kind, op.per_rank[self.layout.rank], op.denoms, op.lr)
        if isinstance(op, Score):
            return self.score(op.per_rank[self.layout.rank], op.temperature)
        if isinstance(op, SaveWeights):
            self.save_weights(op.path)
            return None
        if isinstance(op, FullState):
            return self.full_state()
        if isinstance(op, SaveCheckpoint):
            self.save_checkpoint(op.tmp)
            return None
        if isinstance(op, LoadCheckpoint):
            return self.load_checkpoint(op.folder)
        raise ValueError(f"unknown op {op!r}")


def write_safetensors_atomic(state: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> Path:
    """Write ``state`` as safetensors through a temporary file in the same folder, fsync, rename: a server never
    reads a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path, fsync=True) as f:
        save_file(state, f.name, metadata=metadata)  # safetensors writes by path: the same file
    ckpt.fsync_path(path.parent)
    return path


def serve_rank(rank: int, world: int, ep_size: int, port: int, model_cfg: dict[str, Any], cfg: dict[str, Any],
               weights: str | None, device: str, backend: str, host: str = "127.0.0.1",
               local_rank: int | None = None) -> None:
    """Rank ``rank``'s loop: join the group on ``host:port``, then run rank 0's ops until it says stop;
    ``local_rank``: its GPU's index on its machine (default: ``rank``, every rank on one machine)."""
    torch.set_num_threads(threads_per_rank(world))
    dev = rank_device(device, rank if local_rank is None else local_rank)
    layout = init_layout(rank, world, ep_size, port, backend, host)
    r = Rank(layout, K3Config.from_dict(model_cfg), TrainConfig.from_dict(cfg), weights, dev)
    serve(rank, r.handle, report=True)
