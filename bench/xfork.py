"""Benchmark a fork spread over servers: ``fork(8)`` of a sandbox whose process holds 100 MB of touched memory
(``bench.sandbox``'s "mem" workload), on its own server against across two.

What: two ``agentenv serve`` processes on loopback, each with its own $AGENTENV_HOME (their own stores; the same
Docker engine and CPUs). ``local`` (the plain alternative): the parent on B (room for all), ``fork(8)`` there.
``spread``: the parent on A, which has room for ``--room`` of the children; a pool of A and B forks it: A
restores its share from one memory snapshot, B pulls that snapshot (packed once on A) and restores the rest
(``agentenv.remote.spread``). ``remote``: as spread, A full (filler sandboxes take its room): all 8 on B.
Each sample: from the call to all 8 children running; every child is then checked to hold the process (not
timed). Phases (wall-clock spans within a spread fork, seen from the client): dump (the memory snapshot on A),
export (A packs it), import (B pulls it: download, sha256 checks and unpacking, pipelined), restore (every
child's restore, both servers, overlapping the import on A). Ratio: spread / local median; the issue's target
is <= 2x. Results go to ``bench/results/xfork.json``.

    .venv/bin/python -m bench.xfork [--runs 5] [--n 8] [--room 4]
"""

from __future__ import annotations

import argparse
import sys
import time

import agentenv
from agentenv import phases
from agentenv.remote.client import Client, RemoteSandbox
from bench.harness import Report, Result, Row, add_output_arg, print_table, recording
from bench.sandbox_common import MEM_CODE, MEM_MB
from bench.server import separate_servers

TARGET = 2.0  # the target: a cross-server fork(8) within 2x a local one
MEMORY = "512m"
PHASES = ("dump", "export", "import", "restore")


def prepare(client: Client) -> RemoteSandbox:
    """The parent: a process holding MEM_MB of touched memory, and a file."""
    sb = client.Sandbox.create(memory=MEMORY)
    sb.write_file("/srv/state", "kept\n")
    sb.write_file("/tmp/mem.py", MEM_CODE)
    sb.spawn("python3 /tmp/mem.py > /tmp/mem.out")
    sb.exec("until grep -q ready /tmp/mem.out; do sleep 0.05; done", timeout=120)
    return sb


def check(kids: list[RemoteSandbox]) -> None:
    for k in kids:
        r = k.exec("pgrep -f '[/]tmp/mem.py' >/dev/null && cat /srv/state", timeout=60)
        if r.exit_code != 0 or r.stdout != "kept\n":
            raise RuntimeError(f"child {k.id} lacks the parent's process or file: {r.exit_code} {r.stderr!r}")


def once(res: Result, sb: RemoteSandbox, n: int, where: dict[str, int]) -> None:
    """One fork of ``sb`` into ``n``: its time and phase spans into ``res``, its children counted by server."""
    with phases.recording() as found:
        t0 = time.perf_counter()
        kids = sb.fork(n)
        res.add(time.perf_counter() - t0)
    try:
        for name, seconds in phases.spans(found).items():
            res.add_extra(name.removeprefix("spread: "), seconds)
        for k in kids:
            where[k.client.url] = where.get(k.client.url, 0) + 1
        check(kids)
    finally:
        for k in kids:
            k.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--n", type=int, default=8, help="children per fork")
    ap.add_argument("--room", type=int, default=4, help="children the source's server has room for (spread)")
    add_output_arg(ap, "xfork")
    args = ap.parse_args(argv)
    if not 0 < args.room < args.n:
        ap.error("--room must be between 1 and --n - 1 (the spread case); --n children must not all fit")
    report = Report("xfork", {k: v for k, v in vars(args).items() if k != "output"})
    report.info.update(mem_process_mb=MEM_MB, sandbox_memory=MEMORY)
    settings = [{"max_sandboxes": quota, "log": True} for quota in (args.room + 1, args.n + 1)]  # A: the parent, --room more
    with separate_servers(report, "xfork", settings) as servers:
        url_a, url_b = servers.urls
        with agentenv.Pool([url_a, url_b], servers.token, timeout=600) as pool, Client(url_b, servers.token, timeout=600) as b:
            plain = prepare(b)  # of a plain client: its fork stays on B
            parent = prepare(pool.clients[0])
            snap = parent.snapshot(memory=True)  # the archive's size, for the report
            report.info["archive_bytes"] = pool.clients[0].request("GET", f"/v1/snapshots/{snap.id}/export")["size"]
            snap.delete()
            where: dict[str, dict[str, int]] = {"spread": {}, "remote": {}}
            for _ in range(args.runs):  # the three in turn: a machine shared with other jobs drifts
                with recording(report.result("local"), "local"):
                    once(report.results["local"], plain, args.n, {})
                with recording(report.result("spread"), "spread"):
                    once(report.results["spread"], parent, args.n, where["spread"])
                fillers = [pool.clients[0].Sandbox.create(memory="64m") for _ in range(args.room)]  # A full
                try:
                    with recording(report.result("remote"), "remote"):
                        once(report.results["remote"], parent, args.n, where["remote"])
                finally:
                    for f in fillers:
                        f.close()
            for key, counts in where.items():
                report.info[f"{key}_children"] = {"source": counts.get(url_a, 0), "other": counts.get(url_b, 0)}
            plain.close()
            parent.close()
    xs = {key: report.add_ratio(f"{key} fork({args.n}) / local fork({args.n})", key, "local")
          for key in ("spread", "remote")}
    spread = report.ratios[f"spread fork({args.n}) / local fork({args.n})"]["value"]
    report.info.update(target_ratio=TARGET, within_target=None if spread is None else spread <= TARGET)
    rows = [Row(f"local: fork({args.n}) on one server", [report.results.get("local")])]
    for key, what in (("spread", f"{args.room} on the source's server, the rest on the other"),
                      ("remote", "source full: all on the other")):
        r = report.results.get(key)
        rows.append(Row(f"{key}: {what}", [r], xs[key]))
        for name in PHASES:
            if r and name in r.extra:
                rows.append(Row(f"  {key}: {name}", [Result(samples=r.extra[name])]))
    print_table(f"fork({args.n}) of a sandbox holding {MEM_MB} MB in a process, ms (ratio: vs local; "
                f"target <= {TARGET:g}x)", rows)
    report.print_errors()
    report.write(args.output)
    return 1 if report.fatal or report.errors or servers.left else 0


if __name__ == "__main__":
    sys.exit(main())
