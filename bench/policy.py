"""Benchmark the k3-mini policy: decode and prefill throughput, EP=2 against EP=1, chunked against recurrent KDA,
and decoding memory per sequence (fixed KDA state + growing MLA latents against a full-attention KV cache).

Prints median / p90 figures and writes them to bench/results/policy.json. Run: python bench/policy.py
(on CUDA the KDA layers use flash-linear-attention's kernels when installed, else the torch code).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# This file is named like the package it measures: import the package, not this script.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE] + [str(_HERE.parent)]

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from policy.config import K3Config, from_k3_json, k3_mini  # noqa: E402
from policy.ep import init_ep, shard_state_dict  # noqa: E402
from policy.kda import kda_chunked, kda_recurrent  # noqa: E402
from policy.model import Cache, K3Model  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "policy.json"
K3_JSON = next((p / "shared" / "k3" / "config.json" for p in Path(__file__).resolve().parents[1:3]
                if (p / "shared" / "k3" / "config.json").exists()), Path("shared/k3/config.json"))


def stats(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {"median": statistics.median(s), "p90": s[min(len(s) - 1, int(0.9 * len(s)))], "n": len(s)}


def timed(fn: Any, repeats: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


@torch.no_grad()
def decode(model: K3Model, batch: int, steps: int, device: str) -> dict[str, float]:
    """Per-step decode time for ``batch`` sequences after a 32-token prompt; tokens/s = batch / step time."""
    V = model.cfg.vocab_size
    _, cache = model(torch.randint(0, V, (batch, 32), device=device))
    times = []
    tok = torch.randint(0, V, (batch, 1), device=device)
    for _ in range(steps):
        t0 = time.perf_counter()
        logits, cache = model(tok, cache)
        tok = logits[:, -1].argmax(-1, keepdim=True)
        times.append(time.perf_counter() - t0)
    st = stats(times[1:])
    return {"batch": batch, "step_s": st, "tokens_per_s_median": batch / st["median"], "tokens_per_s_p90": batch / st["p90"]}


@torch.no_grad()
def prefill(model: K3Model, length: int, repeats: int, device: str) -> dict[str, float]:
    ids = torch.randint(0, model.cfg.vocab_size, (1, length), device=device)
    st = stats(timed(lambda: model(ids), repeats))
    return {"tokens": length, "seconds": st, "tokens_per_s_median": length / st["median"], "tokens_per_s_p90": length / st["p90"]}


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


def ep_compare(cfg: K3Config, batch: int, seq: int, repeats: int) -> dict[str, Any]:
    """The same (batch, seq) forward on one process, and split over two EP ranks (gloo, one thread each)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = K3Model(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    with torch.no_grad():
        one = stats(timed(lambda: model(ids), repeats))
    torch.set_num_threads(threads)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    mp.start_processes(_ep_worker, args=(2, port, cfg.to_dict(), batch, seq, repeats, q), nprocs=2, join=True,
                       start_method="spawn")
    two = stats(q.get())
    n = batch * seq
    return {"batch": batch, "seq": seq, "ep1_seconds": one, "ep2_seconds": two,
            "ep1_tokens_per_s": n / one["median"], "ep2_tokens_per_s": n / two["median"],
            "note": "EP=1 on one thread vs EP=2 as two single-thread ranks"}


def kda_compare(length: int, repeats: int, device: str, chunk: int) -> dict[str, Any]:
    """KDA alone at k3-mini's head shape: forward, and forward+backward (training), both forms."""
    B, H, K = 1, 4, 32
    g = torch.Generator().manual_seed(0)
    q, k = (torch.nn.functional.normalize(torch.randn(B, length, H, K, generator=g), dim=-1).to(device) for _ in range(2))
    v = torch.randn(B, length, H, K, generator=g).to(device)
    gate = (-5 * torch.rand(B, length, H, K, generator=g)).to(device)
    beta = torch.rand(B, length, H, generator=g).to(device)
    rec = stats(timed(lambda: kda_recurrent(q, k, v, gate, beta, K ** -0.5), repeats))
    chk = stats(timed(lambda: kda_chunked(q, k, v, gate, beta, K ** -0.5, chunk_size=chunk), repeats))
    qg = q.clone().requires_grad_()
    rec_bw = stats(timed(lambda: kda_recurrent(qg, k, v, gate, beta, K ** -0.5)[0].sum().backward(), repeats))
    chk_bw = stats(timed(lambda: kda_chunked(qg, k, v, gate, beta, K ** -0.5, chunk_size=chunk)[0].sum().backward(),
                         repeats))
    return {"tokens": length, "heads": H, "head_dim": K, "chunk_size": chunk,
            "recurrent_seconds": rec, "chunked_seconds": chk, "speedup_median": rec["median"] / chk["median"],
            "recurrent_fwd_bwd_seconds": rec_bw, "chunked_fwd_bwd_seconds": chk_bw,
            "fwd_bwd_speedup_median": rec_bw["median"] / chk_bw["median"]}


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    args = ap.parse_args()
    dev, rep = args.device, (2 if args.quick else 5)
    cfg = k3_mini(vocab_size=4096)
    torch.manual_seed(0)
    model = K3Model(cfg).to(dev).eval()
    res: dict[str, Any] = {"device": dev, "torch": torch.__version__, "threads": torch.get_num_threads(),
                           "preset": "k3-mini", "config": cfg.to_dict()}
    res["decode"] = [decode(model, b, 8 if args.quick else 16, dev) for b in (1, 8, 32)]
    res["prefill"] = [prefill(model, 512, rep, dev), prefill(model, 4096, max(1, rep // 2), dev)]
    res["ep2_vs_ep1"] = ep_compare(cfg, batch=8, seq=64, repeats=rep)
    res["kda_chunked_vs_recurrent"] = kda_compare(1024, rep, dev, cfg.kda_chunk_size)
    with torch.no_grad():
        _, cache = model(torch.randint(0, cfg.vocab_size, (1, 1024), device=dev))
    res["memory_k3_mini_fp32"] = memory(cfg, 4, cache, 1024)
    if K3_JSON.exists():
        res["memory_k3_bf16"] = memory(from_k3_json(K3_JSON), 2)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(res, indent=2))
    report(res)


def report(res: dict[str, Any]) -> None:
    print(f"k3-mini on {res['device']} (torch {res['torch']}, {res['threads']} threads)")
    print(f"{'figure':44s} {'median':>12s} {'p90':>12s}  (p90 of a rate = the slower tail)")
    for d in res["decode"]:
        print(f"{'decode tokens/s, batch ' + str(d['batch']):44s} {d['tokens_per_s_median']:12.1f} {d['tokens_per_s_p90']:12.1f}")
    for p in res["prefill"]:
        print(f"{'prefill tokens/s, ' + str(p['tokens']) + ' tokens':44s} {p['tokens_per_s_median']:12.1f} {p['tokens_per_s_p90']:12.1f}")
    e = res["ep2_vs_ep1"]
    print(f"{'forward s, batch 8x64, EP=1 (1 thread)':44s} {e['ep1_seconds']['median']:12.4f} {e['ep1_seconds']['p90']:12.4f}")
    print(f"{'forward s, batch 8x64, EP=2 (2 ranks x 1)':44s} {e['ep2_seconds']['median']:12.4f} {e['ep2_seconds']['p90']:12.4f}")
    k = res["kda_chunked_vs_recurrent"]
    print(f"{'KDA recurrent s, 1024 tokens':44s} {k['recurrent_seconds']['median']:12.4f} {k['recurrent_seconds']['p90']:12.4f}")
    print(f"{'KDA chunked s, 1024 tokens':44s} {k['chunked_seconds']['median']:12.4f} {k['chunked_seconds']['p90']:12.4f}")
    print(f"{'KDA recurrent fwd+bwd s, 1024 tokens':44s} {k['recurrent_fwd_bwd_seconds']['median']:12.4f} "
          f"{k['recurrent_fwd_bwd_seconds']['p90']:12.4f}")
    print(f"{'KDA chunked fwd+bwd s, 1024 tokens':44s} {k['chunked_fwd_bwd_seconds']['median']:12.4f} "
          f"{k['chunked_fwd_bwd_seconds']['p90']:12.4f}")
    print(f"KDA chunked (chunk {k['chunk_size']}) speed-up, median: forward {k['speedup_median']:.1f}x, "
          f"forward+backward {k['fwd_bwd_speedup_median']:.1f}x")
    for name in ("memory_k3_mini_fp32", "memory_k3_bf16"):
        if name not in res:
            continue
        print(f"{name}: context -> KDA state + MLA latents (MiB) vs full-attention KV (MiB)")
        for T, r in res[name]["per_context"].items():
            print(f"  {T:>6s}: {r['kda_state_bytes'] / 2**20:10.2f} + {r['mla_latent_bytes'] / 2**20:10.2f}"
                  f" = {r['total_bytes'] / 2**20:10.2f}  vs {r['full_attention_kv_bytes'] / 2**20:12.2f}"
                  f"  ({r['ratio_full_over_ours']:.1f}x)")
        if "measured_cache_bytes_at" in res[name]:
            m = res[name]["measured_cache_bytes_at"]
            print(f"  measured cache at 1024 tokens: {m['1024']} bytes (formula {m['formula']})")
    print(f"written to {RESULTS}")


if __name__ == "__main__":
    main()
