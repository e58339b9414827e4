"""Benchmark the trainer on k3-mini: training tokens/s (forward + backward + AdamW) at EP=1 and EP=2, weight-sync
time (atomic safetensors write + the server's load, in-process and over HTTP to an EP=2 server), and how often
serving and training route a generated token to different experts, with and without routing replay.

Writes bench/results/train.json:

- ``train.ep1`` / ``train.ep2``: one optimizer step on a fixed batch, with ``tokens_per_s_median`` (all tokens fed)
  and ``loss_tokens_per_s_median``;
- ``sync.local_ep1`` / ``sync.http_ep2``: ``WeightSync.push`` end to end, sub-phases ``write`` and ``load``;
- ``info.routing``: per scenario (``fp32`` same weights and numerics; ``bf16_serving``: the server runs weights rounded
  to bfloat16; ``stale_1``: the trainer is one step ahead of the weights that sampled) the fraction of (generated
  token, MoE layer) pairs whose expert set differs between the serving engine (incremental decoding, batched) and the
  training forward (whole sequences, padded micro-batches), without and with replay, and the rollout/train log-prob
  gap (mean |diff|, k3 KL);
- ``info.iteration_split`` / ``info.rollout_to_train``: from an RL loop's metrics JSONL (``--loop-metrics``: rows
  with ``time/env``, ``time/policy``, ``time/train``, ``time/sync`` and ``staleness/max``); null without one.

Run: ``python -m bench.train [--quick] [--loop-metrics runs/x/metrics.jsonl]``.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.harness import (
    Report,
    Row,
    add_output_arg,
    console,
    median,
    print_table,
    recording,
)
from policy.config import model_config
from policy.engine import Engine, SamplingParams
from policy.engines import EngineSpec, start, wait_healthy
from policy.ranks import free_port
from policy.tokenizer import load_tokenizer
from trainer.algorithm.batch import Batch, Sample
from trainer.distributed.rank import write_safetensors_atomic
from trainer.distributed.sync import Endpoint, WeightSync
from trainer.metrics import iteration_split, read_jsonl, rollout_to_train
from trainer.train import TrainConfig, Trainer


def synthetic_batch(n: int, length: int, prompt: int, vocab: int, seed: int = 0) -> Batch:
    """``n`` episodes of ``length`` tokens, the last ``length - prompt`` generated, advantages +-1."""
    rng = random.Random(seed)
    samples = []
    for i in range(n):
        ids = [rng.randrange(vocab) for _ in range(length)]
        mask = [0] * prompt + [1] * (length - prompt)
        lps = [0.0] * prompt + [-rng.uniform(0.5, 5.0) for _ in range(length - prompt)]
        samples.append(Sample(ids, mask, lps, advantage=1.0 if i % 2 else -1.0))
    return Batch(samples)


def train_throughput(report: Report, key: str, cfg: Any, ep: int, batch: Batch, repeats: int, budget: int,
                     threads: int) -> None:
    r = report.result(key, note=f"one optimizer step (fwd + bwd + grad all-reduce + AdamW), {ep} process(es) of "
                                f"{threads} thread(s), gloo; {len(batch.samples)} episodes x {len(batch.samples[0])} "
                                f"tokens, micro-batches of {budget} tokens")
    r.fields["threads_per_rank"] = threads
    before = torch.get_num_threads()
    torch.set_num_threads(threads)   # a world > 1 trainer sets cores / world per rank itself
    with recording(r, key), Trainer(cfg, TrainConfig(lr=1e-5, micro_batch_tokens=budget), world=ep,
                                    ep_size=ep) as t:
        t.step(batch)   # warm-up
        for _ in range(repeats):
            t0 = time.perf_counter()
            t.step(batch)
            r.add(time.perf_counter() - t0)
    torch.set_num_threads(before)
    med = median(r.samples)
    if med:
        r.fields["tokens"] = batch.tokens
        r.fields["tokens_per_s_median"] = round(batch.tokens / med, 1)
        r.fields["loss_tokens_per_s_median"] = round(batch.loss_tokens / med, 1)


def sync_time(report: Report, key: str, sync: WeightSync, trainer: Trainer, repeats: int, note: str) -> None:
    r = report.result(key, note=note)
    with recording(r, key):
        for _ in range(repeats):
            res = sync.push(trainer)
            r.add(res.total_s)
            r.add_extra("write", res.write_s)
            r.add_extra("load", max(res.load_s.values()))
            r.fields["weight_version"] = res.version
    r.fields["file_bytes"] = sync.written[-1].stat().st_size if sync.written else None


def _generate(engine: Engine, tok: Any, n: int, tokens: int, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    words = ["the", "agent", "reads", "the", "task", "runs", "tests", "fixes", "bugs", "and", "submits", "a", "patch"]
    prompts = [tok.encode_text(" ".join(rng.choice(words) for _ in range(8))) for _ in range(n)]
    seqs = engine.generate(prompts, SamplingParams(max_tokens=tokens, temperature=1.0, seed=seed,
                                                   return_routed_experts=True))
    return [Sample(s.prompt_ids + s.output_ids, [0] * len(s.prompt_ids) + [1] * len(s.output_ids),
                   [0.0] * len(s.prompt_ids) + s.logprobs,
                   routing=[*(s.prompt_routed_experts or []), *s.routed_experts]) for s in seqs]


def routing_gap(samples: list[Sample], scored: list[Any]) -> dict[str, float]:
    """Serving-vs-training routing and log-prob differences over the generated tokens."""
    pairs = diff_pairs = tokens = diff_tokens = 0
    abs_diff, k3 = [], []
    for s, sc in zip(samples, scored, strict=True):
        gen = [t for t, m in enumerate(s.loss_mask) if m]
        got = sc.routing[[t - 1 for t in gen]].sort(-1).values   # the positions that produced generated tokens
        rec = torch.tensor([(s.routing or [])[t - 1] for t in gen]).sort(-1).values
        differs = (got != rec).any(-1)                      # (tokens, layers)
        pairs += differs.numel()
        diff_pairs += int(differs.sum())
        tokens += differs.shape[0]
        diff_tokens += int(differs.any(-1).sum())
        for t in gen:
            d = sc.logprobs[t] - s.logprobs[t]              # log(pi_train / pi_rollout)
            abs_diff.append(abs(d))
            k3.append(math.exp(d) - 1 - d)
    return {"route_mismatch_pairs": diff_pairs / pairs, "route_mismatch_tokens": diff_tokens / tokens,
            "logprob_abs_diff_mean": sum(abs_diff) / len(abs_diff), "logprob_abs_diff_max": max(abs_diff),
            "rollout_kl_k3": sum(k3) / len(k3), "generated_tokens": tokens}


def routing_bench(report: Report, cfg: Any, tok: Any, n: int, tokens: int, tmp: Path) -> None:
    out: dict[str, Any] = {}
    engine = Engine(cfg, tok, seed=0, max_context=1024)
    try:
        with Trainer(cfg, TrainConfig(seed=0)) as plain, \
                Trainer(cfg, TrainConfig(seed=0, routing_replay=True)) as replay:
            fp32 = _generate(engine, tok, n, tokens, seed=1)
            out["fp32"] = {"no_replay": routing_gap(fp32, plain.score(fp32)),
                           "replay": routing_gap(fp32, replay.score(fp32))}
            # the server runs bf16-rounded weights, the trainer the fp32 ones
            rounded = {k: v.to(torch.bfloat16).to(v.dtype) for k, v in plain.state_dict().items()}
            engine.update_weights(str(write_safetensors_atomic(rounded, tmp / "bf16.safetensors")))
            bf16 = _generate(engine, tok, n, tokens, seed=2)
            out["bf16_serving"] = {"no_replay": routing_gap(bf16, plain.score(bf16)),
                                   "replay": routing_gap(bf16, replay.score(bf16))}
            # the trainer one step ahead of the weights that sampled (staleness 1)
            engine.update_weights(str(plain.save_weights(tmp / "fp32.safetensors")))
            stale = _generate(engine, tok, n, tokens, seed=3)
            for i, s in enumerate(stale):
                s.advantage = 1.0 if i % 2 else -1.0
            for t in (plain, replay):
                t.step(Batch(stale))
            out["stale_1"] = {"no_replay": routing_gap(stale, plain.score(stale)),
                              "replay": routing_gap(stale, replay.score(stale))}
    finally:
        engine.close()
    report.info["routing"] = out


def sync_bench(report: Report, cfg: Any, tok: Any, repeats: int, tmp: Path, http: bool) -> None:
    with Trainer(cfg, TrainConfig(seed=0)) as trainer:
        engine = Engine(cfg, tok, seed=0, max_context=256)
        try:
            sync_time(report, "sync.local_ep1", WeightSync([engine], str(tmp / "local")), trainer, repeats,
                      "WeightSync.push into an in-process engine (EP=1): safetensors write + load")
        finally:
            engine.close()
        if not http:
            return
        token = secrets.token_urlsafe(16)
        spec = EngineSpec("agentenv", "k3-mini", port=free_port(), data_parallel_size=2, api_key=token, max_model_len=256)
        proc = start(spec)
        try:
            wait_healthy(spec.base_url, timeout=300, interval=0.5)
            sync_time(report, "sync.http_ep2", WeightSync([Endpoint(spec.base_url, api_key=token)], str(tmp / "http")),
                      trainer, repeats, "WeightSync.push to `agentenv policy serve --ep 2` over HTTP (/update_weights)")
        finally:
            proc.terminate()
            proc.wait(60)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller batch, fewer repeats")
    ap.add_argument("--no-http", action="store_true", help="skip the sync to an EP=2 server process")
    ap.add_argument("--loop-metrics", type=Path, action="append", default=[],
                    help="an RL loop's metrics JSONL (repeatable: e.g. a run at staleness 0 and one at 1): "
                         "iteration split, rollout-to-train ratio")
    add_output_arg(ap, "train")
    args = ap.parse_args(argv)
    repeats = 2 if args.quick else 3
    report = Report("train", args)
    report.machine.update(torch=torch.__version__, threads=torch.get_num_threads())
    tok = load_tokenizer()
    cfg = model_config("k3-mini")
    n, length = (4, 128) if args.quick else (8, 128)
    batch = synthetic_batch(n, length, 32, cfg.vocab_size)
    report.info.update(preset="k3-mini", batch={"episodes": n, "tokens_each": length, "generated_each": length - 32})
    with tempfile.TemporaryDirectory(prefix="bench-train-") as d:
        tmp = Path(d)
        cores = os.cpu_count() or 1
        for key, ep, threads in (("train.ep1", 1, cores), ("train.ep1_1thread", 1, 1), ("train.ep2", 2,
                                                                                          max(1, cores // 2))):
            console.log(f"training step, EP={ep}, {threads} thread(s) per rank")
            train_throughput(report, key, cfg, ep, batch, repeats, 512, threads)
        report.add_ratio("train_ep2_over_ep1", "train.ep2", "train.ep1")
        report.add_ratio("train_ep2_over_ep1_1thread", "train.ep2", "train.ep1_1thread")
        console.log("weight sync")
        sync_bench(report, cfg, tok, repeats, tmp, http=not args.no_http)
        console.log("routing: serving vs training, with and without replay")
        routing_bench(report, cfg, tok, 4 if args.quick else 8, 24 if args.quick else 48, tmp)
    if args.loop_metrics:
        runs = {str(p): [r for r in read_jsonl(p) if r.get("eval") is None] for p in args.loop_metrics}
        report.info["iteration_split"] = {p: iteration_split(rows) for p, rows in runs.items()}
        report.info["rollout_to_train"] = rollout_to_train([r for rows in runs.values() for r in rows])
    else:
        report.info["iteration_split"] = report.info["rollout_to_train"] = None
        report.notes.append("iteration split and rollout-to-train ratio need an RL loop's metrics (--loop-metrics)")
    print_report(report)
    report.write(args.output)
    return 0


def print_report(report: Report) -> None:
    rows = []
    for key, r in report.results.items():
        cells = {}
        if "tokens_per_s_median" in r.fields:
            cells["tokens/s"] = f"{r.fields['tokens_per_s_median']:.0f}"
        if r.extra:
            cells["write / load ms"] = " / ".join(f"{(median(v) or 0) * 1e3:.0f}" for v in r.extra.values())
        rows.append(Row(key, [r], cells=cells))
    print_table("trainer (k3-mini), ms", rows)
    for name, rt in report.ratios.items():
        console.print(f"{name} (median time ratio): {rt['text']}", highlight=False)
    for scenario, v in (report.info.get("routing") or {}).items():
        for mode, g in v.items():
            console.print(f"routing {scenario:13s} {mode:9s}: {100 * g['route_mismatch_pairs']:.2f}% of (token, layer) "
                          f"pairs, {100 * g['route_mismatch_tokens']:.1f}% of tokens routed differently; "
                          f"|dlogp| mean {g['logprob_abs_diff_mean']:.2e} max {g['logprob_abs_diff_max']:.2e}",
                          highlight=False)
    for path, split in (report.info.get("iteration_split") or {}).items():
        if split:
            parts = ", ".join(f"{k} {v:.1f}s ({100 * split['share'][k]:.0f}%)" for k, v in split["median_s"].items())
            console.print(f"iteration split (median), {path}: {parts}; wall {split.get('wall_s') or 0:.1f}s per "
                          f"iteration", highlight=False)
    for bound, ratio in (report.info.get("rollout_to_train") or {}).items():
        console.print(f"rollout-to-train time ratio at staleness bound {bound}: {ratio:.2f}", highlight=False)
    report.print_errors()


if __name__ == "__main__":
    sys.exit(main())
