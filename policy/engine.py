"""The generation engine: continuous batching over the EP ranks, sampling, logprobs and weight versions.

A background thread runs steps: new sequences join (prefill) and finished ones leave between decode steps,
so concurrent requests share the running batch. Weight updates land between steps and bump the version.
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
from policy.runner import Job, RankGroup
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


@dataclass
class Sequence:
    """One generation: its tokens, logprobs, decoded text and why it finished."""

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


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> tuple[int, float]:
    """Sample a token with temperature and nucleus (top-p); return it with its log-probability under
    the temperature-scaled distribution (the plain distribution when greedy)."""
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
    tok = int(torch.multinomial(probs, 1, generator=gen))
    return tok, float(lp[tok])


class Engine:
    """Schedules sequences onto the EP ranks and runs decode steps in a background thread."""

    def __init__(self, cfg: K3Config, tokenizer: K3Tokenizer, ep_size: int = 1, seed: int = 0,
                 weights: str | None = None, max_batch: int = 32, max_context: int = 4096, device: str = "cpu") -> None:
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
        self._update: tuple[str, str, threading.Event, list[Any]] | None = None
        self._stop = False
        n_moe = sum(1 for i in range(cfg.num_hidden_layers) if not cfg.is_dense(i))
        self.stats: dict[str, Any] = {"steps": 0, "decode_tokens": 0, "prefill_tokens": 0, "max_batch_seen": 0,
                                      "requests_finished": 0, "step_seconds_total": 0.0}
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
        """Load a safetensors checkpoint between steps and bump the weight version.

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
            return {**self.stats, "running": len(self._running), "waiting": len(self._waiting),
                    "weight_version": self.weight_version, "ep_size": self.group.world,
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
        except Exception as e:
            box.append(e)
        with self._cv:
            self._update = None
        done.set()

    def _admit(self) -> None:
        with self._cv:
            while self._waiting and len(self._running) < self.max_batch and self._update is None:
                seq = self._waiting.popleft()
                per_rank = [sum(1 for s in self._running if s.rank == r) for r in range(self.group.world)]
                seq.rank, seq.weight_version = per_rank.index(min(per_rank)), self.weight_version
                self._running.append(seq)
                self._fresh.add(seq.seq_id)

    def _step(self) -> None:
        self._admit()
        if not self._running:
            return
        t0 = time.perf_counter()
        jobs: list[list[Job]] = [[] for _ in range(self.group.world)]
        for s in self._running:
            fresh = s.seq_id in self._fresh
            jobs[s.rank].append(Job(s.seq_id, s.prompt_ids if fresh else s.output_ids[-1:], fresh))
        free, self._to_free = self._to_free, []
        logits, load = self.group.step(jobs, free)
        self.stats["steps"] += 1
        self.stats["max_batch_seen"] = max(self.stats["max_batch_seen"], len(self._running))
        self.stats["prefill_tokens"] += sum(len(s.prompt_ids) for s in self._running if s.seq_id in self._fresh)
        self.stats["decode_tokens"] += len(self._running)
        self.expert_load_last = load
        self.expert_load_total += load
        self._fresh.clear()
        for s in list(self._running):
            tok, lp = sample(logits[s.seq_id], s.params, s.generator)
            s.output_ids.append(tok)
            s.logprobs.append(lp)
            self._after_token(s, tok)
        self.stats["step_seconds_total"] += time.perf_counter() - t0

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
        self._to_free.append(s.seq_id)
        self.stats["requests_finished"] += 1
        if s.listener:
            s.listener(s)
        s.done.set()
