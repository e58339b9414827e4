"""Group memory: what one GRPO group of harness sandboxes costs the host, with the envs' default ``share_memory``
(where the host can: ``envs/base.py``) against the opt-out (``share_memory=False``), in one run.

Workload (``python -m bench.group_memory``): an env as a rollout makes it (``ShellEnv``, its sandbox made at reset
with the env's ``share_memory``) runs one process holding ``--mb`` (256) MB, as a Node-based CLI harness holds
100-300 MB; ``rollout.groups.branch`` then forks it ``--forks`` (16) times with memory, as a group is forked. The
parent and its forks are measured by ``bench.density.family``: host memory used (MemTotal - MemAvailable, minus
its value before the parent) and the cgroups' sum, sampled each second for ``--window`` (30) s after the fork;
once with the opt-out, once with the default. Reported: one sandbox, the group of 1 + N, the group / one sandbox
and opt-out / default (``info.density``), ksmd's CPU seconds to merge and per GB merged, and what each sandbox's
record says it got (``share_memory_records``). Where the host cannot merge, the default gets no sharing and the
two runs cost the same.

KSM's settings are put back as they were found (``agentenv.host.ksm``) when the sharing sandboxes close.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
import traceback
import uuid
from typing import Any

import agentenv
from agentenv.host import ksm
from bench.density import HOLDER, family, hold, summarize
from bench.harness import Report, add_output_arg, console
from bench.sandbox_common import CPUS, IMAGE, LABEL, Cleanup
from envs import ShellEnv
from envs.protocol import unwrap
from rollout.groups import branch


def group(report: Report, cleanup: Cleanup, share_memory: bool | None, mb: int, forks: int,
          window: float) -> dict[str, Any]:
    """One group: an env's sandbox holding ``mb`` MB, forked ``forks`` times by the rollout path."""
    def make_env() -> ShellEnv:
        return ShellEnv(IMAGE, cpus=CPUS, memory="1g", labels=cleanup.labels, share_memory=share_memory)

    env = make_env()

    def parent() -> agentenv.Sandbox:
        env.reset()
        sb = env.sandbox
        assert isinstance(sb, agentenv.Sandbox)  # the local backend's
        cleanup.sandboxes.append(sb)
        hold(sb, HOLDER.format(mb=mb), mb)
        return sb

    def fork(_: agentenv.Sandbox, n: int) -> list[agentenv.Sandbox]:
        boxes = []
        for kid in branch(env, n, True, make_env, None):
            sb = unwrap(kid).sandbox
            assert isinstance(sb, agentenv.Sandbox)
            boxes.append(sb)
        return boxes

    tag = "default" if share_memory is None else "opt_out"
    return family(report, cleanup, ksm.choose(share_memory), mb, forks, window, key=f"group{forks}_{mb}mb_{tag}",
                  make=parent, fork=fork)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--mb", type=int, default=256, help="MB the harness process holds (default 256)")
    ap.add_argument("--forks", type=int, default=16, help="forks of the group's sandbox (default 16)")
    ap.add_argument("--window", type=float, default=30.0, help="seconds after the fork to sample memory (30)")
    add_output_arg(ap, "group_memory")
    args = ap.parse_args(argv)
    if args.mb < 1 or not 1 <= args.forks <= agentenv.api.MAX_FORK or args.window <= 0:
        ap.error(f"--mb >= 1; --forks in 1..{agentenv.api.MAX_FORK}; --window > 0")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    report = Report("group_memory", vars(args))
    why_not = ksm.unsupported()
    report.info.update(run_id=run_id, image=IMAGE, label=LABEL, ksm_unsupported=str(why_not) if why_not else None,
                       ksm_found=None if why_not else ksm.settings(["run", *ksm.TUNED]), ksm_scan_s=ksm.SCAN_S)
    holder = None if why_not else ksm.holder()
    if holder not in (None, ksm.owner()):  # the default gets no sharing meanwhile (agentenv.host.ksm.decide)
        report.notes.append(f"another agentenv home ({holder}) shared this host's memory at the start")
    cleanup = Cleanup(run_id)
    fam: dict[str, dict[str, Any]] = {}
    try:
        console.log("opt-out (share_memory=False) ...")
        fam["private"] = group(report, cleanup, False, args.mb, args.forks, args.window)
        console.log("default (share_memory where the host can) ...")
        fam["shared"] = group(report, cleanup, None, args.mb, args.forks, args.window)
    except BaseException as e:
        report.fatal = f"{type(e).__name__}: {e}"
        console.print(traceback.format_exc(), style="dim", markup=False, highlight=False)
    finally:
        cleanup.all(None)
        if why_not is None:
            ksm.sync()  # none of this run's sharing sandboxes is left: KSM back as found (unless others run)
    summarize(report, fam, args)
    p = fam.get("private", {})
    if p.get("one_sandbox_host_mb") and "family_host_mb" in p:  # the opt-out's own group / one sandbox
        report.info.setdefault("density", {})["opt_out_family_over_one_sandbox_host"] = round(
            p["family_host_mb"] / p["one_sandbox_host_mb"], 2)
    report.print_errors()
    report.write(args.output)
    return 1 if report.fatal or report.errors else 0


if __name__ == "__main__":
    sys.exit(main())
