"""Benchmark snapshots moving between two servers: the import rate against a plain copy of the same bytes.

What: two ``agentenv serve`` processes on loopback, each with its own $AGENTENV_HOME (own store and volume);
a sandbox on A holding ``--mb`` MiB of random files and a running process takes a memory snapshot; B imports
it ``--runs`` times (``POST /v1/snapshots/import``: A's archive streamed in sha256-checked chunks, unpacked into
B's store), deleted after each. ``cold`` includes A packing its archive; ``warm`` has it packed already. The
plain alternatives in the same run: the archive's bytes as one plain HTTP GET (stdlib server, httpx client
into a file), and ``cp -a`` of the same snapshot folders (store folder and files); none syncs (all land in
the page cache). Rates are MiB/s of the archive; each ratio is the import rate over a plain one, goal >= 50%
(over the wire, the HTTP one is the fair one: cp is a memory copy on one machine). Results go to ``bench/results/transfer.json``.

    .venv/bin/python -m bench.transfer [--runs 5] [--mb 64] [--chunk-mb 8]
"""

from __future__ import annotations

import argparse
import functools
import http.server
import secrets
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import httpx

from agentenv.remote.client import Client
from agentenv.remote.pool import import_snapshot
from bench.harness import Report, Row, Timer, add_output_arg, fmt_ratio, median, print_table, recording
from bench.server import separate_servers

GOAL = 0.5


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


def raw_http(report: Report, archive: Path, runs: int, dest_dir: Path) -> None:
    """The plain alternative over the wire: the same bytes as one HTTP GET (stdlib server, httpx streamed into a
    file), no chunks, digests or unpacking."""
    handler = functools.partial(_Quiet, directory=str(archive.parent))
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    res = report.result("http")
    try:
        with recording(res, "raw http"), httpx.Client(timeout=600) as c:
            for _ in range(runs):
                out = dest_dir / f".bench-http-{secrets.token_hex(4)}"
                url = f"http://127.0.0.1:{srv.server_port}/{archive.name}"
                with Timer() as t, c.stream("GET", url) as r, out.open("wb") as f:
                    for piece in r.iter_bytes(1 << 20):
                        f.write(piece)
                res.add(t.s)
                out.unlink()
    finally:
        srv.shutdown()
        srv.server_close()


def _mib_s(nbytes: int, seconds: list[float]) -> float | None:
    m = median(seconds)
    return None if not m else round(nbytes / m / (1 << 20), 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--mb", type=int, default=64, help="MiB of random files in the sandbox")
    ap.add_argument("--chunk-mb", type=int, default=8)
    add_output_arg(ap, "transfer")
    args = ap.parse_args(argv)
    report = Report("transfer", {k: v for k, v in vars(args).items() if k != "output"})
    size = 0
    with separate_servers(report, "xfer", [{"max_sandboxes": 4}] * 2) as servers:
        homes = servers.homes
        a, b = (Client(url, servers.token, timeout=600) for url in servers.urls)
        sb = a.Sandbox.create(memory="1g")
        sb.exec(f"head -c {args.mb << 20} /dev/urandom > /srv/blob", timeout=300)
        sb.spawn("python3 -c 'import time; b = bytearray(16 << 20); time.sleep(1e6)'")  # a process, 16 MiB held
        snap = sb.snapshot(memory=True)
        sb.close()
        chunk = args.chunk_mb << 20
        size = int(a.request("GET", f"/v1/snapshots/{snap.id}/export", params={"chunk": chunk})["size"])
        report.info.update(archive_bytes=size, snapshot_bytes=snap.size_bytes)
        raw = homes[1] / "bench-archive"
        shutil.copyfile(homes[0] / "exports" / snap.id / "archive", raw)
        raw_http(report, raw, args.runs, homes[1])
        raw.unlink()
        for kind in ("warm", "cold"):
            res = report.result(f"import.{kind}")
            with recording(res, f"import {kind}"):
                for _ in range(args.runs):
                    if kind == "warm":
                        a.request("GET", f"/v1/snapshots/{snap.id}/export", params={"chunk": chunk})
                    with Timer() as t:
                        import_snapshot(b, a, snap.id, chunk_size=chunk)
                    res.add(t.s)
                    b.Snapshot.get(snap.id).delete()
        src = [homes[0] / "snapshots" / snap.id, homes[0] / "volume" / "snapshots" / snap.id]
        res = report.result("cp")
        with recording(res, "cp"):
            for _ in range(args.runs):
                dest = homes[1] / "volume" / f".bench-cp-{secrets.token_hex(4)}"
                dest.mkdir()
                with Timer() as t:
                    subprocess.run(["cp", "-a", "--reflink=never", *map(str, src), str(dest)], check=True)
                res.add(t.s)
                shutil.rmtree(dest)
        snap.delete()
        a.close()
        b.close()
    rows = []
    for key in ("import.warm", "import.cold", "http", "cp"):
        r = report.results.get(key)
        rate = _mib_s(size, r.samples) if r else None
        report.info[f"{key}.mib_s"] = rate
        cells = {}
        for base in ("http", "cp"):
            if key.startswith("import"):
                x = report.add_ratio(f"{key} rate / {base} rate", base, key)
                mark = "" if x is None else ("[green]>=50%[/green]" if x >= GOAL else "[red]<50%[/red]")
                cells[f"vs {base}"] = f"{fmt_ratio(x)} {mark}"
        rows.append(Row(f"{key} ({rate} MiB/s)", [r], None, cells))
    print_table(f"snapshot of {size / (1 << 20):.0f} MiB between two servers, ms (ratios: import rate / plain rate, "
                "goal >= 50%)", rows)
    report.print_errors()
    report.write(args.output)
    return 1 if report.fatal or report.errors or servers.left else 0


if __name__ == "__main__":
    sys.exit(main())
