"""Benchmark the SWE environment: reset, a tool step, grading, and fork-then-grade against fresh resets.

What: medians (and p90s) of
- ``reset``: SWEEnv.reset() of a shipped task whose image is present (sandbox start + base commit setup);
- ``step bash true``: one tool-call step running ``true``;
- ``grade``: grading an unchanged repository (test files restored, tests run, log parsed), per library;
- ``fork x8 + grade``: fork one reset episode into 8 children, then grade each, against
  ``8 resets + grade``: 8 fresh resets, each graded — the two ways to get 8 graded branches of one state.

Why: GRPO groups and tree search branch an episode many times; forking must beat starting over.
Grading runs one child at a time in both arms (2 cores), so the comparison isolates the branching cost.

Results go to ``bench/results/swe.json``; every sandbox and snapshot made is removed.

    .venv/bin/python bench/swe.py [--runs 10] [--fork-runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from envs.images import build_image  # noqa: E402
from envs.swe_env import SWEEnv  # noqa: E402
from envs.task import Task, shipped_tasks  # noqa: E402
from envs.tasks.libraries import load_libraries  # noqa: E402

TRUE = {"name": "bash", "arguments": {"command": "true"}}


def stats(xs: list[float]) -> dict[str, Any]:
    xs = sorted(xs)
    return {"median_s": statistics.median(xs), "p90_s": xs[min(len(xs) - 1, int(0.9 * len(xs)))], "n": len(xs),
            "all_s": [round(x, 4) for x in xs]}


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--fork-runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "swe.json")
    args = ap.parse_args()

    tasks = shipped_tasks()
    by_lib: dict[str, Task] = {}
    for t in tasks:
        by_lib.setdefault(t.metadata["library"], t)
    for lib in load_libraries():
        build_image(lib.recipe, log=print)
    task = by_lib["toolz"]
    results: dict[str, Any] = {"host": platform.node(), "cpus": os.cpu_count(), "task": task.instance_id,
                               "python": platform.python_version()}

    env = SWEEnv(task=task)
    try:
        env.reset()  # warm the image's layers and the page cache
        results["reset"] = stats([timed(env.reset) for _ in range(args.runs)])
        results["step_bash_true"] = stats([timed(lambda: env.step(TRUE)) for _ in range(args.runs * 3)])
        grades: dict[str, float] = {}
        for lib, t in by_lib.items():
            with SWEEnv(task=t) as e:
                e.reset()
                e.grade()  # warm-up: page cache, first imports
                e.reset()
                grades[lib] = timed(e.grade)
        results["grade_per_library_s"] = {k: round(v, 3) for k, v in grades.items()}
        results["grade"] = stats(list(grades.values()))

        fork_arm, reset_arm, fork_only, reset_only = [], [], [], []
        for _ in range(args.fork_runs):
            env.reset()
            t0 = time.perf_counter()
            kids = env.fork(8)
            fork_only.append(time.perf_counter() - t0)
            try:
                for k in kids:
                    k.grade()
            finally:
                for k in kids:
                    k.close()
            fork_arm.append(time.perf_counter() - t0)

            fresh = [SWEEnv(task=task) for _ in range(8)]
            try:
                t0 = time.perf_counter()
                for f in fresh:
                    f.reset()
                reset_only.append(time.perf_counter() - t0)
                for f in fresh:
                    f.grade()
                reset_arm.append(time.perf_counter() - t0)
            finally:
                for f in fresh:
                    f.close()
        results["fork8"] = stats(fork_only)
        results["resets8"] = stats(reset_only)
        results["fork8_then_grade"] = stats(fork_arm)
        results["resets8_then_grade"] = stats(reset_arm)
        results["ratio_resets8_over_fork8"] = results["resets8"]["median_s"] / results["fork8"]["median_s"]
        results["ratio_resets8_then_grade_over_fork8_then_grade"] = (
            results["resets8_then_grade"]["median_s"] / results["fork8_then_grade"]["median_s"])
    finally:
        env.close()

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    rows = [("reset (image present)", "reset"), ("step: bash true", "step_bash_true"),
            ("grade (median over libraries)", "grade"), ("fork(8)", "fork8"), ("8 fresh resets", "resets8"),
            ("fork(8) + grade each", "fork8_then_grade"), ("8 resets + grade each", "resets8_then_grade")]
    print(f"\n{'operation':34} {'median':>10} {'p90':>10} {'n':>4}")
    for label, key in rows:
        r = results[key]
        print(f"{label:34} {r['median_s'] * 1000:8.1f}ms {r['p90_s'] * 1000:8.1f}ms {r['n']:4}")
    print("grade per library: " + ", ".join(f"{k} {v:.2f}s" for k, v in results["grade_per_library_s"].items()))
    print(f"ratio 8 resets / fork(8): {results['ratio_resets8_over_fork8']:.2f}x;  "
          f"with grading: {results['ratio_resets8_then_grade_over_fork8_then_grade']:.2f}x")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
