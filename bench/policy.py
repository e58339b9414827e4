"""Benchmark the k3-mini policy: decode and prefill throughput, EP=2 against EP=1, chunked against recurrent KDA,
and decoding memory per sequence (fixed KDA state + growing MLA latents against a full-attention KV cache).

Prints median / p90 figures and writes them to bench/results/policy.json: step and forward times under
``decode.batch<B>``, ``prefill.<T>``, ``ep1.forward_8x64`` / ``ep2.forward_8x64`` and ``kda.*``, each with
``tokens_per_s_median`` / ``tokens_per_s_p90`` where a rate applies (the p90 of a rate is the slower tail:
tokens / p90 time); the memory tables under ``info``. Run: ``python -m bench.policy [--quick]`` (on CUDA the
KDA layers use flash-linear-attention's kernels when installed, else the torch code).
"""

from __future__ import annotations

import argparse
import socket
import sys
from typing import Any

import torch
import torch.multiprocessing as mp

from bench.harness import (
    ROOT,
    Report,
    Result,
    Row,
    add_output_arg,
    console,
    median,
    percentile,
    print_table,
    time_runs,
)
from policy.config import K3Config, from_k3_json, k3_mini
from policy.ep import init_ep, shard_state_dict
from policy.kda import kda_chunked, kda_recurrent
from policy.model import Cache, K3Model

K3_JSON = ROOT / "tests" / "data" / "k3" / "config.json"  # K3's released config, a copy


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Any, repeats: int, warmup: int = 1) -> list[float]:
    return time_runs(fn, repeats, warmup=warmup, sync=sync)


def with_rate(r: Result, tokens: int) -> Result:
    """Add tokens/s at the median and at the p90 time (the slower tail) of ``r``'s samples."""
    med, p90 = median(r.samples), percentile(r.samples, 0.9)
    r.fields["tokens"] = tokens
    r.fields["tokens_per_s_median"] = round(tokens / med, 1) if med else None
    r.fields["tokens_per_s_p90"] = round(tokens / p90, 1) if p90 else None
    return r


@torch.no_grad()
def decode(model: K3Model, batch: int, steps: int, device: str) -> Result:
    """Per-step decode time for ``batch`` sequences after a 32-token prompt; tokens/s = batch / step time."""
    V = model.cfg.vocab_size
    _, cache = model(torch.randint(0, V, (batch, 32), device=device))
    tok = torch.randint(0, V, (batch, 1), device=device)
    times = []
    for _ in range(steps):

        def step() -> None:
            nonlocal tok, cache
            logits, cache = model(tok, cache)
            tok = logits[:, -1].argmax(-1, keepdim=True)

        times += time_runs(step, 1, sync=sync)
    r = Result(samples=times[1:], note=f"one decode step, batch {batch}, after a 32-token prompt (first step dropped)")
    return with_rate(r, batch)


@torch.no_grad()
def prefill(model: K3Model, length: int, repeats: int, device: str) -> Result:
    ids = torch.randint(0, model.cfg.vocab_size, (1, length), device=device)
    return with_rate(Result(samples=timed(lambda: model(ids), repeats), note=f"forward of {length} tokens"), length)


def _ep_worker(rank: int, world: int, port: int, cfg: dict[str, Any], batch: int, seq: int, repeats: int, out: Any) -> None:
    torch.set_num_threads(1)
    ep = init_ep(rank, world, port, backend="gloo")
    c = K3Config.from_dict(cfg)
    torch.manual_seed(0)
    full = K3Model(c)
    model = K3Model(c, ep)
    model.load_state_dict(shard_state_dict(full.state_dict(), ep))
    ids = torch.randint(0, c.vocab_size, (batch, seq))[rank * batch // world:(rank + 1) * batch // world]
    with torch.no_grad():
        times = timed(lambda: model(ids), repeats)
    if rank == 0:
        out.put(times)
    torch.distributed.destroy_process_group()


def ep_compare(report: Report, cfg: K3Config, batch: int, seq: int, repeats: int) -> None:
    """The same (batch, seq) forward on one process, and split over two EP ranks (gloo, one thread each)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = K3Model(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    with torch.no_grad():
        one = timed(lambda: model(ids), repeats)
    torch.set_num_threads(threads)
    key = f"forward_{batch}x{seq}"
    report.results[f"ep1.{key}"] = with_rate(Result(samples=one, note="EP=1 on one thread"), batch * seq)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    mp.start_processes(_ep_worker, args=(2, port, cfg.to_dict(), batch, seq, repeats, q), nprocs=2, join=True,
                       start_method="spawn")
    report.results[f"ep2.{key}"] = with_rate(Result(samples=q.get(), note="EP=2 as two single-thread ranks (rank 0)"),
                                             batch * seq)
    report.add_ratio("ep1/ep2", f"ep1.{key}", f"ep2.{key}")


def kda_compare(report: Report, length: int, repeats: int, device: str, chunk: int) -> None:
    """KDA alone at k3-mini's head shape: forward, and forward+backward (training), both forms."""
    B, H, K = 1, 4, 32
    g = torch.Generator().manual_seed(0)
    q, k = (torch.nn.functional.normalize(torch.randn(B, length, H, K, generator=g), dim=-1).to(device) for _ in range(2))
    v = torch.randn(B, length, H, K, generator=g).to(device)
    gate = (-5 * torch.rand(B, length, H, K, generator=g)).to(device)
    beta = torch.rand(B, length, H, generator=g).to(device)
    qg = q.clone().requires_grad_()
    runs = {
        "recurrent": lambda: kda_recurrent(q, k, v, gate, beta, K ** -0.5),
        "chunked": lambda: kda_chunked(q, k, v, gate, beta, K ** -0.5, chunk_size=chunk),
        "recurrent_fwd_bwd": lambda: kda_recurrent(qg, k, v, gate, beta, K ** -0.5)[0].sum().backward(),
        "chunked_fwd_bwd": lambda: kda_chunked(qg, k, v, gate, beta, K ** -0.5, chunk_size=chunk)[0].sum().backward(),
    }
    for name, fn in runs.items():
        report.results[f"kda.{name}_{length}"] = with_rate(
            Result(samples=timed(fn, repeats), note=f"KDA alone, {H} heads x {K}, chunk {chunk}"), length)
    report.add_ratio("kda recurrent/chunked", f"kda.recurrent_{length}", f"kda.chunked_{length}")
    report.add_ratio("kda recurrent/chunked fwd+bwd", f"kda.recurrent_fwd_bwd_{length}", f"kda.chunked_fwd_bwd_{length}")


def memory(cfg: K3Config, bytes_per: int, measured: Cache | None = None, measured_len: int = 0) -> dict[str, Any]:
    """Decoding memory per sequence: KDA states (constant) + MLA latents (per token) vs a full-attention KV cache."""
    kda = [i for i in range(cfg.num_hidden_layers) if cfg.layer_kind(i) == "kda"]
    mla = cfg.num_hidden_layers - len(kda)
    H, Kd = cfg.linear_num_heads, cfg.linear_head_dim
    kda_state = len(kda) * (H * Kd * Kd + 3 * H * Kd * (cfg.short_conv_kernel_size - 1)) * bytes_per
    latent_per_token = mla * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * bytes_per
    kv_width = cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    full_per_token = cfg.num_hidden_layers * kv_width * bytes_per
    rows = {}
    for T in (1024, 8192, 32768):
        ours = kda_state + latent_per_token * T
        rows[str(T)] = {"kda_state_bytes": kda_state, "mla_latent_bytes": latent_per_token * T,
                        "total_bytes": ours, "full_attention_kv_bytes": full_per_token * T,
                        "ratio_full_over_ours": full_per_token * T / ours}
    out: dict[str, Any] = {"per_context": rows}
    if measured is not None:
        out["measured_cache_bytes_at"] = {str(measured_len): measured.nbytes(),
                                          "formula": kda_state + latent_per_token * measured_len}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    add_output_arg(ap, "policy")
    args = ap.parse_args(argv)
    dev, rep = args.device, (2 if args.quick else 5)
    report = Report("policy", {"device": dev, "quick": args.quick, "repeats": rep})
    report.machine.update(torch=torch.__version__, threads=torch.get_num_threads(),
                          gpu=torch.cuda.get_device_name() if dev.startswith("cuda") else None)
    cfg = k3_mini(vocab_size=4096)
    report.info.update(preset="k3-mini", config=cfg.to_dict())
    torch.manual_seed(0)
    model = K3Model(cfg).to(dev).eval()
    for b in (1, 8, 32):
        console.log(f"decode, batch {b}")
        report.results[f"decode.batch{b}"] = decode(model, b, 8 if args.quick else 16, dev)
    for length, n in ((512, rep), (4096, max(1, rep // 2))):
        console.log(f"prefill, {length} tokens")
        report.results[f"prefill.{length}"] = prefill(model, length, n, dev)
    console.log("EP=2 against EP=1")
    ep_compare(report, cfg, batch=8, seq=64, repeats=rep)
    console.log("KDA chunked against recurrent")
    kda_compare(report, 1024, rep, dev, cfg.kda_chunk_size)
    with torch.no_grad():
        _, cache = model(torch.randint(0, cfg.vocab_size, (1, 1024), device=dev))
    report.info["memory_k3_mini_fp32"] = memory(cfg, 4, cache, 1024)
    if K3_JSON.exists():
        report.info["memory_k3_bf16"] = memory(from_k3_json(K3_JSON), 2)
    print_report(report)
    report.write(args.output)
    return 0


def print_report(report: Report) -> None:
    m = report.machine
    rows = []
    for key, r in report.results.items():
        rate = ("" if "tokens_per_s_median" not in r.fields else
                f"{r.fields['tokens_per_s_median']:.1f} ({r.fields['tokens_per_s_p90']:.1f})")
        rows.append(Row(key, [r], cells={"tokens/s median (at p90 time)": rate}))
    print_table(f"k3-mini on {report.args['device']} (torch {m['torch']}, {m['threads']} threads), ms", rows)
    for name, rt in report.ratios.items():
        console.print(f"{name} (median time ratio): {rt['text']}", highlight=False)
    for name in ("memory_k3_mini_fp32", "memory_k3_bf16"):
        if name not in report.info:
            continue
        console.print(f"{name}: context -> KDA state + MLA latents (MiB) vs full-attention KV (MiB)", highlight=False)
        for T, r in report.info[name]["per_context"].items():
            console.print(f"  {T:>6s}: {r['kda_state_bytes'] / 2**20:10.2f} + {r['mla_latent_bytes'] / 2**20:10.2f}"
                          f" = {r['total_bytes'] / 2**20:10.2f}  vs {r['full_attention_kv_bytes'] / 2**20:12.2f}"
                          f"  ({r['ratio_full_over_ours']:.1f}x)", highlight=False)
        if "measured_cache_bytes_at" in report.info[name]:
            mc = report.info[name]["measured_cache_bytes_at"]
            console.print(f"  measured cache at 1024 tokens: {mc['1024']} bytes (formula {mc['formula']})",
                          highlight=False)


if __name__ == "__main__":
    sys.exit(main())
