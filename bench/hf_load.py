"""Benchmark reading a Kimi checkpoint folder (policy/hf_format.py) under expert parallelism: the peak memory of a
process that reads the whole model, against one that reads as one rank of EP=``--ep`` (only its routed experts'
tensors from the shards), on the same folder, and how long each read takes.

Each read runs in a fresh process whose peak resident memory (VmHWM, reset through /proc/self/clear_refs just
before the read) is measured above its resident memory at that moment: file pages of the shards it touched count. The checkpoint is a k3-mini-shaped model with more experts, so
that routed experts are most of its bytes, as in K3 (97.9% of its parameters).

Writes bench/results/hf_load.json: ``checkpoint_mb``, and per reader (``full``, ``ep_rank``) the median and p90 of
``peak_mb`` (above the baseline) and ``read_s`` over ``--repeats`` runs, and ``ratio`` (ep_rank over full).

Run: ``python -m bench.hf_load [--experts 256] [--ep 4] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "hf_load.json"


def _config(experts: int):  # noqa: ANN202 - the policy package is imported only where it runs
    from policy.config import k3_mini
    return k3_mini(vocab_size=4096, num_experts=experts, num_experts_per_token=8)


def read_once(folder: str, experts: int, ep: int) -> dict[str, float]:
    """In this (fresh) process: read ``folder`` whole (``ep`` 1) or as EP rank 1 of ``ep``; peak MB above baseline."""
    from policy.ep import EPGroup
    from policy.hf_format import load_state
    cfg = _config(experts)
    Path("/proc/self/clear_refs").write_text("5")  # resets this process's peak resident memory (VmHWM) to now
    base = _status_kb("VmRSS")
    t0 = time.perf_counter()
    state = load_state(folder, cfg, EPGroup(rank=1, world=ep) if ep > 1 else None)
    read_s = time.perf_counter() - t0
    held = sum(t.numel() * t.element_size() for t in state.values())
    return {"peak_mb": (_status_kb("VmHWM") - base) / 1024, "read_s": read_s, "held_mb": held / 2**20}


def _status_kb(field: str) -> int:
    """A memory figure of this process from /proc/self/status, in KiB."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1])


def _stats(rows: list[dict[str, float]], key: str) -> dict[str, float]:
    xs = sorted(r[key] for r in rows)
    return {"median": statistics.median(xs), "p90": xs[min(len(xs) - 1, int(0.9 * len(xs)))]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--ep", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", nargs=2, metavar=("FOLDER", "EP"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(read_once(args.child[0], args.experts, int(args.child[1]))))
        return
    import torch

    from policy.hf_format import save_model
    from policy.model import K3Model
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _config(args.experts)
        folder = save_model(K3Model(cfg).state_dict(), cfg, Path(tmp) / "ck")
        size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        del torch
        runs: dict[str, list[dict[str, float]]] = {"full": [], "ep_rank": []}
        for _ in range(args.repeats):
            for name, ep in (("full", 1), ("ep_rank", args.ep)):
                out = subprocess.run([sys.executable, "-m", "bench.hf_load", "--experts", str(args.experts),
                                      "--child", str(folder), str(ep)], capture_output=True, text=True, check=True)
                runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    result = {"checkpoint_mb": size / 2**20, "experts": args.experts, "ep": args.ep,
              **{name: {"peak_mb": _stats(rows, "peak_mb"), "read_s": _stats(rows, "read_s"),
                        "held_mb": rows[0]["held_mb"]} for name, rows in runs.items()}}
    result["ratio"] = {"peak_mb": result["ep_rank"]["peak_mb"]["median"] / result["full"]["peak_mb"]["median"],
                       "read_s": result["ep_rank"]["read_s"]["median"] / result["full"]["read_s"]["median"]}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
