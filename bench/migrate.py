"""Benchmark migration downtime: a sandbox paused on server A and restored on server B through the shared
snapshot store (stop-and-copy), or migrated running (post-copy), against a pause and resume on one server.

What: three ``agentenv serve`` processes on loopback, each with its own $AGENTENV_HOME; A and B share a
``--shared-store`` folder, C has none. A sandbox holds ``--mb`` MiB of random bytes in a process's memory
(and a file). ``migrate``: the sandbox answers on A (``exec``), is paused there (the pause publishes its
archive to the shared store), restored on B (B imports it, digests checked, then CRIU restores) and answers
there; downtime = from A's last answer to B's first, the sandbox going back and forth between A and B.
``postcopy``: the same sandbox moved with ``Pool.Sandbox.move(..., post_copy=True)``: frozen on A, dumped lazily
(all but its anonymous memory; the rest served by CRIU's page server on 127.0.0.1), imported and restored
lazily on B, where it answers while its pages still come in; downtime = A's last answer to B's first (inside
``on_running``), and ``all pages in`` from that answer until the move returned (B has every page, A closed its
copy). Its phase split comes from the times of the move's calls (migrate on A, import and restore on B).
``local`` (the plain alternative, on C): last answer, pause, resume, first answer. Ratios: stop-and-copy and
post-copy vs local, post-copy vs stop-and-copy; the issue's target is <= 150 ms (post-copy). Results go to
``bench/results/migrate.json``.

    .venv/bin/python -m bench.migrate [--runs 5] [--mb 256] [--modes migrate,postcopy,local]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import agentenv
from agentenv.remote.client import Client, RemoteSandbox
from bench.harness import Report, Result, Row, add_output_arg, print_table, recording
from bench.server import separate_servers

TARGET_S = 0.150  # the target downtime (post-copy migration)
MODES = ("migrate", "postcopy", "local")
# a process holding MiB of random bytes (argv[1]); its pid in /tmp/pid once they are all in memory
HOLDER = ("import os, sys, time\nb = os.urandom(int(sys.argv[1]) << 20)\n"
          "open('/tmp/pid', 'w').write(str(os.getpid()))\nwhile True: time.sleep(3600)\n")
ALIVE = "kill -0 $(cat /tmp/pid) && cat /srv/state"


def answer(sb: RemoteSandbox) -> float:
    """The sandbox answers (its holder process alive, its file there); the time of the answer."""
    r = sb.exec(ALIVE, timeout=60)
    if r.exit_code != 0 or r.stdout != "kept\n":
        raise RuntimeError(f"sandbox {sb.id} lost its state: exit {r.exit_code}, {r.stdout!r} {r.stderr!r}")
    return time.perf_counter()


def prepare(client: Client, mb: int) -> RemoteSandbox:
    sb = client.Sandbox.create(memory=f"{mb + 256}m")
    sb.write_file("/srv/state", "kept\n")
    sb.write_file("/tmp/holder.py", HOLDER)
    sb.spawn(f"python3 /tmp/holder.py {mb}")
    sb.exec("while [ ! -s /tmp/pid ]; do sleep 0.05; done", timeout=120)
    return sb


def migrate(report: Report, pool: agentenv.Pool, sb: RemoteSandbox, runs: int) -> RemoteSandbox:
    """Pause on one server, restore on the other (through the shared store), ``runs`` times back and forth."""
    res, a, b = report.result("migrate"), pool.clients[0], pool.clients[1]
    with recording(res, "migrate"):
        for _ in range(runs):
            there = b if sb.client is a else a
            last = answer(sb)
            snap = sb.pause()
            paused = time.perf_counter()
            moved = pool.Sandbox.restore(snap, server=there.url)
            restored = time.perf_counter()
            first = answer(moved)
            res.add(first - last)
            res.add_extra("pause+publish", paused - last)
            res.add_extra("import+restore", restored - paused)
            sb.close()  # its pause snapshot and the shared copy go
            there.Snapshot.get(snap.id).delete()  # the copy B imported
            sb = moved
    return sb


def timed_calls(clients: list[Client]) -> dict[str, list[float]]:
    """Record how long each call of these clients takes, by its first path words ("POST migrate", ...)."""
    times: dict[str, list[float]] = {}
    for c in clients:
        def timed(method: str, path: str, *args: Any, _real: Any = c.request, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return _real(method, path, *args, **kw)
            finally:
                words = [w for w in path.split("/")[2:] if not w.startswith(("sb-", "snap-"))]
                times.setdefault(f"{method} {'/'.join(words)}", []).append(time.perf_counter() - t)
        c.request = timed  # type: ignore[method-assign]
    return times


# the calls of a post-copy move, by what they do (timed_calls' keys)
POSTCOPY_PHASES = {"POST sandboxes/migrate": "A: lazy dump (page server listening)",
                   "POST snapshots/import": "B: import the images", "POST snapshots/receive": "B: lazy restore"}


def postcopy(report: Report, pool: agentenv.Pool, sb: RemoteSandbox, runs: int) -> RemoteSandbox:
    """Move the sandbox post-copy between A and B, ``runs`` times back and forth."""
    res, a, b = report.result("postcopy"), pool.clients[0], pool.clients[1]
    calls = timed_calls([a, b])
    firsts: list[float] = []  # the time of the first answer on B, each run
    with recording(res, "postcopy"):
        for _ in range(runs):
            there = b if sb.client is a else a
            firsts.clear()
            for c in calls.values():
                c.clear()
            last = answer(sb)
            moved = pool.Sandbox.move(sb, there.url, post_copy=True, on_running=lambda m: firsts.append(answer(m)))
            done = time.perf_counter()
            res.add(firsts[0] - last)
            for key, name in POSTCOPY_PHASES.items():
                res.add_extra(name, sum(calls.get(key, [])))
            res.add_extra("first answer on B, after restore", firsts[0] - last - sum(
                sum(calls.get(k, [])) for k in POSTCOPY_PHASES))
            res.add_extra("all pages in (after the first answer)", done - firsts[0])
            sb = moved
    return sb


def local(report: Report, sb: RemoteSandbox, runs: int) -> None:
    res = report.result("local")
    with recording(res, "local"):
        for _ in range(runs):
            last = answer(sb)
            sb.pause()
            paused = time.perf_counter()
            sb.resume()
            resumed = time.perf_counter()
            first = answer(sb)
            res.add(first - last)
            res.add_extra("pause", paused - last)
            res.add_extra("resume", resumed - paused)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--mb", type=int, default=256, help="MiB of random bytes a process of the sandbox holds")
    ap.add_argument("--modes", default=",".join(MODES), help=f"which to measure, of {','.join(MODES)}")
    add_output_arg(ap, "migrate")
    args = ap.parse_args(argv)
    modes = set(args.modes.split(","))
    if not modes or not modes <= set(MODES):
        ap.error(f"--modes takes some of {','.join(MODES)}, not {args.modes!r}")
    report = Report("migrate", {k: v for k, v in vars(args).items() if k != "output"})
    shared = Path(tempfile.mkdtemp(prefix="agentenv-bench-shared-", dir="/var/tmp"))
    settings = [{"max_sandboxes": 4, "extra": ["--shared-store", str(shared)]}] * 2 + [{"max_sandboxes": 4}]
    with separate_servers(report, "mig", settings) as servers, \
            agentenv.Pool(servers.urls[:2], servers.token, timeout=600) as pool, \
            Client(servers.urls[2], servers.token, timeout=600) as c:  # C: no shared store
        sb = prepare(pool.clients[0], args.mb)
        snap = sb.snapshot(memory=True)  # the archive's size, for the report
        report.info["archive_bytes"] = sum(p.stat().st_size for p in (shared / snap.id).glob("archive"))
        snap.delete()
        if "migrate" in modes:
            sb = migrate(report, pool, sb, args.runs)
        if "postcopy" in modes:
            sb = postcopy(report, pool, sb, args.runs)
        sb.close()
        if "local" in modes:
            plain = prepare(c, args.mb)
            local(report, plain, args.runs)
            plain.close()
    report.info["shared_store_left"] = sorted(p.name for p in shared.iterdir())
    shutil.rmtree(shared, ignore_errors=True)
    x = report.add_ratio("migrate downtime / local pause+resume downtime", "migrate", "local")
    xp = report.add_ratio("post-copy downtime / stop-and-copy downtime", "postcopy", "migrate")
    report.add_ratio("post-copy downtime / local pause+resume downtime", "postcopy", "local")
    m, p = report.results.get("migrate"), report.results.get("postcopy")
    med = p.stat.median if p and p.stat else None
    report.info["target_s"] = TARGET_S
    report.info["gap_to_target"] = None if med is None else round(med / TARGET_S, 2)  # post-copy's
    rows = [Row("migrate A -> B (stop-and-copy, shared store)", [m], x),
            Row("migrate A -> B post-copy (ratio: vs stop-and-copy)", [p], xp),
            Row("local pause + resume", [report.results.get("local")])]
    for key in ("migrate", "postcopy", "local"):
        r = report.results.get(key)
        for name, samples in (r.extra.items() if r else ()):
            rows.append(Row(f"  {key}: {name}", [Result(samples=samples)]))
    print_table(f"downtime of a sandbox holding {args.mb} MiB in memory, ms (ratios: stop-and-copy / local, "
                f"post-copy / stop-and-copy; target <= {TARGET_S * 1000:.0f} ms)", rows)
    report.print_errors()
    report.write(args.output)
    return 1 if report.fatal or report.errors or servers.left or report.info["shared_store_left"] else 0


if __name__ == "__main__":
    sys.exit(main())
