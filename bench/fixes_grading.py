"""Benchmark grading SWE-bench-shaped records of real fixes, per runner, beside the official harness's own steps.

What, on the records of ``envs/tasks/fixes_tasks.jsonl`` (Django's ``tests/runtests.py``, SymPy's ``bin/test``,
requests' pytest; images in SWE-bench's layout, built first or found up to date):

- ``validate``: for every record (``--records``), its gold patch, an empty patch and a no-op edit of the files the
  gold patch touches, each graded once (``envs.grading.grade``, a fresh task sandbox): our verdict, the official
  ``swebench`` 5.0.2 ``get_eval_report`` on the log the grading captured, whether they agree, the seconds;
- ``timing``: for one record per runner, ``--rounds`` times alternating, the gold patch graded three ways:
  ``ours_pristine`` — as SWEEnv grades (reset once, the grading sandbox restored from the pristine snapshot, its
  close in the background); ``ours_fresh`` — ``grade`` with a task sandbox set up for it; and ``official`` — the
  official harness's own steps where they can run here: a container of the record's image under plain ``docker run
  --network none``, the patch applied with ``git apply``, the record's eval script run, and ``get_eval_report`` on
  that log (``envs.grading.runners.official``); median and p90 of each, and the official run's verdict.

Why: grading happens thousands of times in RL; the hardened channel (the guard, the recorder, the isolated run, the
canaries) must not cost more than a small multiple of what the dataset's own harness spends.

    .venv/bin/python -m bench.fixes_grading [--rounds 5] [--records ID ...] [--skip-validate]

Results go to ``bench/results/fixes_grading.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "fixes_grading.json"
PER_RUNNER = {"django": "django__django-35172", "sympy": "sympy__sympy-26799", "pytest": "psf__requests-47081"}


def _stats(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {"median_s": round(statistics.median(s), 3), "p90_s": round(s[min(len(s) - 1, int(0.9 * len(s)))], 3),
            "n": len(s)}


def _applying(patch: str) -> Callable[[Any], None]:
    def edit(sb: Any) -> None:
        sb.write_file("/tmp/edit.patch", patch)
        r = sb.exec("git apply /tmp/edit.patch && rm /tmp/edit.patch", cwd="/testbed")
        if r.exit_code != 0:
            raise RuntimeError(f"the patch does not apply: {r.stderr[-300:]}")
    return edit


def _graded(task: Any, edit: Callable[[Any], None] | None) -> tuple[Any, float]:
    from envs.grading import grade
    from envs.task_sandbox import start_task

    sb, task = start_task(task)
    try:
        if edit is not None:
            edit(sb)
        t0 = time.perf_counter()
        r = grade(sb, task)
        return r, time.perf_counter() - t0
    finally:
        sb.close()


def validate(tasks: list[Any]) -> list[dict[str, Any]]:
    from envs.tasks.validate import noop_edit

    rows = []
    for task in tasks:
        noop = noop_edit(task)
        for label, edit, want in (("gold", _applying(task.patch), True), ("empty", None, False),
                                  ("no-op edit", lambda sb, n=noop: sb.exec(n, cwd="/testbed"), False)):
            r, seconds = _graded(task, edit)
            rows.append({"instance_id": task.instance_id, "patch": label, "want": want, "ours": r.resolved,
                         "official": r.official.resolved if r.official else None, "agree": r.agree,
                         "tampering": r.tampering, "seconds": round(seconds, 2), "error": r.error[:200]})
            print(f"[validate] {task.instance_id:24} {label:10} ours={r.resolved!s:5} official="
                  f"{rows[-1]['official']!s:5} agree={r.agree} {seconds:.1f}s", flush=True)
    return rows


def official_run(task: Any) -> tuple[float, bool | None]:
    """The official harness's steps under plain ``docker run``: (seconds, its verdict on the gold patch)."""
    from envs.grading.runners import official
    from envs.grading.runners.spec import runner_for

    script = "\n".join([
        f"cat > /tmp/patch.diff <<'AGENTENV_PATCH_EOF'\n{task.patch.rstrip(chr(10))}\nAGENTENV_PATCH_EOF",
        "cd /testbed && git apply --verbose /tmp/patch.diff",
        f"cat > /eval.sh <<'AGENTENV_EVAL_EOF'\n{task.eval_script}"
        "AGENTENV_EVAL_EOF",
        "/bin/bash /eval.sh 2>&1"])
    spec = runner_for(task).spec
    t0 = time.perf_counter()
    r = subprocess.run(["docker", "run", "--rm", "-i", "--network", "none", task.image, "/bin/bash", "-s"],
                       input=script, capture_output=True, text=True, timeout=1800, check=False)
    ans = official.harness(5).call([{"op": "report", "spec": dict(spec or {}), "log": r.stdout + r.stderr}])[0]
    return time.perf_counter() - t0, bool(ans["report"].get("resolved"))


def timing(tasks: dict[str, Any], rounds: int) -> dict[str, Any]:
    import agentenv
    from envs.grading import grade
    from envs.swe_env import SWEEnv

    out: dict[str, Any] = {}
    for runner, task in tasks.items():
        samples: dict[str, list[float]] = {"ours_pristine": [], "ours_fresh": [], "official": []}
        verdicts: dict[str, list[bool | None]] = {"ours": [], "official": []}
        with SWEEnv(task=task) as env:
            env.reset()
            pristine = env.pristine()
            for _ in range(rounds):
                with agentenv.Sandbox.restore(pristine.snapshot) as sb:
                    _applying(task.patch)(sb)
                    closing: list[Any] = []
                    t0 = time.perf_counter()
                    r = grade(sb, pristine.task, pristine=pristine.snapshot, closing=closing)
                    samples["ours_pristine"].append(time.perf_counter() - t0)
                    for f in closing:
                        f.result()
                verdicts["ours"].append(r.resolved)
                r2, seconds = _graded(task, _applying(task.patch))
                samples["ours_fresh"].append(seconds)
                verdicts["ours"].append(r2.resolved)
                seconds, resolved = official_run(task)
                samples["official"].append(seconds)
                verdicts["official"].append(resolved)
                print(f"[timing] {runner:6} pristine {samples['ours_pristine'][-1]:.2f}s fresh "
                      f"{samples['ours_fresh'][-1]:.2f}s official {seconds:.2f}s", flush=True)
        out[runner] = {"instance_id": task.instance_id, **{k: _stats(v) for k, v in samples.items()},
                       "ours_resolved": verdicts["ours"], "official_resolved": verdicts["official"],
                       "phases_ms": dict(r.grading_info()["timings_ms"])}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--records", nargs="*", help="instance ids to validate (default: all)")
    p.add_argument("--skip-validate", action="store_true")
    args = p.parse_args(argv)
    here = Path(__file__).resolve().parent  # run as a file: bench/ first on sys.path shadows the packages
    sys.path[:] = [str(here.parent), *(x for x in sys.path if Path(x or ".").resolve() != here)]
    from bench.machine import machine_info
    from envs.images import build_image
    from envs.task import load_tasks
    from envs.tasks.fixes import RECORDS_FILE, load_releases

    for release in load_releases():
        build_image(release.recipe, log=print)
    tasks = load_tasks(RECORDS_FILE)
    by_id = {t.instance_id: t for t in tasks}
    chosen = [by_id[i] for i in args.records] if args.records else tasks
    result: dict[str, Any] = {"machine": machine_info(), "rounds": args.rounds}
    if not args.skip_validate:
        rows = validate(chosen)
        result["validate"] = rows
        result["validate_ok"] = all(r["ours"] is r["want"] and r["agree"] for r in rows)
    result["timing"] = timing({k: by_id[v] for k, v in PER_RUNNER.items()}, args.rounds)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    tmp = OUT.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(OUT)
    print(json.dumps(result["timing"], indent=1))
    return 0 if result.get("validate_ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
