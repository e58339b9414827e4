"""Memory forks of a sandbox whose process holds 100 MB: fork(1) and fork(8), phase by phase, lazy vs eager children.

What: ``Sandbox.fork(n, memory=True)`` of one long-lived sandbox running ``bench.sandbox_common.MEM_CODE`` (a Python
process with 100 MB of touched memory, checked through its VmRSS before the first fork), timed from the call to
every child's agent answering, against the issue's targets (fork(1) <= 100 ms, fork(8) <= 400 ms). Each child's
restore runs in one of two modes, alternated run by run on the same source so that the machine's load falls on both
alike:

- ``lazy``: the default, children restored with CRIU's ``--lazy-pages`` (``agentenv.snapshot.lazy_pages``): they run
  before their memory is in;
- ``eager``: every page copied before a child runs (``$AGENTENV_LAZY_PAGES=0``), the path before lazy restores.

Why: to know where a memory fork's milliseconds go before making it faster. The second table gives, per
phase (``agentenv.phases``), the wall-clock time it covered (first start to last end: the children's restores
overlap) and CRIU's own account of the dump ("criu: frozen", "criu: memdump", "criu: memwrite"). Once per mode and
count the last child is checked: its copy of the process runs and, once its memory is all in, holds the 100 MB.
The ratio is eager median / lazy median. Results: ``bench/results/fork_mem.json``.

    .venv/bin/python -m bench.fork_mem [--runs 5] [--counts 1,8] [--modes lazy,eager] [--output F]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator

from rich.table import Table

import agentenv
from agentenv import phases
from agentenv.snapshot.lazy_pages import LAZY_ENV
from bench.harness import Report, Result, Row, Timer, add_output_arg, console, median, print_table
from bench.sandbox_common import CPUS, IMAGE, MEM_CODE, MEM_MB, MEMORY, wait_until

MODES = {"lazy": "1", "eager": "0"}  # the value of $AGENTENV_LAZY_PAGES for each mode
TARGETS_MS = {1: 100.0, 8: 400.0}  # the issue's: child answering after fork(1), all answering after fork(8)


@contextlib.contextmanager
def mode(name: str) -> Iterator[None]:
    """Restore children in ``name``'s mode for the block (the env var is read at every restore)."""
    saved = os.environ.get(LAZY_ENV)
    os.environ[LAZY_ENV] = MODES[name]
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(LAZY_ENV, None)
        else:
            os.environ[LAZY_ENV] = saved


def rss_kb(sb: agentenv.Sandbox, pid: int) -> int:
    """The resident memory of process ``pid`` of ``sb``, in kB (0 if it has no such line)."""
    for line in sb.read_file(f"/proc/{pid}/status").decode().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def check_child(kid: agentenv.Sandbox, pid: int) -> int:
    """The child's copy of the 100 MB process runs and, once its memory is in, holds it; its VmRSS in kB."""
    r = kid.exec(f"test -d /proc/{pid}")
    if not r.ok:
        raise RuntimeError(f"the forked child has no process {pid}: {r}")
    wait_until(lambda: rss_kb(kid, pid) >= MEM_MB * 1000, 60, f"the child's process {pid} holding {MEM_MB} MB",
               every=0.05)
    return rss_kb(kid, pid)


def measure(report: Report, sb: agentenv.Sandbox, pid: int, counts: list[int], modes: list[str], runs: int) -> None:
    """fork(n) of ``sb`` ``runs`` times per count and mode, the modes alternated; every child closed after."""
    for n in counts:
        for i in range(runs):
            for name in modes:
                res = report.result(f"{name}.fork{n}")
                with mode(name), phases.recording() as found, Timer() as t:
                    kids = sb.fork(n, memory=True)
                try:
                    res.add(t.s)
                    for phase_name, secs in phases.spans(found).items():
                        res.add_extra(f"span:{phase_name}", secs)
                    if i == 0:
                        res.fields["child_rss_kb"] = check_child(kids[-1], pid)
                finally:
                    for k in kids:
                        k.close()


def print_phases(report: Report) -> None:
    """Median wall-clock span of each phase, per mode and count."""
    keys = [k for k, r in report.results.items() if r.samples]
    names: list[str] = []
    for k in keys:
        names += [e[5:] for e in report.results[k].extra if e.startswith("span:") and e[5:] not in names]
    table = Table(title="where the time went (median ms of each phase's wall-clock span; children overlap)")
    for col in ("fork", "total", *names):
        table.add_column(col, justify="left" if col == "fork" else "right", no_wrap=col == "fork")
    for k in keys:
        r = report.results[k]
        cells = [f"{m * 1e3:.1f}" if (m := median(r.extra.get(f"span:{n}", []))) is not None else "-" for n in names]
        table.add_row(k, f"{(median(r.samples) or 0) * 1e3:.1f}", *cells)
    console.print(table)


def rows(report: Report, counts: list[int], modes: list[str]) -> list[Row]:
    out = []
    for n in counts:
        for name in modes:
            r: Result | None = report.results.get(f"{name}.fork{n}")
            if r is None:
                continue
            med, target = median(r.samples), TARGETS_MS.get(n)
            met = None if med is None or target is None else med * 1e3 <= target
            r.fields.update(target_ms=target, met=met)
            x = (report.add_ratio(f"fork{n}", f"eager.fork{n}", f"lazy.fork{n}")
                 if name == "lazy" and "eager" in modes else None)
            out.append(Row(f"fork({n}), {name} children", [r], x,
                           {"target": "-" if target is None else f"<= {target:g}",
                            "met": "-" if met is None else ("[green]met[/green]" if met else "[red]missed[/red]")}))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--runs", type=int, default=5, help="forks per count and mode")
    ap.add_argument("--counts", default="1,8", help="children per fork, comma-separated (1..16)")
    ap.add_argument("--modes", default="lazy,eager", help=f"child restore modes, comma-separated, of {list(MODES)}")
    add_output_arg(ap, "fork_mem")
    args = ap.parse_args(argv)
    try:
        counts = [int(c) for c in args.counts.split(",")]
    except ValueError:
        ap.error(f"--counts takes integers, got {args.counts!r}")
    modes = args.modes.split(",")
    if args.runs < 1 or any(not 1 <= c <= 16 for c in counts):
        ap.error("--runs must be >= 1 and each count within 1..16")
    if unknown := set(modes) - set(MODES):
        ap.error(f"unknown modes {sorted(unknown)}; known: {list(MODES)}")

    report = Report("fork_mem", args)
    report.info.update(image=IMAGE, cpus=CPUS, memory=MEMORY, mem_process_mb=MEM_MB)
    sb = agentenv.Sandbox.create(IMAGE, cpus=CPUS, memory=MEMORY, labels={"agentenv.bench": "fork_mem"})
    try:
        proc = sb.spawn(f'exec python3 -c "{MEM_CODE}"')
        wait_until(lambda: "ready" in proc.output() and rss_kb(sb, proc.pid) >= MEM_MB * 1000, 60,
                   f"the {MEM_MB} MB process")
        report.info["source_rss_kb"] = rss_kb(sb, proc.pid)
        console.log(f"source: {sb.id}, process {proc.pid} holding {report.info['source_rss_kb']} kB; "
                    f"{args.runs} runs of fork{counts} in modes {modes}")
        measure(report, sb, proc.pid, counts, modes, args.runs)
    except Exception as e:  # noqa: BLE001 - recorded, printed, and the run fails
        report.fatal = f"{type(e).__name__}: {e}"
    finally:
        sb.close()
    print_table(f"memory fork of a {MEM_MB} MB process, ms (--runs {args.runs}; ratio = eager median / lazy median)",
                rows(report, counts, modes), ratio_title="eager/lazy")
    print_phases(report)
    report.print_errors()
    report.write(args.output)
    return 1 if report.fatal or report.errors else 0


if __name__ == "__main__":
    sys.exit(main())
