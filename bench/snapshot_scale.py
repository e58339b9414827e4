"""How a filesystem snapshot's cost grows with what the sandbox holds: bytes (1 MB, 100 MB, 1 GB) and files
(5,000 and 50,000 of 4 KiB).

Why: a snapshot of the files is a btrfs clone of the sandbox's layer, a few ms whatever it holds, but its
``size_bytes`` (what the store's limit counts) used to come from walking every file, O(files). It now comes
from the clone's quota group (``agentenv.volume.referenced``), O(1). Each workload is measured both ways in
one run: ``qgroup`` (what agentenv does) and ``walk`` (the old count, forced by hiding the quota group).

    .venv/bin/python -m bench.snapshot_scale [--runs 5] [--skip-1g]
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import agentenv
from agentenv import volume
from bench.sandbox_common import CPUS, IMAGE

WORKLOADS = {
    "1 MB": "head -c 1M /dev/urandom > /testbed/blob",
    "100 MB": "head -c 100M /dev/urandom > /testbed/blob",
    "1 GB": "head -c 1G /dev/urandom > /testbed/blob",
    "5,000 files": "mkdir -p /testbed/many && cd /testbed/many && python3 -c \"import os\n"
                   "for i in range(5000): open(str(i), 'wb').write(os.urandom(4096))\"",
    "50,000 files": "mkdir -p /testbed/many && cd /testbed/many && python3 -c \"import os\n"
                    "for i in range(50000): open(str(i), 'wb').write(os.urandom(4096))\"",
}


def measure(sb: agentenv.Sandbox, runs: int) -> tuple[float, int]:
    """Median ms of ``runs`` filesystem snapshots of ``sb`` (each deleted at once), and the last one's size."""
    times, size = [], 0
    for _ in range(runs):
        t0 = time.perf_counter()
        snap = sb.snapshot(memory=False)
        times.append((time.perf_counter() - t0) * 1e3)
        size = snap.size_bytes
        snap.delete()
    return statistics.median(times), size


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--skip-1g", action="store_true", help="leave out the 1 GB workload (needs ~2 GB of volume)")
    args = ap.parse_args(argv)
    print(f"{'workload':>14} {'qgroup ms':>10} {'walk ms':>8} {'size (qgroup)':>14} {'size (walk)':>12}")
    for name, setup in WORKLOADS.items():
        if name == "1 GB" and args.skip_1g:
            continue
        with agentenv.Sandbox.create(IMAGE, cpus=CPUS, memory="1g", disk="3g") as sb:
            r = sb.exec(setup, timeout=600)
            if not r.ok:
                raise RuntimeError(f"{name}: setup failed: {r.stderr}")
            fast, fast_size = measure(sb, args.runs)
            with mock.patch.object(volume, "referenced", return_value=None):
                slow, slow_size = measure(sb, args.runs)
        print(f"{name:>14} {fast:>10.1f} {slow:>8.1f} {fast_size:>14,} {slow_size:>12,}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
