"""Model runners: one per EP rank, each holding its expert shard and the decoding caches of its sequences.

Rank 0 lives in the serving process; ranks 1..N-1 are worker processes. Every step, rank 0 broadcasts a
plan (``StepPlan``: which rank runs which sequences), all ranks run the same number of forward rounds so that their
expert all-to-alls line up, and the last-token logits come back to rank 0. The broadcast, the ranks' loop and the
gather are ``policy.ranks``'s, shared with the trainer's ranks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from policy.config import K3Config
from policy.ep import EPGroup, init_ep, shard_state_dict
from policy.hf_format import load_state, save_model
from policy.model import Cache, K3Model
from policy.ranks import Op, Ranks, free_port, rank_device, serve, spawn_ranks, threads_per_rank

log = logging.getLogger(__name__)


@dataclass
class Job:
    """Feed ``tokens`` to sequence ``seq_id``: a prefill (``fresh``, its own round) or one decode token.

    A fresh job may ``start`` from a kept prefix state (entry id) instead of an empty cache, and prefill only
    the tokens after that prefix; with no tokens at all it forks the entry (its last logits included). After a
    prefill, ``save`` keeps the state as a new entry. ``prompt_logprobs`` asks for the log-probabilities of the
    fed tokens (with that many top alternatives), ``route`` for the experts each fed position was routed to.
    """

    seq_id: int
    tokens: list[int]
    fresh: bool = False
    start: int | None = None
    save: int | None = None
    prompt_logprobs: int | None = None
    route: bool = False


@dataclass
class JobResult:
    """What a step returns for one sequence: the logits at its last position and what the job asked for.

    ``routing``: (positions fed, MoE layers, k) global expert ids; ``prompt_logprobs``: for each fed token after
    the first, ``(logprob, rank, [(token, logprob), ...top alternatives])``.
    """

    logits: torch.Tensor
    routing: torch.Tensor | None = None
    prompt_logprobs: list[tuple[float, int, list[tuple[int, float]]]] | None = None


@dataclass
class Entry:
    """A kept prefix state: the cache after its tokens and, when kept right after a prefill, the logits and the
    routing of its last position (so that a request for exactly those tokens needs no forward at all)."""

    cache: Cache
    logits: torch.Tensor | None = None
    routing: torch.Tensor | None = None


StepResult = tuple[dict[int, JobResult], torch.Tensor]   # each sequence's result, and the rank's expert load


@dataclass(frozen=True)
class StepPlan(Op[StepResult]):
    """One engine step on every rank: ``jobs[r]`` are rank r's; ``keep`` (sequence, entry) pairs become prefix
    entries and ``free`` sequences are freed before the jobs, ``drop`` entries go after them."""

    jobs: list[list[Job]]
    free: list[int]
    keep: list[tuple[int, int]]
    drop: list[int]


@dataclass(frozen=True)
class LoadWeights(Op[None]):
    """Every rank loads its shard of the checkpoint ``path`` (rank 0 checked it before sending this)."""

    path: str
    replied: ClassVar[bool] = False


def _prompt_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[tuple[float, int, list[tuple[int, float]]]]:
    """Log-probabilities of ``tokens[1:]`` under ``logits[:-1]`` (T, vocab), their ranks and ``top`` alternatives."""
    lp = torch.log_softmax(logits[:-1].float(), -1)
    nxt = torch.tensor(tokens[1:], dtype=torch.long, device=lp.device)
    chosen = lp.gather(-1, nxt[:, None])[:, 0]
    ranks = (lp > chosen[:, None]).sum(-1) + 1
    alts = lp.topk(min(top, lp.shape[-1]), dim=-1) if top > 0 else None
    out = []
    for i in range(len(tokens) - 1):
        others = ([] if alts is None else
                  list(zip(alts.indices[i].tolist(), alts.values[i].tolist(), strict=True)))
        out.append((float(chosen[i]), int(ranks[i]), others))
    return out


def save_weights(model: K3Model, path: str) -> None:
    """Write a full (unsharded) model as a Kimi checkpoint folder (policy/hf_format.py)."""
    save_model(model.state_dict(), model.cfg, path)


class Runner:
    """Runs jobs on one rank's model shard and keeps its sequences' caches."""

    def __init__(self, cfg: K3Config, ep: EPGroup | None, seed: int = 0, weights: str | None = None,
                 device: str = "cpu") -> None:
        self.cfg, self.ep, self.device = cfg, ep, torch.device(device)
        torch.manual_seed(seed)
        full = K3Model(cfg)                     # identical on every rank: same seed
        self.model = K3Model(cfg, ep) if ep and ep.world > 1 else full
        if weights:
            self.load_state(load_state(weights, cfg, ep))
        else:
            self.load_state(shard_state_dict(full.state_dict(), ep) if ep and ep.world > 1 else full.state_dict())
        self.model.to(self.device).eval()
        self.caches: dict[int, Cache] = {}
        self.entries: dict[int, Entry] = {}  # kept prefix states, by the engine's entry id

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load this rank's shard of a checkpoint (``hf_format.load_state``); refuses before touching weights."""
        own = self.model.state_dict()
        if set(state) != set(own):
            raise ValueError(f"checkpoint keys differ from the model's (missing {sorted(set(own) - set(state))[:3]}, "
                             f"unexpected {sorted(set(state) - set(own))[:3]})")
        wrong = [k for k, v in state.items() if v.shape != own[k].shape]
        if wrong:
            raise ValueError(f"checkpoint shapes differ from the model's for {wrong[:3]}")
        self.model.load_state_dict({k: v.to(own[k].device) for k, v in state.items()})

    @staticmethod
    def rounds(jobs: list[Job]) -> int:
        """Forward rounds for ``jobs``: one per prefill with tokens plus one for all decodes (forks need none)."""
        prefills = sum(1 for j in jobs if j.fresh and j.tokens)
        return prefills + (1 if any(not j.fresh for j in jobs) else 0)

    @torch.no_grad()
    def execute(self, jobs: list[Job], n_rounds: int) -> tuple[dict[int, JobResult], torch.Tensor]:
        """Run ``jobs`` padded to ``n_rounds`` rounds; return each sequence's result and this rank's expert load.

        Prefills run first (in order, so a later one may start from an entry an earlier one saved), then forks
        of kept entries, then one batched round for every decode."""
        out: dict[int, JobResult] = {}
        moes = self.model.moe_layers()
        load = torch.zeros(len(moes), moes[0].experts.w_gate.shape[0], dtype=torch.long) if moes else torch.zeros(0, 0)
        done = 0
        for j in (j for j in jobs if j.fresh and j.tokens):
            start = self.entries[j.start].cache.copy() if j.start is not None else None
            logits, cache = self.model(torch.tensor([j.tokens], device=self.device), start)
            self.caches[j.seq_id] = cache
            routing = self.model.last_routing(1, len(j.tokens))[0].cpu()
            last = logits[0, -1].float().cpu()
            res = JobResult(last, routing if j.route else None)
            if j.prompt_logprobs is not None:
                res.prompt_logprobs = _prompt_logprobs(logits[0], j.tokens, j.prompt_logprobs)
            if j.save is not None:
                self.entries[j.save] = Entry(cache.copy(), last, routing[-1])
            out[j.seq_id] = res
            load += torch.stack([m.tokens_per_expert for m in moes]) if moes else 0
            done += 1
        for j in (j for j in jobs if j.fresh and not j.tokens):
            assert j.start is not None
            entry = self.entries[j.start]
            assert entry.logits is not None and entry.routing is not None, "a fork needs an entry kept after a prefill"
            self.caches[j.seq_id] = entry.cache.copy()
            out[j.seq_id] = JobResult(entry.logits, entry.routing[None] if j.route else None)
        decodes = [j for j in jobs if not j.fresh]
        if decodes:
            batch = Cache.stack([self.caches[j.seq_id] for j in decodes])
            ids = torch.tensor([j.tokens for j in decodes], device=self.device)
            logits, new = self.model(ids, batch)
            routing = self.model.last_routing(len(decodes), 1).cpu()
            for i, (j, c, row) in enumerate(zip(decodes, new.unstack(), logits[:, -1], strict=True)):
                self.caches[j.seq_id] = c
                out[j.seq_id] = JobResult(row.float().cpu(), routing[i] if j.route else None)
            load += torch.stack([m.tokens_per_expert for m in moes]) if moes else 0
            done += 1
        for _ in range(n_rounds - done):
            self.model.idle_step()
        return out, load

    def free(self, seq_ids: list[int]) -> None:
        for s in seq_ids:
            self.caches.pop(s, None)

    def handle(self, op: StepPlan | LoadWeights) -> StepResult | None:
        """Apply one broadcast op on this rank. A plan: keep finished sequences' states as entries, free them, run
        the jobs, then drop the entries the engine evicted (after the jobs, which may still start from them)."""
        if isinstance(op, LoadWeights):
            self.entries.clear()  # states computed with the old weights
            try:
                self.load_state(load_state(op.path, self.cfg, self.ep))
            except Exception:
                log.exception("rank %s could not load %s", self.ep.rank if self.ep else 0, op.path)
            return None
        for seq_id, entry_id in op.keep:
            if seq_id in self.caches:  # only the rank that ran the sequence holds it
                self.entries[entry_id] = Entry(self.caches[seq_id].copy())
        self.free(op.free)
        jobs = op.jobs[self.ep.rank if self.ep else 0]
        result = self.execute(jobs, max(self.rounds(js) for js in op.jobs))
        for entry_id in op.drop:
            self.entries.pop(entry_id, None)
        return result


def _worker(rank: int, world: int, port: int, cfg: dict[str, Any], seed: int, weights: str | None, device: str) -> None:
    torch.set_num_threads(threads_per_rank(world))
    dev = rank_device(device, rank)
    ep = init_ep(rank, world, port, backend="nccl" if dev.startswith("cuda") else "gloo")
    serve(rank, Runner(K3Config.from_dict(cfg), ep, seed, weights, dev).handle, until_gone=True)


class RankGroup:
    """Rank 0's view of all EP ranks: broadcast a plan, run its own share, gather every rank's results."""

    def __init__(self, cfg: K3Config, ep_size: int = 1, seed: int = 0, weights: str | None = None,
                 device: str = "cpu") -> None:
        self.procs: list[BaseProcess] = []
        if ep_size > 1:
            port = free_port()
            self.procs = spawn_ranks(ep_size, _worker, ep_size, port, cfg.to_dict(), seed, weights, device)
            torch.set_num_threads(threads_per_rank(ep_size))
            dev = rank_device(device, 0)
            ep = init_ep(0, ep_size, port, backend="nccl" if dev.startswith("cuda") else "gloo")
            self.runner = Runner(cfg, ep, seed, weights, dev)
        else:
            self.runner = Runner(cfg, None, seed, weights, device)
        self.ranks = Ranks(ep_size, self.runner.handle)

    @property
    def world(self) -> int:
        """The EP ranks this group runs on (1 once closed)."""
        return self.ranks.world

    def step(self, jobs: list[list[Job]], free: list[int], keep: list[tuple[int, int]] | None = None,
             drop: list[int] | None = None) -> StepResult:
        """Run one step; ``jobs[r]`` are rank r's. ``keep`` (sequence, entry) pairs become prefix entries before
        ``free`` is freed; ``drop`` entries go after the jobs. Returns results per sequence and the load
        (layers, experts)."""
        gathered = self.ranks.call(StepPlan(jobs, free, keep or [], drop or []))
        if self.world == 1:
            return gathered[0]
        results = {k: v for r in gathered for k, v in r[0].items()}
        return results, torch.cat([r[1] for r in gathered], dim=1)

    def load(self, path: str) -> None:
        """Check the checkpoint on rank 0, then have every rank load its shard of it."""
        self.runner.load_state(load_state(path, self.runner.cfg, self.runner.ep))  # raises (nothing sent) on a missing or mismatched file
        self.runner.entries.clear()
        self.ranks.send(LoadWeights(path))

    def close(self) -> None:
        if self.world > 1:
            self.ranks.stop()
            for p in self.procs:
                p.join(timeout=10)
            dist.destroy_process_group()
            self.ranks.world = 1
