"""Time to interactive the way ComputeSDK's sandbox benchmark measures it: ``create()`` to the first command answered.

Each iteration starts a timer, creates a sandbox, runs ``echo benchmark`` in it (the answer is checked), stops the
timer and then closes the sandbox, untimed. Three modes, as ComputeSDK runs them:

- sequential: one iteration after another (cold starts with no contention);
- staggered: ``n`` iterations launched 200 ms apart (load ramping up);
- burst: ``n`` iterations released at once (a spike: admission queueing, failures under peak demand).

Each mode runs through the E2B SDK and through the native client (``agentenv.connect``) against one
``agentenv serve`` on loopback, in the same run; the ratio is E2B over native. Reported: min, median, p90, p95,
p99, max and the success rate (an iteration that raises, or whose command answers wrongly, is a failure, and
its time is not a sample). The published 100-burst figures (ComputeSDK, 2026-05-04) are set beside ours: those
providers run on clusters reached over the internet; this is one 2-core host on loopback, where every start
shares the same two cores, so a burst here measures queueing on one machine, not a fleet's capacity.

    .venv/bin/python -m bench.burst [--n 100] [--stagger-ms 200]
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rich.table import Table

import agentenv
from bench.harness import Report, Result, Row, add_output_arg, console, percentile, print_table
from bench.server import e2b_serving

MODES = ("sequential", "staggered", "burst")
COMMAND = "echo benchmark"
# ComputeSDK's published 100-burst time to interactive, 2026-05-04: (median, p99) in ms
ANCHORS = {"Daytona": (328, 676), "E2B": (865, 960), "Modal": (1961, 2777)}

Iteration = Callable[[], tuple[float, Callable[[], object]]]  # -> (seconds to interactive, close)


def e2b_iteration() -> tuple[float, Callable[[], object]]:
    from e2b import Sandbox

    t = time.perf_counter()
    sb = Sandbox.create()
    try:
        out = sb.commands.run(COMMAND).stdout
    except BaseException:
        sb.kill()
        raise
    took = time.perf_counter() - t
    if out.strip() != "benchmark":
        sb.kill()
        raise RuntimeError(f"the command answered {out!r}")
    return took, sb.kill


def native_iteration(client: Any) -> Iteration:
    def run() -> tuple[float, Callable[[], object]]:
        t = time.perf_counter()
        sb = client.Sandbox.create()
        try:
            out = sb.exec(COMMAND).stdout
        except BaseException:
            sb.close()
            raise
        took = time.perf_counter() - t
        if out.strip() != "benchmark":
            sb.close()
            raise RuntimeError(f"the command answered {out!r}")
        return took, sb.close

    return run


def run_mode(result: Result, iteration: Iteration, mode: str, n: int, stagger: float) -> None:
    """``n`` iterations in ``mode``; samples into ``result``, with its success rate and first failure."""
    failures: list[str] = []
    lock = threading.Lock()
    gate = threading.Event()

    def one() -> None:
        gate.wait()
        try:
            took, close = iteration()
        except Exception as e:  # noqa: BLE001 - a failed iteration is counted, as ComputeSDK counts it
            with lock:
                failures.append(f"{type(e).__name__}: {e}")
            return
        with lock:
            result.add(took)
        try:
            close()
        except Exception as e:  # noqa: BLE001 - a close that fails is reported, not timed
            with lock:
                failures.append(f"close: {type(e).__name__}: {e}")

    if mode == "sequential":
        gate.set()
        for _ in range(n):
            one()
    else:
        with ThreadPoolExecutor(max_workers=n) as pool:
            futures = []
            for i in range(n):
                futures.append(pool.submit(one))
                if mode == "staggered":
                    gate.set()
                    if i < n - 1:
                        time.sleep(stagger)
            gate.set()  # a burst: every thread is waiting, released at once
            for f in futures:
                f.result()
    result.fields["success_rate"] = round(len(result.samples) / n, 4)
    result.fields["failures"] = len(failures)
    if result.samples:
        p95 = percentile(result.samples, 0.95)
        result.fields["p95_ms"] = None if p95 is None else round(p95 * 1e3, 3)
    if failures:
        result.note = f"{len(failures)} of {n} failed; first: {failures[0][:300]}"


def anchor_rows(report: Report, n: int) -> list[list[str]]:
    """Our burst of ``n`` beside the published 100-bursts: (who, median ms, p99 ms, where)."""
    rows = [[who, f"{med}", f"{p99}", "ComputeSDK, 2026-05-04, a cluster over the internet"]
            for who, (med, p99) in ANCHORS.items()]
    for side in ("e2b", "native"):
        r = report.results.get(f"{side}.burst")
        st = r.stat if r else None
        if st is not None:
            rows.append([f"agentenv ({side} client)", f"{st.median * 1e3:.0f}", f"{st.p99 * 1e3:.0f}",
                         f"a burst of {n} on one {os.cpu_count()}-core host, loopback, success "
                         f"{r.fields.get('success_rate') if r else '-'}"])
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--n", type=int, default=100, help="iterations per mode (ComputeSDK: 100)")
    ap.add_argument("--stagger-ms", type=float, default=200, help="delay between launches when staggered")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    add_output_arg(ap, "burst")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad or args.n < 1:
        ap.error(f"unknown mode(s) {bad}; choose from {MODES}" if bad else "--n must be at least 1")
    report = Report("burst", {k: v for k, v in vars(args).items() if k != "output"})
    with e2b_serving(report, "burst", max_sandboxes=args.n + 16) as (url, token):
        native = native_iteration(agentenv.connect(url, token))
        for mode in modes:
            for side, iteration in (("native", native), ("e2b", e2b_iteration)):
                console.print(f"{mode}: {args.n} x create -> '{COMMAND}' through the {side} client", highlight=False)
                run_mode(report.result(f"{side}.{mode}"), iteration, mode, args.n, args.stagger_ms / 1e3)
    rows = []
    for mode in modes:
        x = report.add_ratio(f"{mode} e2b/native", f"e2b.{mode}", f"native.{mode}")
        sides = [report.results.get(f"e2b.{mode}"), report.results.get(f"native.{mode}")]
        rows.append(Row(mode, sides, x, {
            "p95 e2b / native": " / ".join(str(r.fields.get("p95_ms", "-")) if r else "-" for r in sides),
            "success e2b / native": " / ".join(str(r.fields.get("success_rate", "-")) if r else "-"
                                               for r in sides)}))
    print_table(f"time to interactive (create -> '{COMMAND}' answered), ms; ratio = E2B SDK median / native "
                "median, same server, same run", rows, sides=("e2b", "native"), p99=True)
    report.info["anchors_100_burst_ms"] = {who: {"median": m, "p99": p} for who, (m, p) in ANCHORS.items()}
    table = Table(title="100-burst time to interactive beside the published figures")
    for col in ("who", "median ms", "p99 ms", "where"):
        table.add_column(col)
    for row in anchor_rows(report, args.n):
        table.add_row(*row)
    console.print(table)
    for r in report.results.values():
        if r.note:
            console.print(f"[yellow]note[/yellow] {r.note}", highlight=False)
    report.print_errors()
    report.write(args.output)
    return 1 if report.fatal else 0


if __name__ == "__main__":
    raise SystemExit(main())
