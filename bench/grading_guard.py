"""Benchmark what the run-time guard costs a grade: the gold patch of every shipped task, graded before and after.

What: for each shipped task (or the first ``--tasks`` of them), its gold patch applied to a sandbox restored from
the task's pristine snapshot, then ``grade`` timed (the grading sandbox closed in the background, as SWEEnv
does), once with the grader of ``--baseline`` (a git revision before the guard, unpacked with ``git archive``)
and once with this tree's — the audit hook, the derived canaries and the isolated run. Medians and p90s of
both (``gold_grade_baseline``, ``gold_grade_guarded``), their ratio, the phases of each grade (``extra``), and
how many FAIL_TO_PASS tests the isolated run could call (the rest rest on the canaries and the hook), and
every task's reward, tampering flag and reasons: a gold patch that does not score 1, or is flagged, is listed
in ``info.gold_failures`` (the guard must cost no right fix its reward).

Why: the guard adds a second interpreter per grade and work in the first; RL grades thousands of times.

Each side runs in a process of its own (``--measure``, with ``PYTHONPATH`` at that side's tree), one after the
other, ``--rounds`` times alternating. Results go to ``bench/results/grading_guard.json``.

    .venv/bin/python -m bench.grading_guard [--tasks 0] [--rounds 1] [--baseline REV]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def measure(n_tasks: int) -> list[dict[str, Any]]:
    """Grade each task's gold patch once with the ``envs`` on ``sys.path``; one record per task."""
    here = Path(__file__).resolve().parent  # run as a file: bench/ is first on sys.path and its policy.py shadows
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    import agentenv
    from envs.grading import grade
    from envs.swe_env import SWEEnv
    from envs.task import shipped_tasks

    tasks = shipped_tasks()
    out: list[dict[str, Any]] = []
    for task in tasks[:n_tasks or None]:
        with SWEEnv(task=task) as env:
            env.reset()
            pristine = env.pristine()
            with agentenv.Sandbox.restore(pristine.snapshot) as sb:
                sb.write_file("/tmp/gold.patch", task.patch)
                sb.exec("git apply /tmp/gold.patch && rm /tmp/gold.patch", cwd="/testbed")
                closing: list[Any] = []
                t0 = time.perf_counter()
                r = grade(sb, pristine.task, pristine=pristine.snapshot, closing=closing)
                seconds = time.perf_counter() - t0
                for f in closing:
                    f.result()
            info = r.grading_info()
            out.append({"task": task.instance_id, "seconds": seconds, "reward": r.reward, "error": r.error,
                        "tampering": r.tampering, "reasons": info.get("tampering_reasons", []),
                        "timings_ms": info.get("timings_ms", {}), "solo": info.get("solo", {}),
                        "fail_to_pass": list(task.FAIL_TO_PASS)})
    return out


def unpack(rev: str, into: Path) -> Path:
    """The tree of ``rev`` (``git archive``) under ``into``."""
    data = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev], check=True,
                          capture_output=True).stdout
    from agentenv.host import archives

    path = into / "tree"
    path.mkdir()
    with tempfile.TemporaryFile() as f:
        f.write(data)
        f.seek(0)
        with tarfile.open(fileobj=f) as tar:
            archives.extract(tar, path)
    return path


def default_baseline() -> str:
    """The revision before the guard was added."""
    first = subprocess.run(["git", "-C", str(ROOT), "log", "--diff-filter=A", "--format=%H", "--",
                            "envs/grading/sandbox_guard.py"], check=True, capture_output=True, text=True
                           ).stdout.split()
    return f"{first[-1]}~1" if first else "HEAD"


def run_side(tree: Path, n_tasks: int, out: Path) -> list[dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "--measure", "--tasks", str(n_tasks),
                    "--json", str(out)], check=True, env=env, cwd=tree)
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--tasks", type=int, default=0, help="the first N shipped tasks (0: all)")
    ap.add_argument("--rounds", type=int, default=1, help="baseline-then-guarded rounds")
    ap.add_argument("--baseline", default="", help="git revision of the grader before the guard")
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "grading_guard.json")
    args = ap.parse_args(argv)
    if args.measure:
        args.json.write_text(json.dumps(measure(args.tasks)))
        return 0

    sys.path.insert(0, str(ROOT))
    from bench.harness import Report, console, percentile

    baseline = args.baseline or default_baseline()
    report = Report("grading_guard", {"tasks": args.tasks, "rounds": args.rounds, "baseline": baseline})
    before = report.result("gold_grade_baseline", note=f"grade of the gold patch, grader of {baseline}")
    after = report.result("gold_grade_guarded", note="grade of the gold patch, this tree's grader (audit hook, "
                                                     "derived canaries, isolated run)")
    records: dict[str, list[dict[str, Any]]] = {"baseline": [], "guarded": []}
    with tempfile.TemporaryDirectory(prefix="agentenv-bench-guard-") as tmp:
        base_tree = unpack(baseline, Path(tmp))
        for rnd in range(args.rounds):
            for side, tree, result in (("baseline", base_tree, before), ("guarded", ROOT, after)):
                console.log(f"round {rnd + 1}: {side}")
                recs = run_side(tree, args.tasks, Path(tmp) / f"{side}-{rnd}.json")
                records[side] += recs
                for rec in recs:
                    result.add(rec["seconds"])
                    for phase, v in rec["timings_ms"].items():
                        result.add_extra(phase, v / 1000)
    report.add_ratio("guarded_over_baseline", "gold_grade_guarded", "gold_grade_baseline")
    fails = [{k: r[k] for k in ("task", "reward", "error", "reasons")} for r in records["guarded"]
             if r["reward"] != 1.0 or r["tampering"]]
    base_fails = [r["task"] for r in records["baseline"] if r["reward"] != 1.0 or r["tampering"]]
    last = {r["task"]: r for r in records["guarded"]}.values()
    f2p = [(r["task"], t, r["solo"].get(t, "")) for r in last for t in r["fail_to_pass"]]
    called = [x for x in f2p if x[2] not in ("", "UNSUPPORTED")]
    uncovered = sorted({task for task, _, _ in f2p} - {task for task, _, _ in called})
    report.info.update(gold_graded=len(records["guarded"]), gold_failures=fails, baseline_gold_failures=base_fails,
                       fail_to_pass_tests=len(f2p), fail_to_pass_called_on_their_own=len(called),
                       tasks_without_an_isolated_fail_to_pass_test=uncovered,
                       canaries_per_grade=sum(len([k for k in r["solo"] if k not in r["fail_to_pass"]])
                                              for r in last) / max(1, len(last)))
    for side in ("baseline", "guarded"):
        xs = [r["seconds"] for r in records[side]]
        console.print(f"{side}: median {1000 * (percentile(xs, 0.5) or 0):.0f} ms, "
                      f"p90 {1000 * (percentile(xs, 0.9) or 0):.0f} ms over {len(xs)} grades", highlight=False)
    console.print(f"ratio (medians): {report.ratios['guarded_over_baseline']['text']}; gold failures with the "
                  f"guard: {len(fails)}, before: {len(base_fails)}", highlight=False)
    report.write(args.output)
    return 1 if fails else 0


if __name__ == "__main__":
    raise SystemExit(main())
