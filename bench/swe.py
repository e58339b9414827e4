"""Benchmark the SWE environment: reset, a tool step, grading, and fork-then-grade against fresh resets.

What: medians (and p90s) of
- ``reset``: SWEEnv.reset() of a shipped task whose image is present (sandbox start + base commit setup);
- ``step_bash_true``: one tool-call step running ``true``;
- ``grade``: grading an unchanged repository, one sample per library (``per_library_ms``): the patch taken
  out of the episode's sandbox, a fresh sandbox restored from the task's pristine snapshot (overlapped with
  the extraction), the patch applied, the tests run, the JUnit result read (phases in ``extra``: extract,
  filter, sandbox = waiting for the restore, apply, tests, results); the grading sandbox is closed in the
  background, so ``grade_then_close`` adds the wait for that close (the cost of grading in a fork: restore
  + close);
- ``fork8_then_grade``: fork one reset episode into 8 children, then grade each, against
  ``resets8_then_grade``: 8 fresh resets, each graded — the two ways to get 8 graded branches of one state
  (``fork8`` and ``resets8`` are the branching part alone).

Why: GRPO groups and tree search branch an episode many times; forking must beat starting over.
Grading runs one child at a time in both arms (2 cores), so the comparison isolates the branching cost.

Results go to ``bench/results/swe.json``; every sandbox and snapshot made is removed.

    .venv/bin/python -m bench.swe [--runs 10] [--fork-runs 3]
"""

from __future__ import annotations

import argparse
import functools
import sys

from bench.harness import (
    Report,
    Row,
    Timer,
    add_output_arg,
    console,
    ms,
    percentile,
    print_table,
    recording,
    time_runs,
)
from envs.images import build_image
from envs.swe_env import SWEEnv
from envs.task import Task, shipped_tasks
from envs.tasks.libraries import load_libraries

TRUE = {"name": "bash", "arguments": {"command": "true"}}
TASK_LIBRARY = "toolz"


def fork_vs_resets(report: Report, env: SWEEnv, task: Task, runs: int) -> None:
    """``runs`` times: fork the reset episode 8 ways and grade each; then 8 fresh resets, each graded."""
    f8, r8 = report.result("fork8", note="env.fork(8) of a reset episode"), report.result("resets8", note="8 x reset")
    fg = report.result("fork8_then_grade", note="env.fork(8), then grade each child in turn")
    rg = report.result("resets8_then_grade", note="8 fresh SWEEnv resets, then grade each in turn")
    for _ in range(runs):
        with recording(f8, "fork(8) + grade"):
            env.reset()
            with Timer() as t_all:
                with Timer() as t_fork:
                    kids = env.fork(8)
                try:
                    for k in kids:
                        k.grade()
                finally:
                    for k in kids:
                        k.close()
            f8.add(t_fork.s)
            fg.add(t_all.s)
        with recording(r8, "8 resets + grade"):
            fresh = [SWEEnv(task=task) for _ in range(8)]
            try:
                with Timer() as t_all:
                    with Timer() as t_reset:
                        for f in fresh:
                            f.reset()
                    for f in fresh:
                        f.grade()
            finally:
                for f in fresh:
                    f.close()
            r8.add(t_reset.s)
            rg.add(t_all.s)
        if f8.error or r8.error:
            for a, b in ((f8, fg), (r8, rg)):
                if a.error:
                    b.fail(f"not measured: {a.error}")
            return


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--runs", type=int, default=10, help="resets timed (tool steps: 3x as many)")
    ap.add_argument("--fork-runs", type=int, default=3, help="rounds of fork(8)+grade against 8 resets+grade")
    add_output_arg(ap, "swe", "--out")
    args = ap.parse_args(argv)
    report = Report("swe", {k: v for k, v in vars(args).items() if k != "output"})

    by_lib: dict[str, Task] = {}
    for t in shipped_tasks():
        by_lib.setdefault(t.metadata["library"], t)
    for library in load_libraries():
        build_image(library.recipe, log=console.log)
    task = by_lib[TASK_LIBRARY]
    report.info.update(task=task.instance_id, libraries=sorted(by_lib))

    env: SWEEnv | None = None
    try:
        env = SWEEnv(task=task)
        env.reset()  # warm the image's layers and the page cache
        console.log(f"reset x{args.runs}, step x{args.runs * 3}")
        with recording(r := report.result("reset", note=f"SWEEnv.reset() of {task.instance_id}"), "reset"):
            r.samples += time_runs(env.reset, args.runs)
        with recording(r := report.result("step_bash_true", note="env.step(bash `true`)"), "step"):
            r.samples += time_runs(functools.partial(env.step, TRUE), args.runs * 3)
        grade = report.result("grade", note="grade of an unchanged repository after a warm-up grade, one per "
                                            "library; in a fresh sandbox restored from the pristine snapshot, "
                                            "closed in the background")
        closed = report.result("grade_then_close", note="the same grade, then waiting for its sandbox's close")
        per_lib: dict[str, float | None] = {}
        for lib, t in by_lib.items():
            console.log(f"grade {lib}")
            with recording(grade, f"grade {lib}"), SWEEnv(task=t) as e:
                e.reset()
                e.grade()  # warm-up: page cache, first imports
                e.reset()
                with Timer() as tg:
                    result = e.grade()
                with Timer() as tc:
                    e.wait_graders_closed()
                grade.add(tg.s)
                closed.add(tg.s + tc.s)
                for phase, seconds in result.timings.items():
                    grade.add_extra(phase, seconds)
                grade.add_extra("close (background)", tc.s)
                per_lib[lib] = ms(tg.s)
        grade.fields["per_library_ms"] = per_lib
        console.log(f"fork(8) + grade against 8 resets + grade, x{args.fork_runs}")
        fork_vs_resets(report, env, task, args.fork_runs)
    except Exception as e:  # noqa: BLE001 - recorded, the report is still written
        report.fatal = f"{type(e).__name__}: {e}"
    finally:
        if env is not None:
            env.close()

    x = report.add_ratio("resets8/fork8", "resets8", "fork8")
    xg = report.add_ratio("resets8_then_grade/fork8_then_grade", "resets8_then_grade", "fork8_then_grade")
    g = report.results
    rows = [Row("reset (image present)", [g.get("reset")]), Row("step: bash true", [g.get("step_bash_true")]),
            Row("grade (over libraries)", [g.get("grade")]), Row("grade + its sandbox's close", [g.get("grade_then_close")]),
            Row("fork(8)", [g.get("fork8")]),
            Row("8 fresh resets", [g.get("resets8")], x),
            Row("fork(8) + grade each", [g.get("fork8_then_grade")]),
            Row("8 resets + grade each", [g.get("resets8_then_grade")], xg)]
    print_table("SWE environment, ms (ratio = 8 resets / fork(8), medians)", rows)
    if "grade" in g:
        console.print("grade per library: " + ", ".join(f"{k} {v} ms" for k, v in
                                                         g["grade"].fields.get("per_library_ms", {}).items()))
        phases = g["grade"].extra
        if phases:
            console.print("grade phases (median ms): " + ", ".join(
                f"{k} {ms(percentile(v, 0.5))}" for k, v in phases.items() if v))
    report.print_errors()
    report.write(args.output)
    return 1 if report.fatal or report.errors else 0


if __name__ == "__main__":
    sys.exit(main())
