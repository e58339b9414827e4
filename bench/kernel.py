"""Benchmark the code interpreter's kernel against IPython's, in real sandboxes: the weighing of issue 26.

What, for each kernel, in the same image (``agentenv-bench/ipython``: ``agentenv/base`` plus Debian's
``python3-ipython``, built here with apt when missing) and the same run:
(1) start -> first result: the kernel started as a sandbox job, ``1 + 1`` sent on its stdin, until its result
comes back; for agentenv's standard-library kernel (``agentenv.inside.kernel``, as ``run_code`` starts it) and
for IPython's ``InteractiveShell`` behind a ten-line stdin driver (what an IPython-based kernel costs at least:
ipykernel and ZeroMQ come on top). (2) Whether the kernel's state survives a memory fork and a pause -> resume
(a variable set before is read in the child, and after the resume), with the time each took.

Why: E2B's own template runs Jupyter, which gives its users magics and the display protocol as they know them;
agentenv's kernel is the standard library with IPython's syntax added. The start time is paid by the first
``run_code`` of every sandbox; CRIU must carry the kernel through fork and pause either way.

Where the IPython image cannot be built (no apt mirror), only the standard-library kernel is measured, in
``agentenv/base``, and the report says so. The sandboxes live in the default $AGENTENV_HOME (as in
``bench.agentenv_ops``), each closed at the end. Results go to ``bench/results/kernel.json``.

    .venv/bin/python -m bench.kernel [--runs 10]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import Report, Row, Timer, add_output_arg, console, print_table, recording

IMAGE = "agentenv-bench/ipython:latest"
DOCKERFILE = ("FROM agentenv/base\nRUN apt-get update && apt-get install -y --no-install-recommends python3-ipython"
              " && rm -rf /var/lib/apt/lists/*\n")
# IPython's shell behind stdin: a JSON request per line, a JSON result per line (what the stdlib kernel answers)
IPYTHON_DRIVER = (
    "import sys, json\n"
    "from IPython.core.interactiveshell import InteractiveShell\n"
    "shell = InteractiveShell.instance()\n"
    "for line in sys.stdin:\n"
    "    req = json.loads(line)\n"
    "    r = shell.run_cell(req['code'], store_history=False)\n"
    "    print(json.dumps({'id': req['id'], 'type': 'result', 'text': repr(r.result)}), flush=True)\n")
KINDS = ("stdlib", "ipython")


def ipython_image() -> str | None:
    """The IPython image, built (with Docker's cache) where missing; None where it cannot be built."""
    if subprocess.run(["docker", "image", "inspect", IMAGE], capture_output=True, check=False).returncode == 0:
        return IMAGE
    with tempfile.TemporaryDirectory() as ctx:
        Path(ctx, "Dockerfile").write_text(DOCKERFILE)
        r = subprocess.run(["docker", "build", "-q", "-t", IMAGE, ctx], capture_output=True, text=True,
                           check=False, timeout=900)
    if r.returncode != 0:
        console.print(f"[yellow]the IPython image was not built:[/yellow] {r.stderr.strip()[-300:]}", highlight=False)
        return None
    return IMAGE


class Kernel:
    """One kernel job in a sandbox, spoken to with JSON lines (the stdlib kernel's protocol, or the driver's)."""

    def __init__(self, sb: Any, kind: str) -> None:
        from agentenv.inside import kernel

        self.kind = kind
        if kind == "stdlib":
            command, env = kernel.launch()
        else:
            command, env = "exec python3 -u -c \"$DRIVER\"", {"DRIVER": IPYTHON_DRIVER}
        self.pid = sb.start(command, env=env, stdin=True).pid
        self.n = 0

    def ask(self, sb: Any, code: str, timeout: float = 120) -> str:
        """The text of ``code``'s result, read from the job's output (all of it: a fork child's starts over)."""
        from agentenv.api import JobEnd, JobOutput
        from agentenv.inside import kernel

        self.n += 1
        rid = f"b{self.n}"
        sb.send_input(self.pid, kernel.request(rid, code) if self.kind == "stdlib" else
                      json.dumps({"id": rid, "code": code}).encode() + b"\n")
        buf, deadline = b"", time.monotonic() + timeout
        for item in sb.output(self.pid, follow=True):
            if isinstance(item, JobEnd):
                raise RuntimeError(f"the {self.kind} kernel exited with {item.exit_code}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no result from the {self.kind} kernel in {timeout} s")
            if isinstance(item, JobOutput) and item.stream == "stdout":
                buf += item.data
                events, used = kernel.split_events(buf)
                buf = buf[used:]
                for ev in events:
                    if ev.get("id") == rid and ev.get("type") in ("result", "error", "end"):  # end: no result
                        return str(ev.get("text") or ev.get("value") or "")
        raise RuntimeError("the job's output ended")


def bench_kind(report: Report, image: str, kind: str, runs: int) -> None:
    import agentenv

    start = report.result(f"{kind}.first_result", f"{kind} kernel: start -> result of 1 + 1, in {image}")
    fork = report.result(f"{kind}.fork", f"{kind} kernel: fork(1) with x set -> x read in the child")
    pause = report.result(f"{kind}.pause_resume", f"{kind} kernel: pause -> resume -> x read")
    sb = agentenv.Sandbox.create(image, memory="1g")
    try:
        with recording(start, f"{kind} start"):
            for _ in range(runs):
                with Timer() as t:
                    k = Kernel(sb, kind)
                    assert k.ask(sb, "1 + 1") == "2"
                start.add(t.s)
                sb.signal(k.pid, 9)
        k = Kernel(sb, kind)
        k.ask(sb, "x = 41")
        with recording(fork, f"{kind} fork"):
            for _ in range(runs):
                with Timer() as t:
                    (kid,) = sb.fork(1)
                    try:
                        got = k.ask(kid, "x + 1")
                    finally:
                        kid.close()
                fork.add(t.s)
                fork.fields["state_survives"] = got == "42"
        with recording(pause, f"{kind} pause"):
            for _ in range(runs):
                with Timer() as t:
                    sb.pause()
                    sb.resume()
                    got = k.ask(sb, "x + 1")
                pause.add(t.s)
                pause.fields["state_survives"] = got == "42"
    finally:
        sb.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--runs", type=int, default=10, help="runs of each operation")
    add_output_arg(ap, "kernel")
    args = ap.parse_args(argv)
    report = Report("kernel", {k: v for k, v in vars(args).items() if k != "output"})
    image = ipython_image()
    report.info["image"] = image or "agentenv/base"
    if image is None:
        report.notes.append("no IPython image (apt unreachable?): the standard-library kernel alone, in agentenv/base")
    try:
        for kind in KINDS if image else KINDS[:1]:
            bench_kind(report, image or "agentenv/base", kind, args.runs)
    except Exception as e:  # noqa: BLE001 - recorded, the report is still written
        report.fatal = f"{type(e).__name__}: {e}"
    rows = []
    for key, label in (("first_result", "start -> first result"), ("fork", "fork(1) -> x in the child"),
                       ("pause_resume", "pause -> resume -> x")):
        x = report.add_ratio(f"{key} ipython/stdlib", f"ipython.{key}", f"stdlib.{key}")
        cells = {k: "state kept" if report.results[f"{k}.{key}"].fields.get("state_survives") else "LOST"
                 for k in KINDS if f"{k}.{key}" in report.results and key != "first_result"}
        rows.append(Row(label, [report.results.get(f"stdlib.{key}"), report.results.get(f"ipython.{key}")], x,
                        cells))
    print_table("The run_code kernel in a sandbox, ms (ratio = IPython median / standard-library kernel median, same "
                "image, same run)", rows, sides=("stdlib", "ipython"))
    report.print_errors()
    report.write(args.output)
    return 1 if report.fatal or report.errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
