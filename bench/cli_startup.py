"""How long ``agentenv ... --help`` and ``--version`` take to answer (issue 45: 1.3-1.7 s before the plugins were
loaded lazily; the aim is under 0.3 s), against ``python -c pass`` (the interpreter's own start) and the ``--help`` of a typer app of two commands (the
floor of any typer command line: typer, rich and pydantic imported, the commands built) in the same run.

Each command is the installed console script, run as a fresh process with this checkout on ``PYTHONPATH`` (or the
``PYTHONPATH`` the bench was given; ``--checkout DIR`` adds another checkout's CLI, e.g. the main branch's, measured in the same rounds: before and
after side by side). The rounds interleave the commands, so a busy machine slows them all alike. A command that
exits non-zero is an error, not a sample. Results go to ``bench/results/cli_startup.json``.

    .venv/bin/python -m bench.cli_startup [--runs 20] [--checkout /path/to/other/checkout]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from bench.harness import ROOT, Report, Row, Timer, add_output_arg, print_table

TYPER_FLOOR = ("import typer\napp = typer.Typer()\n@app.command()\ndef a(x: int = 1) -> None: ...\n"
               "@app.command()\ndef b(y: str = '') -> None: ...\napp()")
COMMANDS = {"help": ["--help"], "serve_help": ["serve", "--help"], "policy_help": ["policy", "--help"],
            "version": ["--version"]}


def run_once(argv: list[str], pythonpath: str | None) -> float:
    """Seconds ``argv`` took as a fresh process; RuntimeError with its output when it failed."""
    env = {**os.environ, "COLUMNS": "100"}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    with Timer() as t:
        done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {(done.stdout + done.stderr)[-300:]}")
    return t.s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--checkout", type=Path, action="append", default=[],
                    help="another checkout whose CLI to time in the same rounds (e.g. main's)")
    add_output_arg(ap, "cli_startup")
    args = ap.parse_args()
    report = Report("cli_startup", args)
    exe = str(Path(sys.executable).parent / "agentenv")
    sides = {"this": os.environ.get("PYTHONPATH") or str(ROOT)} | {f"checkout:{c}": str(c.resolve()) for c in args.checkout}
    jobs: dict[str, tuple[list[str], str | None]] = {"python_pass": ([sys.executable, "-c", "pass"], None),
                                                     "typer_floor": ([sys.executable, "-c", TYPER_FLOOR, "--help"], None)}
    jobs |= {f"{side}/{name}": ([exe, *argv], path) for side, path in sides.items() for name, argv in COMMANDS.items()}
    for argv, path in jobs.values():  # one untimed run each: the page cache warm for every command alike
        subprocess.run(argv, capture_output=True, env={**os.environ, "PYTHONPATH": path or ""}, check=False)
    for _ in range(args.runs):
        for key, (argv, path) in jobs.items():
            r = report.result(key)
            if r.error is None:  # a command that failed once (an older CLI without --version) is not run again
                try:
                    r.add(run_once(argv, path))
                except RuntimeError as e:
                    r.fail(e)
    rows = [Row("python -c pass", [report.results["python_pass"]]),
            Row("a typer app of two commands --help", [report.results["typer_floor"]],
                report.add_ratio("typer_floor/python_pass", "typer_floor", "python_pass"))]
    for key in jobs:
        if key not in ("python_pass", "typer_floor"):
            report.add_ratio(f"{key}/typer_floor", key, "typer_floor")
            x = report.add_ratio(f"{key}/python_pass", key, "python_pass")
            rows.append(Row(f"{key}: agentenv {' '.join(COMMANDS[key.rsplit('/', 1)[1]])}", [report.results[key]], x))
    report.info["sides"] = sides
    print_table("agentenv CLI start (fresh process each)", rows, ratio_title="× python -c pass")
    report.print_errors()
    report.write(args.output)


if __name__ == "__main__":
    main()
