"""Density: what a fork family costs in host memory with and without ``share_memory`` (KSM), in one run.

Workload (``python -m bench.density``):

- family: a parent sandbox whose one Python process holds ``--mb`` (256) MB of random bytes (``os.urandom``)
  and reads one byte of each page every second, then ``fork(--forks)`` (16) with memory. Host memory used
  (MemTotal - MemAvailable, minus its value before the parent) and the sum of the 1 + N sandboxes' cgroup
  memory are sampled each second for ``--window`` (30) s after the fork returns (plain: ending early once the
  family's memory held within 2% for 5 samples; sharing: the whole window, noting when KSM had saved 90% of the
  children's copies). Once with plain sandboxes, once with share_memory=True.
  Ratios: overcommit (1 + N times one sandbox's memory / the family's), family / one sandbox, private / shared;
  ksmd CPU seconds per GB merged (its /proc stat), and its CPU share while scanning after the merge.
- fork(1) and fork(8) of a sandbox holding 100 MB (bench.sandbox's MEM_CODE), ``--runs`` each, plain and
  sharing: median, p90, and where the time went (``agentenv.phases``, summed over the children).
- idle overhead: agent RSS / PSS and cgroup memory of idle sandboxes (``--runs`` of them), and host used / N.

Host used is the whole machine's, so other load moves it; the cgroup sum (KSM charges a merged page to one
of its sharers) and anon = the family's RssAnon minus KSM's savings (pages_sharing) are the family's own.

KSM's settings are put back as they were found (``agentenv.host.ksm``) when the sharing sandboxes close.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import agentenv
from agentenv import phases
from agentenv.host import cgroups, ksm
from bench.harness import Report, Row, Timer, add_output_arg, console, median, print_table, recording
from bench.sandbox_common import CPUS, IMAGE, LABEL, MEM_CODE, MEM_MB, Cleanup, wait_until

MIB = 1 << 20
HOLDER = ("import os, time; b = os.urandom({mb} << 20); print('ready', flush=True)\n"
          "while True: sum(b[::4096]); time.sleep(1)")  # every page read each second: a lazily restored one comes in


def host_used() -> int:
    """MemTotal - MemAvailable, bytes."""
    info = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in Path("/proc/meminfo").read_text().splitlines()}
    return info["MemTotal"] - info["MemAvailable"]


def cgroup_memory(sb: agentenv.Sandbox) -> int:
    """The memory the sandbox's cgroup is charged (v2 memory.current, v1 memory.usage_in_bytes), bytes."""
    for d in cgroups.existing(sb.lifecycle.container.cgroup):
        for name in ("memory.current", "memory.usage_in_bytes"):
            with contextlib.suppress(OSError, ValueError):
                return int((d / name).read_text())
    return 0


def anon_rss(sbs: list[agentenv.Sandbox]) -> int:
    """The anonymous resident memory of the sandboxes' processes (a page KSM merged counts in each), bytes."""
    total = 0
    for sb in sbs:
        for pid in sb.lifecycle.container.pids():
            with contextlib.suppress(OSError, StopIteration):
                total += 1024 * next(int(ln.split()[1]) for ln in Path(f"/proc/{pid}/status").read_text()
                                     .splitlines() if ln.startswith("RssAnon:"))
    return total


def agent_memory(sb: agentenv.Sandbox) -> tuple[int, int]:
    """The agent's RSS and PSS (bytes), from the host's /proc."""
    pid = sb.record.init_pid
    rss = next(int(ln.split()[1]) for ln in Path(f"/proc/{pid}/status").read_text().splitlines()
               if ln.startswith("VmRSS:"))
    pss = next(int(ln.split()[1]) for ln in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
               if ln.startswith("Pss:"))
    return rss * 1024, pss * 1024


def holding(cleanup: Cleanup, code: str, mb: int, share: bool, memory: str) -> agentenv.Sandbox:
    """A sandbox whose one process runs ``code`` and holds ``mb`` MB once it printed 'ready'."""
    sb = agentenv.Sandbox.create(IMAGE, cpus=CPUS, memory=memory, labels=cleanup.labels, share_memory=share)
    cleanup.sandboxes.append(sb)
    hold(sb, code, mb)
    return sb


def hold(sb: agentenv.Sandbox, code: str, mb: int) -> None:
    """Run ``code`` in ``sb`` as one process, and wait until it printed 'ready' and holds ``mb`` MB."""
    proc = sb.spawn(f'exec python3 -c "{code}"')

    def rss_kb() -> int:
        for line in sb.read_file(f"/proc/{proc.pid}/status").decode().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0

    wait_until(lambda: "ready" in proc.output() and rss_kb() >= mb * 1000, 120, f"{mb} MB process")


def _steady(xs: list[float], n: int = 5, tol: float = 0.02) -> bool:
    tail = xs[-n:]
    return len(tail) == n and max(tail) - min(tail) <= tol * max(abs(max(tail)), 1.0)


Parent = Callable[[], agentenv.Sandbox]  # the family's parent, holding its memory
Fork = Callable[[agentenv.Sandbox, int], list[agentenv.Sandbox]]  # its memory forks


def family(report: Report, cleanup: Cleanup, share: bool, mb: int, forks: int, window: float, *,
           key: str | None = None, make: Parent | None = None, fork: Fork | None = None) -> dict[str, Any]:
    """One fork family (see the module doc): its memory, sampled after the fork; returns the figures. ``make``
    and ``fork``: how its parent is made and forked (default: ``Sandbox.create(share_memory=share)``, ``fork``);
    ``share``: whether they share, which decides how long it is sampled."""
    tag = "shared" if share else "private"
    m = report.result(key or f"fork{forks}_{mb}mb_{tag}", note=f"fork({forks}) with memory of a {mb} MB "
                      f"random-data sandbox, share_memory={share}")
    out: dict[str, Any] = {}
    with recording(m, f"family {tag}"):
        base = host_used()
        parent = make() if make else holding(cleanup, HOLDER.format(mb=mb), mb, share, "1g")
        out["one_sandbox_host_mb"] = (host_used() - base) / MIB
        out["one_sandbox_cgroup_mb"] = cgroup_memory(parent) / MIB
        out["one_sandbox_anon_mb"] = anon_rss([parent]) / MIB
        cpu0, ks0 = ksm.ksmd_cpu_seconds(), ksm.stats()
        with phases.recording() as found, Timer() as t:
            kids = fork(parent, forks) if fork else parent.fork(forks)
        cleanup.sandboxes.extend(kids)
        out["share_memory_records"] = [sb.record.spec.get("share_memory") for sb in [parent, *kids]]
        m.add(t.s)
        for name, secs in phases.totals(found).items():
            m.add_extra(f"phase:{name}", secs)
        every = [parent, *kids]
        series: list[dict[str, float]] = []
        start = time.monotonic()
        while time.monotonic() - start < window:
            s = ksm.stats()
            series.append({"t_s": round(time.monotonic() - start, 2), "host_mb": (host_used() - base) / MIB,
                           "cgroups_mb": sum(cgroup_memory(sb) for sb in every) / MIB,
                           "anon_minus_merged_mb": (anon_rss(every) - s.saved_bytes) / MIB,
                           "ksm_saved_mb": s.saved_bytes / MIB, "ksmd_cpu_s": (s.ksmd_cpu_s or 0) - (cpu0 or 0)})
            if share and "merged_90pct_after_s" not in out and series[-1]["ksm_saved_mb"] >= 0.9 * forks * mb:
                out["merged_90pct_after_s"] = series[-1]["t_s"]  # 90% of the children's copies merged
            if not share and all(_steady([x[k] for x in series]) for k in ("cgroups_mb", "anon_minus_merged_mb")):
                break  # every child's pages are in (a lazy restore brings them as they are read)
            time.sleep(1)
        last = series[-1]
        out.update(family_host_mb=last["host_mb"], family_cgroups_mb=last["cgroups_mb"],
                   family_anon_minus_merged_mb=last["anon_minus_merged_mb"],
                   ksm_saved_mb=last["ksm_saved_mb"], settled_after_s=last["t_s"], samples=series)
        if share:
            merged_gb = (last["ksm_saved_mb"] - ks0.saved_bytes / MIB) / 1024
            out["ksmd_cpu_s_to_merge"] = last["ksmd_cpu_s"]
            out["ksmd_cpu_s_per_gb_merged"] = last["ksmd_cpu_s"] / merged_gb if merged_gb > 0 else None
            c1, t1 = ksm.ksmd_cpu_seconds() or 0.0, time.monotonic()
            time.sleep(5)  # a window to measure ksmd's steady cost in, not a wait for a state
            out["ksmd_cpu_share_after_merge"] = ((ksm.ksmd_cpu_seconds() or 0.0) - c1) / (time.monotonic() - t1)
        ok = [k.exec("true").ok for k in kids]
        if not all(ok):
            raise RuntimeError(f"{ok.count(False)} children do not answer")
        for sb in every:
            cleanup.close_sandbox(sb)
        out["ksm_run_after_close"] = ksm.stats().run
    m.fields.update({k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.items()})
    return out


def fork_times(report: Report, cleanup: Cleanup, runs: int) -> None:
    """fork(1) and fork(8) with memory of a sandbox holding MEM_MB, plain and sharing (see the module doc)."""
    for share in (False, True):
        tag = "shared" if share else "private"
        with recording(report.result(f"fork1_{tag}"), f"fork times {tag}"):
            src = holding(cleanup, MEM_CODE, MEM_MB, share, "1g")
            for n in (1, 8):
                m = report.result(f"fork{n}_{tag}", note=f"fork({n}) with memory of a {MEM_MB} MB sandbox "
                                  f"(share_memory={share}): returns when every child's agent answered")
                for _ in range(runs):
                    with phases.recording() as found, Timer() as t:
                        kids = src.fork(n)
                    m.add(t.s)
                    for name, secs in phases.totals(found).items():
                        m.add_extra(f"phase:{name}", secs)
                    cleanup.sandboxes.extend(kids)
                    for k in kids:
                        cleanup.close_sandbox(k)
            cleanup.close_sandbox(src)


def idle(report: Report, cleanup: Cleanup, runs: int) -> None:
    """Idle sandboxes: agent RSS / PSS, cgroup memory, host memory used per sandbox."""
    rss, pss, cg = (report.result(k, note=n) for k, n in (
        ("idle_agent_rss", "RSS of an idle sandbox's agent (MiB in the *_ms fields)"),
        ("idle_agent_pss", "PSS of an idle sandbox's agent (MiB in the *_ms fields)"),
        ("idle_cgroup", "cgroup memory of an idle sandbox (MiB in the *_ms fields)")))
    with recording(rss, "idle"):
        base = host_used()
        made = []
        for _ in range(runs):
            sb = agentenv.Sandbox.create(IMAGE, cpus=CPUS, memory="1g", labels=cleanup.labels)
            cleanup.sandboxes.append(sb)
            made.append(sb)
        per = (host_used() - base) / runs / MIB
        for sb in made:  # MiB stored as if seconds/1000 so the harness's *_ms fields read in MiB
            a, p = agent_memory(sb)
            rss.add(a / MIB / 1e3)
            pss.add(p / MIB / 1e3)
            cg.add(cgroup_memory(sb) / MIB / 1e3)
            cleanup.close_sandbox(sb)
        rss.fields["host_used_per_sandbox_mib"] = round(per, 2)


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}x"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--mb", type=int, default=256, help="MB of random data in the family's parent (default 256)")
    ap.add_argument("--forks", type=int, default=16, help="children of the family's fork (default 16)")
    ap.add_argument("--window", type=float, default=30.0, help="seconds after the fork to sample memory (30)")
    ap.add_argument("--runs", type=int, default=5, help="runs of fork(1) / fork(8), idle sandboxes (default 5)")
    ap.add_argument("--only", choices=("family", "forks", "idle"), help="one part only")
    add_output_arg(ap, "density")
    args = ap.parse_args(argv)
    if args.mb < 1 or not 1 <= args.forks <= agentenv.api.MAX_FORK or args.runs < 1 or args.window <= 0:
        ap.error(f"--mb, --runs >= 1; --forks in 1..{agentenv.api.MAX_FORK}; --window > 0")
    ksm.require()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    report = Report("density", vars(args))
    found = ksm.settings(["run", *ksm.TUNED])
    report.info.update(run_id=run_id, image=IMAGE, ksm_found=found, ksm_tuning=ksm.TUNED, label=LABEL)
    cleanup = Cleanup(run_id)
    fam: dict[str, dict[str, Any]] = {}
    steps: list[tuple[str, Callable[[], object]]] = [
        ("family", lambda: fam.update(private=family(report, cleanup, False, args.mb, args.forks, args.window),
                                      shared=family(report, cleanup, True, args.mb, args.forks, args.window))),
        ("forks", lambda: fork_times(report, cleanup, args.runs)),
        ("idle", lambda: idle(report, cleanup, args.runs))]
    try:
        for name, step in steps:
            if args.only in (None, name):
                console.log(f"{name} ...")
                step()
    except BaseException as e:
        report.fatal = f"{type(e).__name__}: {e}"
        console.print(traceback.format_exc(), style="dim", markup=False, highlight=False)
    finally:
        cleanup.all(None)
        ksm.sync()  # none of this run's sharing sandboxes is left: KSM back as found (unless others run)
    report.info["ksm_after"] = ksm.settings(["run", *ksm.TUNED])
    summarize(report, fam, args)
    report.print_errors()
    report.write(args.output)
    return 1 if report.fatal or report.errors else 0


def summarize(report: Report, fam: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    """The ratios and the tables."""
    n = args.forks + 1
    p, s = fam.get("private"), fam.get("shared")
    if p and s and "family_host_mb" in p and "family_host_mb" in s:
        d: dict[str, float | None] = {}
        for kind, one_key, fam_key in (("host", "one_sandbox_host_mb", "family_host_mb"),
                                       ("cgroups", "one_sandbox_cgroup_mb", "family_cgroups_mb"),
                                       ("anon", "one_sandbox_anon_mb", "family_anon_minus_merged_mb")):
            one, shared, private = s[one_key], s[fam_key], p[fam_key]
            d[f"overcommit_{kind}"] = n * one / shared if shared > 0 and one > 0 else None  # host: other load moves it
            d[f"family_over_one_sandbox_{kind}"] = shared / one if one > 0 else None
            d[f"private_over_shared_{kind}"] = private / shared if shared > 0 else None
            console.print(f"{args.mb} MB + {args.forks} forks, {kind}: one sandbox {one:.0f} MB, family private "
                          f"{private:.0f} MB, shared {shared:.0f} MB -> overcommit {_x(d[f'overcommit_{kind}'])} "
                          f"(target >= 8x), family / one sandbox {_x(d[f'family_over_one_sandbox_{kind}'])} "
                          f"(target <= 2x), private / shared {_x(d[f'private_over_shared_{kind}'])}", highlight=False)
        report.info["density"] = {k: None if v is None else round(v, 2) for k, v in d.items()}
        console.print(f"KSM: 90% merged {s.get('merged_90pct_after_s', '-')} s after the fork; at "
                      f"{s['settled_after_s']} s saved {s['ksm_saved_mb']:.0f} MB; ksmd "
                      f"{s.get('ksmd_cpu_s_to_merge', 0):.1f} CPU s to merge, "
                      f"{s.get('ksmd_cpu_s_per_gb_merged') or 0:.2f} CPU s per GB merged, "
                      f"{100 * s.get('ksmd_cpu_share_after_merge', 0):.0f}% of a CPU in the 5 s after", highlight=False)
    rows = []
    for k in ("1", "8"):
        a, b = report.results.get(f"fork{k}_private"), report.results.get(f"fork{k}_shared")
        if a is not None or b is not None:
            x = median(b.samples) if b else None
            y = median(a.samples) if a else None
            rows.append(Row(f"fork({k}) of {MEM_MB} MB", [a, b], ratio=(x / y) if x and y else None))
    if rows:
        print_table(f"fork with memory, ms (--runs {args.runs}; ratio = shared / private)", rows,
                    sides=("private", "shared"), ratio_title="shared/private")
        for k in ("fork1_private", "fork8_private"):
            r = report.results.get(k)
            if r and r.extra:
                top = ", ".join(f"{name[6:]} {1e3 * (median(v) or 0):.0f}" for name, v in
                                sorted(r.extra.items(), key=lambda kv: -(median(kv[1]) or 0))[:6])
                console.print(f"{k}: median phases (ms, summed over children): {top}", highlight=False)
    idle_rows = [(k, report.results.get(k)) for k in ("idle_agent_rss", "idle_agent_pss", "idle_cgroup")]
    for k, r in idle_rows:
        if r and r.samples:
            st = r.stat
            assert st is not None
            console.print(f"{k}: median {st.median * 1e3:.1f} MiB, p90 {st.p90 * 1e3:.1f} MiB", highlight=False)
    r = report.results.get("idle_agent_rss")
    if r and "host_used_per_sandbox_mib" in r.fields:
        console.print(f"host memory used per idle sandbox: {r.fields['host_used_per_sandbox_mib']} MiB",
                      highlight=False)


if __name__ == "__main__":
    sys.exit(main())
