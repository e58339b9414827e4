"""The generation engine: continuous batching over the EP ranks, sampling, logprobs and weight versions.

A background thread runs steps: new sequences join (prefill) and finished ones leave between decode steps,
so concurrent requests share the running batch. Weight updates land between steps and bump the version.

Prefix reuse (``policy.prefix_cache``): the decoding state at the end of a served prompt and of a finished
sequence is kept (on the rank that computed it, in a bounded LRU); a new sequence whose prompt extends a kept
prefix starts from a copy of that state and prefills only the rest, and a prompt kept with its last logits
(the ``n`` samples of one request, a GRPO group) is forked without any forward. Requests asking for
``prompt_logprobs`` prefill their whole prompt (the logprobs of a reused prefix were never computed here).
Routing is kept with the states it belongs to: an entry made by a sequence that recorded its experts
(``return_routed_experts``) keeps the routing of every one of its positions (on rank 0, ``Engine._routes``), and a
sequence that asks for routing starts only from such an entry, so its ``prompt_routed_experts`` cover every prompt
position, reused or prefilled (routing depends only on the prefix and the weights, and entries are dropped when the
weights change).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from policy.config import K3Config
from policy.grammar import Constraint
from policy.prefix_cache import PrefixIndex, state_nbytes
from policy.runner import Job, JobResult, RankGroup
from policy.tokenizer import K3Tokenizer

log = logging.getLogger(__name__)


@dataclass
class SamplingParams:
    """How to sample one sequence (OpenAI semantics; ``temperature == 0`` is greedy)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: int | None = None       # logprobs of the prompt tokens, with this many top alternatives
    return_routed_experts: bool = False      # record the experts behind every generated token
    grammar: str | None = None               # an llguidance grammar the output must follow (policy.grammar)


@dataclass
class Sequence:
    """One generation: its tokens, logprobs, decoded text and why it finished.

    ``cached_tokens``: prompt tokens whose state came from the prefix cache (not prefilled for this sequence).
    ``prompt_logprobs[i]``: ``(logprob, rank, top alternatives)`` of prompt token ``i + 1``.
    ``routed_experts[j][l]``: the k experts MoE layer l routed to at the position that produced output token j
    (the last prompt token for j = 0, else output token j - 1); ``prompt_routed_experts[p]`` the same for
    prompt position p < len(prompt) - 1 (from the prefix entry's kept routing where the state came from one).
    """

    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    listener: Callable[[Sequence], None] | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    abort_reason: str | None = None
    weight_version: int = 0
    rank: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    generator: torch.Generator = field(default_factory=torch.Generator)
    cached_tokens: int = 0
    prompt_logprobs: list[tuple[float, int, list[tuple[int, float]]]] | None = None
    routed_experts: list[list[list[int]]] = field(default_factory=list)
    prompt_routed_experts: list[list[list[int]] | None] | None = None
    constraint: Constraint | None = None
    start_entry: int | None = None   # prefix entry the prefill starts from
    save_entry: int | None = None    # entry the state after the prefill is kept as


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> tuple[int, float]:
    """Sample a token with temperature and nucleus (top-p); return it with its log-probability under the
    distribution it was actually drawn from: temperature-scaled, and with ``top_p < 1`` truncated to the nucleus and
    renormalised (``log p_T(tok) - log sum_{nucleus} p_T``); the plain distribution when greedy."""
    logits = logits.float()
    if params.temperature <= 0:
        lp = torch.log_softmax(logits, -1)
        tok = int(torch.argmax(logits))
        return tok, float(lp[tok])
    lp = torch.log_softmax(logits / params.temperature, -1)
    probs = lp.exp()
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < params.top_p      # always keeps the most likely token
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
        lp = torch.full_like(lp, float("-inf")).scatter(0, order[keep], lp[order[keep]])
        lp = lp - torch.logsumexp(lp, -1)                          # renormalised over the nucleus
    tok = int(torch.multinomial(probs, 1, generator=gen))
    return tok, float(lp[tok])


class Engine:
    """Schedules sequences onto the EP ranks and runs decode steps in a background thread."""

    def __init__(self, cfg: K3Config, tokenizer: K3Tokenizer, ep_size: int = 1, seed: int = 0,
                 weights: str | None = None, max_batch: int = 32, max_context: int = 4096, device: str = "cpu",
                 prefix_cache_bytes: int = 256 << 20, prefix_cache_entries: int = 256) -> None:
        """``prefix_cache_bytes`` (0 turns reuse off) and ``prefix_cache_entries`` bound the kept prefix states
        over all ranks together."""
        self.cfg, self.tokenizer = cfg, tokenizer
        self.max_batch, self.max_context = max_batch, max_context
        self.group = RankGroup(cfg, ep_size, seed, weights, device)
        self.weight_version = 0
        self._ids = itertools.count()
        self._cv = threading.Condition()
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._fresh: set[int] = set()
        self._to_free: list[int] = []
        self._to_keep: list[tuple[int, int]] = []  # (sequence, entry): finished states to keep, sent next step
        self._to_drop: list[int] = []
        self.prefix = PrefixIndex(prefix_cache_bytes, prefix_cache_entries)
        self._routes: dict[int, list[list[list[int]]]] = {}  # entry id -> routing of each of its positions
        self._update: tuple[str, str, threading.Event, list[Any]] | None = None
        self._stop = False
        n_moe = sum(1 for i in range(cfg.num_hidden_layers) if not cfg.is_dense(i))
        # prefill_tokens: prompt tokens computed; prefill_tokens_saved: prompt tokens taken from kept states
        self.stats: dict[str, Any] = {"steps": 0, "decode_tokens": 0, "prompt_tokens": 0, "prefill_tokens": 0,
                                      "prefill_tokens_saved": 0, "prefix_hits": 0, "prefix_forks": 0,
                                      "max_batch_seen": 0, "requests_finished": 0, "step_seconds_total": 0.0}
        self.expert_load_total = torch.zeros(n_moe, cfg.num_experts, dtype=torch.long)
        self.expert_load_last = torch.zeros_like(self.expert_load_total)
        self._thread = threading.Thread(target=self._loop, name="policy-engine", daemon=True)
        self._thread.start()

    # ---- public API -------------------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams,
               listener: Callable[[Sequence], None] | None = None) -> Sequence:
        """Queue a sequence; ``listener`` is called (from the engine thread) after each token and at the end."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= self.max_context:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; the context is {self.max_context}")
        if any(not 0 <= t < self.cfg.vocab_size for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.cfg.vocab_size})")
        seq = Sequence(next(self._ids), list(prompt_ids), params, listener)
        if params.grammar is not None:
            seq.constraint = Constraint(self.tokenizer, params.grammar)  # raises ValueError on a bad grammar
        seq.generator.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, ())))
        with self._cv:
            self._waiting.append(seq)
            self._cv.notify()
        return seq

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Sequence]:
        """Blocking helper: submit all prompts at once and wait for them."""
        seqs = [self.submit(p, params) for p in prompts]
        for s in seqs:
            s.done.wait()
        return seqs

    def update_weights(self, path: str, mode: str = "drain", timeout: float = 600.0) -> int:
        """Load a checkpoint (a Kimi checkpoint folder, or a .safetensors file under our own names) between steps and
        bump the weight version.

        ``drain``: running sequences finish on the old weights first (new ones wait); ``abort``: they end
        now with ``finish_reason="abort"`` and ``abort_reason="weights_updated"``.
        """
        if mode not in ("drain", "abort"):
            raise ValueError("mode must be 'drain' or 'abort'")
        done, box = threading.Event(), list[Any]()
        with self._cv:
            if self._update is not None:
                raise RuntimeError("a weight update is already in progress")
            self._update = (path, mode, done, box)
            self._cv.notify()
        if not done.wait(timeout):
            raise TimeoutError("weight update did not complete")
        if box and isinstance(box[0], Exception):
            raise box[0]
        return self.weight_version

    def metrics(self) -> dict[str, Any]:
        with self._cv:
            prefix = {"entries": len(self.prefix), "bytes": self.prefix.nbytes, "max_bytes": self.prefix.max_bytes,
                      "max_entries": self.prefix.max_entries, "evictions": self.prefix.evictions}
            return {**self.stats, "running": len(self._running), "waiting": len(self._waiting),
                    "prefix_cache": prefix, "weight_version": self.weight_version, "ep_size": self.group.world,
                    "tokens_per_expert_last_step": self.expert_load_last.tolist(),
                    "tokens_per_expert_total": self.expert_load_total.tolist()}

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=30)
        self.group.close()

    # ---- the loop -----------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._stop or self._waiting or self._running or self._update):
                    self._cv.wait()
                if self._stop:
                    return
            try:
                self._maybe_update()
                self._step()
            except Exception as e:  # keep serving: fail the batch, not the server
                log.exception("engine step failed")
                for s in list(self._running):
                    self._finish(s, "error", abort_reason=f"engine error: {e}")
                self._to_drop += self.prefix.clear()  # the failed step may have left the ranks' entries behind
                self._to_keep = []

    def _maybe_update(self) -> None:
        if self._update is None:
            return
        path, mode, done, box = self._update
        if mode == "drain" and self._running:
            return
        for s in list(self._running):
            self._finish(s, "abort", abort_reason="weights_updated")
        try:
            self.group.load(path)
            self.weight_version += 1
            self.prefix.clear()  # every kept state was computed with the old weights (the ranks drop theirs)
            self._routes.clear()
            self._to_keep = []
        except Exception as e:
            box.append(e)
        with self._cv:
            self._update = None
        done.set()

    def _admit(self) -> None:
        with self._cv:
            while self._waiting and len(self._running) < self.max_batch and self._update is None:
                seq = self._waiting.popleft()
                self._place(seq)
                seq.weight_version = self.weight_version
                self._running.append(seq)
                self._fresh.add(seq.seq_id)

    def _place(self, seq: Sequence) -> None:
        """Pick the rank: the one holding the longest kept prefix of the prompt, else the least loaded one;
        and keep the state after this prompt's prefill for later requests that repeat or extend it."""
        P = len(seq.prompt_ids)
        accept = (lambda e: e.id in self._routes) if seq.params.return_routed_experts else None
        hit = self.prefix.lookup(seq.prompt_ids, accept) if seq.params.prompt_logprobs is None else None
        if hit is not None:
            seq.rank, seq.start_entry, seq.cached_tokens = hit.rank, hit.id, len(hit.tokens)
            self.stats["prefix_hits"] += 1
            self.stats["prefix_forks"] += len(hit.tokens) == P
        else:
            per_rank = [sum(1 for s in self._running if s.rank == r) for r in range(self.group.world)]
            seq.rank = per_rank.index(min(per_rank))
        if seq.cached_tokens < P:
            size = state_nbytes(self.cfg, P) + 4 * self.cfg.vocab_size   # and the last position's logits
            entry = self.prefix.add(seq.rank, seq.prompt_ids, size, has_logits=True)
            seq.save_entry = entry.id if entry else None
        self.stats["prompt_tokens"] += P
        self.stats["prefill_tokens"] += P - seq.cached_tokens
        self.stats["prefill_tokens_saved"] += seq.cached_tokens

    def _job(self, s: Sequence) -> Job:
        if s.seq_id not in self._fresh:
            return Job(s.seq_id, s.output_ids[-1:], route=s.params.return_routed_experts)
        return Job(s.seq_id, s.prompt_ids[s.cached_tokens:], True, s.start_entry, s.save_entry,
                   s.params.prompt_logprobs, s.params.return_routed_experts)

    def _step(self) -> None:
        self._admit()
        if not self._running:
            return
        t0 = time.perf_counter()
        jobs: list[list[Job]] = [[] for _ in range(self.group.world)]
        for s in self._running:
            jobs[s.rank].append(self._job(s))
        used = {e for js in jobs for j in js for e in (j.start, j.save) if e is not None}
        free, self._to_free = self._to_free, []
        keep, self._to_keep = self._to_keep, []
        drop, self._to_drop = self._to_drop + self.prefix.evict(protect=used), []
        for e in drop:
            self._routes.pop(e, None)
        results, load = self.group.step(jobs, free, keep, drop)
        self.stats["steps"] += 1
        self.stats["max_batch_seen"] = max(self.stats["max_batch_seen"], len(self._running))
        self.stats["decode_tokens"] += len(self._running)
        self.expert_load_last = load
        self.expert_load_total += load
        fresh, self._fresh = self._fresh, set()
        for s in list(self._running):
            res = results[s.seq_id]
            if s.seq_id in fresh:
                self._record_prefill(s, res)
            elif s.params.return_routed_experts and res.routing is not None:
                s.routed_experts.append(res.routing[-1].tolist())
            logits = res.logits
            if s.constraint is not None:
                masked = s.constraint.mask(logits)
                if masked is None:
                    self._finish(s, "stop", abort_reason=f"grammar: {s.constraint.error() or 'no token allowed'}")
                    continue
                logits = masked
            tok, lp = sample(logits, s.params, s.generator)
            if s.constraint is not None:
                s.constraint.advance(tok)
            s.output_ids.append(tok)
            s.logprobs.append(lp)
            self._after_token(s, tok)
        self.stats["step_seconds_total"] += time.perf_counter() - t0

    def _record_prefill(self, s: Sequence, res: JobResult) -> None:
        if res.prompt_logprobs is not None:
            s.prompt_logprobs = res.prompt_logprobs
        if s.params.return_routed_experts and res.routing is not None:
            P, fed = len(s.prompt_ids), len(s.prompt_ids) - s.cached_tokens
            rows = res.routing.tolist()   # one row per fed position (a fork: just the last prompt position)
            kept = self._routes.get(s.start_entry, []) if s.start_entry is not None else []
            if len(kept) != s.cached_tokens:   # an entry without routing is never chosen for a routed sequence
                raise RuntimeError(f"prefix entry {s.start_entry} holds routing for {len(kept)} of its "
                                   f"{s.cached_tokens} positions")
            full = kept + rows if fed else kept   # routing of prompt positions 0..P-1
            s.prompt_routed_experts = list(full[:P - 1])
            s.routed_experts.append(full[P - 1])
            self._keep_routes(s.save_entry, s.prompt_ids, full)

    def _keep_routes(self, entry: int | None, tokens: list[int], routing: list[list[list[int]]]) -> None:
        """Keep ``routing`` (one row per position of ``tokens``) with the entry kept for ``tokens``: the new one, or
        the one kept earlier for the same tokens without routing (same tokens, same weights: the same routing)."""
        if entry is None:
            old = self.prefix.find(tokens)
            entry = old.id if old is not None and old.id not in self._routes else None
        if entry is not None and len(routing) == len(tokens):
            self._routes[entry] = list(routing)

    def _after_token(self, s: Sequence, tok: int) -> None:
        eos = tok == self.tokenizer.eos_id or tok in s.params.stop_token_ids
        body = s.output_ids[:-1] if eos else s.output_ids
        s.text = self.tokenizer.decode(body)
        hit = [i for i in (s.text.find(x) for x in s.params.stop if x) if i >= 0]
        if hit:
            s.text = s.text[:min(hit)]
        if eos or hit:
            self._finish(s, "stop")
        elif len(s.output_ids) >= s.params.max_tokens or len(s.prompt_ids) + len(s.output_ids) >= self.max_context:
            self._finish(s, "length")
        elif s.listener:
            s.listener(s)

    def _finish(self, s: Sequence, reason: str, abort_reason: str | None = None) -> None:
        s.finish_reason, s.abort_reason = reason, abort_reason
        if s in self._running:
            self._running.remove(s)
            if reason in ("stop", "length") and s.seq_id not in self._fresh:
                # the state holds the prompt and every output token but the last (never fed): the next turn of
                # a multi-turn episode sends all of them and more
                kept = s.prompt_ids + s.output_ids[:-1]
                entry = self.prefix.add(s.rank, kept, state_nbytes(self.cfg, len(kept)), has_logits=False)
                if entry is not None:
                    self._to_keep.append((s.seq_id, entry.id))
                if s.params.return_routed_experts and s.prompt_routed_experts is not None:
                    # positions 0..P-2, then P-1.. (each produced an output token): one per kept position
                    rows = [r for r in s.prompt_routed_experts if r is not None]   # complete: see _record_prefill
                    self._keep_routes(entry.id if entry else None, kept, [*rows, *s.routed_experts][:len(kept)])
        self._to_free.append(s.seq_id)
        self.stats["requests_finished"] += 1
        if s.listener:
            s.listener(s)
        s.done.set()
