"""Benchmark agentenv sandboxes against the plain Docker path for the same operations.

What: median and p90 latency of each sandbox operation agentenv promises to make fast (create,
exec, filesystem and memory snapshots, fork(1) and fork(8) with memory and of the files only, pause,
resume, restore in a fresh process), next to the closest thing plain Docker offers through the Docker
SDK (``docker run``, ``docker exec``, ``docker commit``, ``docker checkpoint create``, and fork the
Docker way: checkpoint + commit + create from the committed image + copy the checkpoint + start from
it; for the files only, commit + create + start). A second table says where agentenv's milliseconds
went, phase by phase (freeze, fs, CRIU dump, CRIU restore or runc run, the agent's first answer ...),
as ``agentenv.phases`` timed them inside the operation.

Why: agentenv bypasses Docker's container plumbing (runc directly, CRIU through ``runc
checkpoint``, an in-sandbox agent instead of ``docker exec``) to make RL rollouts cheap to fork and
resume. This script checks the issue's latency targets and shows the speed-up over plain Docker.

Both sides use the same image (``agentenv/base``), no network (but in ``create_net``: agentenv's ``network=True``
against Docker's default bridge), 1 CPU and 1 GiB of memory. The
workloads are a git repository in /testbed with ~50 committed files and a few edits, and a Python
process holding ~100 MB of touched memory. Docker's checkpoint-based operations take seconds, so
they run ``--docker-runs`` times (cheap Docker operations run ``--runs`` times like agentenv's).
A failing operation is recorded with its error text; no figure is ever invented.

``OPERATIONS`` is the one table: each row names an operation, its agentenv and plain Docker
implementations (``bench/agentenv_ops.py``, ``bench/docker_ops.py``), the fixture it measures and how
many runs the Docker side takes; ``drive`` runs it for each side. Results go to
``bench/results/sandbox.json`` (keys ``agentenv.<op>`` and ``docker.<op>``, ratios = Docker median /
agentenv median); everything created is removed at the end, on error too.

The pool rows fork with a warm pool (``agentenv.sandbox.warm``) of POOL (8; 32 for fork(32)) sandboxes made like the
fork's source, full before each timed fork: the children are pooled sandboxes whose root is swapped for the clone.

The burst rows ask for BURST (64) sandboxes at once and time each from the release to its first command
answered (p50 and p99): with agentenv's admission bound (``agentenv.host.admission``), without it, and from a
warm pool of BURST started sandboxes (``agentenv.sandbox.warm``, filled before the burst).

    .venv/bin/python -m bench.sandbox [--runs 10] [--docker-runs 3] [--quick] [--no-docker] [--only burst]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import docker
from rich.table import Table

import agentenv
from agentenv.config import paths
from bench.agentenv_ops import AgentenvSide
from bench.docker_ops import DockerSide
from bench.harness import Report, Row, add_output_arg, console, median, print_table
from bench.sandbox_common import BURST, CPUS, IMAGE, MEM_MB, MEMORY, POOL, Cleanup, Side

A, D = AgentenvSide, DockerSide


@dataclass(frozen=True)
class Op:
    """One operation of the table. ``agentenv`` / ``docker`` are the methods that measure it on each side
    (None: measured by the row named in ``measured_by``, or no counterpart); ``fixture`` is the long-lived
    sandbox it measures ("repo", "mem", or "fork": the one --fork-source names); ``slow``: the Docker side
    runs --docker-runs times instead of --runs."""

    name: str
    label: str
    docker_how: str
    target_ms: float | None
    agentenv: Callable[[Any, int], None] | None
    docker: Callable[[Any, int], None] | None
    fixture: str | None = None
    slow: bool = False
    measured_by: str | None = None


OPERATIONS: list[Op] = [
    Op("create", "create -> exec-ready", "docker run -> running", 150.0, A.create, D.create),
    Op("create_net", "create, network=True -> exec-ready", "docker run, bridge -> running", None, A.create_net,
       D.create_net),
    Op("burst", f"{BURST} creates at once -> 1st exec", "docker run + exec, all at once", 150.0, A.burst, D.burst),
    Op("burst_unbounded", "... without admission bound", "-", None, A.burst_unbounded, None),
    Op("burst_warm", f"... from a warm pool of {BURST}", "-", 150.0, A.burst_warm, None),
    Op("exec", "exec `true` round trip", "docker exec `true`", 5.0, A.exec, D.exec),
    Op("fs_snapshot", "fs snapshot (git repo+edits)", "docker commit", 20.0, A.fs_snapshot, D.fs_snapshot,
       fixture="repo"),
    Op("fork1", "fork(1) with memory -> running", "ckpt+commit+create+cp+start", 150.0, A.fork1, D.fork1,
       fixture="fork", slow=True),
    Op("fork1_exec", "first exec in forked child", "docker exec in child", None, None, None, measured_by="fork1"),
    Op("fork8", "fork(8) with memory -> all running", "ckpt+commit+8x(create+cp+start)", 600.0, A.fork8, D.fork8,
       fixture="fork", slow=True),
    Op("fork1_fs", "fork(1), files only -> running", "commit+create+start", 60.0, A.fork1_fs, D.fork1_fs,
       fixture="fork"),
    Op("fork1_fs_exec", "first exec in fs-forked child", "docker exec in child", None, None, None,
       measured_by="fork1_fs"),
    Op("fork8_fs", "fork(8), files only -> all running", "commit+8x(create+start)", 250.0, A.fork8_fs, D.fork8_fs,
       fixture="fork"),
    Op("fork1_fs_pool", f"... fork(1), children from a warm pool of {POOL}", "- (as fork(1), files only)", 60.0,
       A.fork1_fs_pool, None, fixture="fork"),
    Op("fork1_fs_pool_exec", "first exec in a pooled child", "-", None, None, None, measured_by="fork1_fs_pool"),
    Op("fork8_fs_pool", f"... fork(8), children from a warm pool of {POOL}", "- (as fork(8), files only)", 250.0,
       A.fork8_fs_pool, None, fixture="fork"),
    Op("fork32_fs", "fork(32), files only -> all running", "-", None, A.fork32_fs, None, fixture="fork"),
    Op("fork32_fs_pool", "... fork(32), children from a warm pool of 32", "-", None, A.fork32_fs_pool, None,
       fixture="fork"),
    Op("mem_snapshot", f"memory snapshot ({MEM_MB} MB proc)", "checkpoint create", 100.0, A.mem_snapshot,
       D.mem_snapshot, fixture="mem", slow=True),
    Op("pause", f"pause ({MEM_MB} MB sandbox)", "checkpoint create --exit", None, A.pause, D.pause,
       fixture="mem", slow=True),
    Op("resume", f"resume ({MEM_MB} MB sandbox)", "start --checkpoint", 80.0, None, None, measured_by="pause"),
    Op("restore", "restore, fresh proc (in-proc)", "create+cp+start --checkpoint", None, A.restore, D.restore,
       fixture="mem", slow=True),
    Op("restore_wall", "restore, fresh proc (wall)", "-", None, None, None, measured_by="restore"),
]


def settle() -> None:
    """Wait until the volume has finished dropping what the last row deleted (btrfs cleans deleted subvolumes up
    in a kernel thread, and a row measured meanwhile paid for it: a 100 MB memory snapshot took 130 ms right after
    the fork(32) rows, 84-97 ms on its own)."""
    volume = paths().volume
    if os.path.ismount(volume) and shutil.which("btrfs"):
        subprocess.run(["btrfs", "subvolume", "sync", str(volume)], capture_output=True, timeout=300, check=False)


def drive(side: Side, runs: int, docker_runs: int, only: set[str] | None = None) -> None:
    """Run every operation of the table that ``side`` implements (of ``only``, when given), in order; fixtures
    go once unused."""
    def impl(op: Op) -> Callable[[Any, int], None] | None:
        return op.agentenv if side.name == "agentenv" else op.docker

    todo = [op for op in OPERATIONS if impl(op) is not None and (only is None or op.name in only)]
    for i, op in enumerate(todo):
        fn = impl(op)
        assert fn is not None
        n = docker_runs if op.slow and side.name == "docker" else runs
        console.log(f"{side.name}: {op.name} x{n}")
        fn(side, n)
        settle()
        mine = side.results.get(op.name)
        for o in OPERATIONS:  # rows measured along with this one share its failure when they got nothing
            r = side.results.get(o.name)
            if o.measured_by == op.name and mine and mine.error and r is not None and not (r.samples or r.error):
                r.fail(f"not measured: {op.name} failed ({mine.error})")
        side.release({o.fixture for o in todo[i + 1:] if o.fixture})
    side.release(set())


def docker_engine(client: docker.DockerClient) -> dict[str, Any] | str:
    try:
        v, d = client.version(), client.info()
    except Exception as e:  # noqa: BLE001
        return f"error: {e}"
    return {"version": v.get("Version"), "api": v.get("ApiVersion"), "experimental": v.get("Experimental"),
            "storage_driver": d.get("Driver"), "cgroup_version": d.get("CgroupVersion"),
            "default_runtime": d.get("DefaultRuntime")}


def build_report(report: Report, sides: list[Side], no_docker: bool) -> list[Row]:
    by_name = {s.name: s for s in sides}
    a = by_name.get("agentenv")
    d = by_name.get("docker")
    rows = []
    for op in OPERATIONS:
        ar = a.results.get(op.name) if a else None
        dr = d.results.get(op.name) if d else None
        if ar is None and dr is None:  # not run (--only)
            continue
        if ar is not None:
            report.results[f"agentenv.{op.name}"] = ar
            med = median(ar.samples)
            ar.fields["target_ms"] = op.target_ms
            ar.fields["met"] = None if op.target_ms is None or med is None else med * 1e3 <= op.target_ms
        if dr is not None:
            report.results[f"docker.{op.name}"] = dr
            dr.fields["how"] = op.docker_how
        x = report.add_ratio(op.name, f"docker.{op.name}", f"agentenv.{op.name}") if dr and ar else None
        met = ar.fields["met"] if ar is not None else None
        cells = {"target": "-" if op.target_ms is None else f"<= {op.target_ms:g}",
                 "met": "-" if op.target_ms is None else ("[red]n/a[/red]" if met is None else
                                                           "[green]met[/green]" if met else "[red]missed[/red]"),
                 "plain Docker (how)": "--no-docker" if no_docker else op.docker_how}
        if dr is not None and dr.fields.get("retries"):
            cells["retries"] = str(dr.fields["retries"])
        rows.append(Row(op.label, [ar, dr], x, cells))
    return rows


PHASE = "phase:"


def print_breakdown(report: Report) -> None:
    """Where each agentenv operation's milliseconds went: the median of each phase (``agentenv.phases``) next to
    the median total. A phase of several children is their sum, so a fork of 8 can show more than its total."""
    ops = [(k, r) for k, r in report.results.items() if k.startswith("agentenv.") and
           any(e.startswith(PHASE) for e in r.extra)]
    if not ops:
        return
    names: list[str] = []
    for _, r in ops:
        names += [e[len(PHASE):] for e in r.extra if e.startswith(PHASE) and e[len(PHASE):] not in names]
    table = Table(title="where the time went (agentenv, median ms per phase; children summed)")
    for col in ("operation", "total", *names):
        table.add_column(col, justify="left" if col == "operation" else "right")
    for key, r in ops:
        total = median(r.samples)
        cells = [f"{m * 1e3:.1f}" if (m := median(r.extra.get(PHASE + n, []))) is not None else "-" for n in names]
        table.add_row(key.removeprefix("agentenv."), "-" if total is None else f"{total * 1e3:.1f}", *cells)
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--runs", type=int, default=10, help="runs per agentenv operation (and cheap Docker ones)")
    ap.add_argument("--docker-runs", type=int, default=3, help="runs per Docker checkpoint-based operation")
    ap.add_argument("--quick", action="store_true", help="smoke run: 3 runs each, 1 per Docker checkpoint op")
    ap.add_argument("--no-docker", action="store_true", help="skip the plain Docker side")
    ap.add_argument("--fork-source", choices=("repo", "mem"), default="repo",
                    help="fork the git-repo sandbox (default) or the 100 MB one")
    ap.add_argument("--only", help="comma-separated operations to run (e.g. burst,burst_unbounded)")
    ap.add_argument("--docker-burst", type=int, default=BURST,
                    help=f"sandboxes of the Docker side's burst row (default {BURST}; smaller where that is slow)")
    add_output_arg(ap, "sandbox")
    args = ap.parse_args(argv)
    runs = 3 if args.quick else args.runs
    docker_runs = 1 if args.quick else args.docker_runs
    if runs < 1 or docker_runs < 1:
        ap.error("--runs and --docker-runs must be >= 1")
    only = set(args.only.split(",")) if args.only else None
    if only is not None and (unknown := only - {op.name for op in OPERATIONS}):
        ap.error(f"unknown operations {sorted(unknown)}")

    # SIGTERM must run the finally blocks too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    report = Report("sandbox", {"runs": runs, "docker_runs": docker_runs, "quick": args.quick,
                                "no_docker": args.no_docker, "fork_source": args.fork_source})
    report.info.update(run_id=run_id, image=IMAGE, cpus=CPUS, memory=MEMORY, mem_process_mb=MEM_MB)
    report.machine["agentenv"] = agentenv.__version__
    cleanup = Cleanup(run_id)
    client: docker.DockerClient | None = None
    sides: list[Side] = []
    try:
        client = docker.from_env(timeout=300)
        client.ping()
        report.machine["docker_engine"] = docker_engine(client)
        console.log(f"run {run_id}: {runs} agentenv runs, {docker_runs} Docker checkpoint runs, "
                    f"{report.machine['cpus']} CPUs, kernel {report.machine['kernel']}")
        sides.append(AgentenvSide(cleanup, args.fork_source))
        drive(sides[-1], runs, docker_runs, only)
        if not args.no_docker:
            docker_side = DockerSide(client, cleanup, args.fork_source)
            docker_side.burst_size = args.docker_burst
            sides.append(docker_side)
            drive(sides[-1], runs, docker_runs, only)
    except BaseException as e:
        report.fatal = f"{type(e).__name__}: {e}"
        console.print(f"[red]benchmark aborted:[/red] {report.fatal}", highlight=False)
        if not isinstance(e, KeyboardInterrupt | SystemExit):
            console.print(traceback.format_exc(), style="dim", markup=False, highlight=False)
    finally:
        console.log("cleaning up")
        cleanup.all(client)
    if not sides:
        report.write(args.output)
        return 1

    rows = build_report(report, sides, args.no_docker)
    report.info.update({f"{s.name}_info": s.info for s in sides})
    report.info["cleanup_errors"] = cleanup.errors
    print_table(f"agentenv vs plain Docker, ms (--runs {runs}, Docker checkpoint ops --docker-runs {docker_runs}; "
                "speed-up = Docker median / agentenv median)", rows, sides=("agentenv", "Docker"),
                ratio_title="speed-up")
    print_breakdown(report)
    report.print_errors()
    for key, r in report.results.items():
        if r.fields.get("retries"):
            console.print(f"[yellow]{key}[/yellow]: start --checkpoint retried {r.fields['retries']}x after "
                          f"moby#42900 ({r.fields['retry_errors'][0][:160]}); the retries count in its time",
                          highlight=False)
    if cleanup.errors:
        console.print("[yellow]cleanup problems:[/yellow] " + "; ".join(cleanup.errors), highlight=False)
    report.write(args.output)
    return 1 if report.fatal or report.errors else 0


if __name__ == "__main__":
    sys.exit(main())
