"""How a filesystem snapshot's cost grows with what the sandbox holds: bytes (1 MB, 100 MB, 1 GB) and files
(5,000 and 50,000 of 4 KiB), on each kind of btrfs quotas.

Why: a snapshot of the files is a btrfs clone of the sandbox's layer, a few ms whatever it holds, and its
``size_bytes`` (what the store's limit counts) comes from the clone's quota group, not from walking every file
(``agentenv.host.volume.referenced``). Two costs used to grow with the number of files anyway, and each is
measured here against what replaced it, in the same run:

- ``walk``: the size counted file by file (the old way, forced by hiding the quota group), against
  ``idle``, snapshots of a sandbox doing nothing in between.
- ``churn``: between snapshots the sandbox rewrites 200 of its files and the last snapshot is deleted, as
  in a search that keeps forking. With full quota groups every shared block those writes and deletions
  touch costs a walk of who else refers to it; with simple quotas (what agentenv makes on a new volume
  where the kernel has them) it costs nothing. Each mode gets a volume of its own, in a temporary home.

    .venv/bin/python -m bench.snapshot_scale [--runs 5] [--skip-1g] [--modes simple,full] [--output F]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import agentenv
from agentenv.host import volume
from bench.harness import Report, Result, Row, add_output_arg, console, fmt_ratio, print_table, recording
from bench.sandbox_common import CPUS, IMAGE

MODES = ("simple", "full")
WORKLOADS = {
    "1 MB": "head -c 1M /dev/urandom > /testbed/blob",
    "100 MB": "head -c 100M /dev/urandom > /testbed/blob",
    "1 GB": "head -c 1G /dev/urandom > /testbed/blob",
    "5,000 files": "mkdir -p /testbed/many && cd /testbed/many && python3 -c \"import os\n"
                   "for i in range(5000): open(str(i), 'wb').write(os.urandom(4096))\"",
    "50,000 files": "mkdir -p /testbed/many && cd /testbed/many && python3 -c \"import os\n"
                    "for i in range(50000): open(str(i), 'wb').write(os.urandom(4096))\"",
}
# 200 files rewritten between two snapshots, spread over the folder (the byte workloads get them as new files)
CHURN = ("mkdir -p /testbed/many && cd /testbed/many && python3 -c \"import os\n"
         "n = max(len(os.listdir('.')), 200)\n"
         "for i in range(200): open(str(i * (n // 200)), 'wb').write(os.urandom(4096))\"")


@contextlib.contextmanager
def home_with(mode: str) -> Iterator[Path]:
    """A temporary agentenv home whose volume (sparse, 4 GiB) has ``mode`` quotas; unmounted and removed after
    (also the fixture of ``tests/integration/test_volume_quotas.py``)."""
    home = Path(tempfile.mkdtemp(prefix=f"agentenv-bench-{mode}-", dir="/var/tmp"))
    saved = {k: os.environ.get(k) for k in ("AGENTENV_HOME", volume.SIZE_ENV, volume.QUOTAS_ENV)}
    os.environ.update({"AGENTENV_HOME": str(home), volume.SIZE_ENV: "4g", volume.QUOTAS_ENV: mode})
    volume.forget()
    try:
        v = volume.ensure()
        if not v.quotas or v.simple != (mode == "simple"):
            raise RuntimeError(f"no volume with {mode} quotas here: {v.reason or 'the kernel lacks them'}")
        yield home
    finally:
        volume.forget()
        for k, old in saved.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old
        subprocess.run(["umount", str(home / "volume")], capture_output=True, check=False)
        shutil.rmtree(home, ignore_errors=True)


def snapshots(sb: agentenv.Sandbox, runs: int, result: Result, between: str | None = None) -> int:
    """Time ``runs`` filesystem snapshots of ``sb`` into ``result`` (each deleted before the next one, after
    ``between`` ran in the sandbox); the last one's size."""
    size = 0
    for _ in range(runs):
        if between is not None and not (r := sb.exec(between, timeout=300)).ok:
            raise RuntimeError(f"the churn between snapshots failed: {r.stderr}")
        t0 = time.perf_counter()
        snap = sb.snapshot(memory=False)
        result.add(time.perf_counter() - t0)
        size = snap.size_bytes
        snap.delete()
    return size


def measure(report: Report, mode: str, name: str, setup: str, runs: int) -> None:
    with agentenv.Sandbox.create(IMAGE, cpus=CPUS, memory="1g", disk="3g") as sb:
        r = sb.exec(setup, timeout=600)
        if not r.ok:
            raise RuntimeError(f"{name}: setup failed: {r.stderr}")
        idle = report.result(f"{mode}/{name}/idle", "snapshots of a sandbox doing nothing in between")
        idle.fields["size_bytes"] = snapshots(sb, runs, idle)
        if mode == MODES[0]:
            walk = report.result(f"{mode}/{name}/walk", "as idle, the size counted file by file")
            with mock.patch.object(volume, "referenced", return_value=None):
                walk.fields["size_bytes"] = snapshots(sb, runs, walk)
        churn = report.result(f"{mode}/{name}/churn", "200 files rewritten before each snapshot")
        snapshots(sb, runs, churn, between=CHURN)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--skip-1g", action="store_true", help="leave out the 1 GB workload (needs ~2 GB of volume)")
    ap.add_argument("--modes", default=",".join(MODES), help="quota modes to measure, comma-separated")
    add_output_arg(ap, "snapshot_scale")
    args = ap.parse_args(argv)
    modes = [m for m in MODES if m in args.modes.split(",")]
    names = [n for n in WORKLOADS if not (n == "1 GB" and args.skip_1g)]
    report = Report("snapshot_scale", args)
    for mode in modes:
        top = report.result(mode)
        with recording(top, f"{mode} quotas"), home_with(mode):
            for name in names:
                console.print(f"{mode} quotas: {name}", highlight=False)
                with recording(report.result(f"{mode}/{name}/idle"), f"{mode} {name}"):
                    measure(report, mode, name, WORKLOADS[name], args.runs)
    rows = []
    for name in names:
        for kind in ("idle", "walk", "churn"):
            res = [report.results.get(f"{m}/{name}/{kind}") for m in modes]
            if not any(r and r.samples for r in res):
                continue
            size = next((r.fields["size_bytes"] for r in res if r and "size_bytes" in r.fields), None)
            cells = {"size (bytes)": f"{size:,}" if size is not None else ""}
            if kind == "walk":  # against idle, same mode, same sandbox
                x = report.add_ratio(f"{name}: walk / idle", f"{modes[0]}/{name}/walk", f"{modes[0]}/{name}/idle")
                cells["walk/idle"], x = fmt_ratio(x), None
            else:
                x = report.add_ratio(f"{name} {kind}: full / simple", f"full/{name}/{kind}", f"simple/{name}/{kind}")
            rows.append(Row(f"{name} {kind}", res, x, cells))
    print_table("filesystem snapshot (ms): quota mode by quota mode", rows, sides=modes, ratio_title="full/simple")
    report.print_errors()
    report.write(args.output)
    return 1 if report.errors or report.fatal else 0


if __name__ == "__main__":
    raise SystemExit(main())
