"""Benchmark the E2B API of the environment server: the official SDKs against ``agentenv serve`` on loopback.

What, each with the native client (``agentenv.connect``) doing the same on the same server in the same run:
(1) create -> first command answered; (2) a command's round trip (``commands.run("true")``, envd's Connect
stream, against ``exec``); (3) a file write + read of 1 KiB; (4) fork(1) and fork(4) of a live sandbox, memory
and all; (5) pause -> connect (resume) -> first command; and for the code interpreter (6) the first
``run_code`` of a sandbox (the kernel starts) and (7) a warm one; (8) a sandbox of a template whose start command
(a Python HTTP server) is already running, restored from the template's snapshot, against a cold boot that starts
the command and waits for it, and (9) a small template's build (one COPY, one RUN, uncached) to ready
(``--only templates`` runs these alone).

Why: E2B users judge a self-hosted server by these calls; the native path shows what the adapter costs.

The server runs as a child process with a private $AGENTENV_HOME (as in ``bench.server``); results go to
``bench/results/e2b.json`` (``--only templates``: ``bench/results/e2b-templates.json``).

    .venv/bin/python -m bench.e2b [--runs 10]
"""

from __future__ import annotations

import argparse
import os
import secrets
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import agentenv
from bench.harness import Report, Row, Timer, add_output_arg, print_table, recording
from bench.server import e2b_serving

PAIRS = (("create_first_command", "create -> first command"), ("command", "command round trip"),
         ("file_write_read", "write + read 1 KiB"), ("fork1", "fork(1), memory"), ("fork4", "fork(4), memory"),
         ("pause_resume", "pause -> resume -> command"))


def timed(report: Report, key: str, runs: int, fn: Callable[[], Any], after: Callable[[Any], object] | None = None,
          note: str | None = None) -> None:
    r = report.result(key, note)
    with recording(r, key):
        for _ in range(runs):
            with Timer() as t:
                out = fn()
            r.add(t.s)
            if after is not None:
                after(out)


def bench_e2b(report: Report, runs: int) -> None:
    from e2b import Sandbox
    from e2b_code_interpreter import Sandbox as CodeSandbox

    def create_and_run() -> Any:
        sb = Sandbox.create()
        sb.commands.run("true")
        return sb

    timed(report, "e2b.create_first_command", runs, create_and_run, lambda sb: sb.kill())
    sb = Sandbox.create(timeout=3600)
    try:
        sb.commands.run("true")
        timed(report, "e2b.command", runs * 10, lambda: sb.commands.run("true"))
        data = os.urandom(1024)
        timed(report, "e2b.file_write_read", runs * 10,
              lambda: (sb.files.write("/tmp/f", data), sb.files.read("/tmp/f", format="bytes")))
        timed(report, "e2b.fork1", runs, lambda: sb.fork(count=1), lambda kids: [k.kill() for k in kids])
        timed(report, "e2b.fork4", runs, lambda: sb.fork(count=4), lambda kids: [k.kill() for k in kids])

        def pause_resume() -> None:
            sb.pause()
            Sandbox.connect(sb.sandbox_id).commands.run("true")

        timed(report, "e2b.pause_resume", runs, pause_resume)
    finally:
        sb.kill()
    first = report.result("e2b.run_code_first", "create, then the first run_code (the kernel starts)")
    warm = report.result("e2b.run_code_warm", "run_code('1 + 1') in a running kernel")
    with recording(first, "run_code"):
        for _ in range(runs):
            ci = CodeSandbox.create()
            try:
                with Timer() as t:
                    ci.run_code("1 + 1")
                first.add(t.s)
                for _ in range(10):
                    with Timer() as t:
                        ci.run_code("1 + 1")
                    warm.add(t.s)
            finally:
                ci.kill()


START = ("python3 -c \"import asyncio, email.mime.text, http.server, json, sqlite3, xml.dom.minidom; "
         "s = http.server.HTTPServer(('127.0.0.1', 8000), http.server.SimpleHTTPRequestHandler); "
         "open('/tmp/ready', 'w').close(); s.serve_forever()\"")
READY = "test -f /tmp/ready"


def bench_template(report: Report, url: str, token: str, runs: int) -> None:
    """(8) A sandbox of a template whose start command is a running server: restored from the template's snapshot
    (built once) against a cold boot of the base image that then starts the command and waits until it is ready."""
    import httpx
    from e2b import Sandbox, Template

    name = f"bench-start-{secrets.token_hex(4)}"
    Template.build(Template().from_image("agentenv/base").set_start_cmd(START, READY), name)
    try:
        def restored() -> Any:
            sb = Sandbox.create(name)
            sb.commands.run(READY)
            return sb

        def cold() -> Any:
            sb = Sandbox.create("base")
            sb.commands.run(START, background=True)
            deadline = time.monotonic() + 60
            while sb.commands.run(f"{READY} && echo y || echo n").stdout.strip() != "y":
                if time.monotonic() > deadline:
                    raise RuntimeError("the start command was not ready within 60 s of a cold boot")
            return sb

        timed(report, "template.restored", runs, restored, lambda sb: sb.kill(),
              "create from a template with a running start command (restored from its snapshot) -> first command")
        timed(report, "template.cold", runs, cold, lambda sb: sb.kill(),
              "create from the base image, start the same command, poll until it is ready")
    finally:
        httpx.delete(f"{url}/templates/{name}", headers={"X-API-KEY": token}, timeout=60)
    with tempfile.TemporaryDirectory() as context:
        (Path(context) / "app.txt").write_text("hello\n")

        def build() -> str:
            small = f"bench-build-{secrets.token_hex(4)}"
            Template.build(Template(file_context_path=context).from_image("agentenv/base").skip_cache()
                           .copy("app.txt", "/opt/app/").run_cmd("cat /opt/app/app.txt > /opt/app/copied"), small)
            return small

        timed(report, "template.build", runs, build,
              lambda small: httpx.delete(f"{url}/templates/{small}", headers={"X-API-KEY": token}, timeout=60),
              "Template.build of one COPY (a small file) and one RUN on agentenv/base, uncached, to ready")


def bench_native(report: Report, url: str, token: str, runs: int) -> None:
    client = agentenv.connect(url, token)

    def create_and_run() -> Any:
        sb = client.Sandbox.create()
        sb.exec("true")
        return sb

    timed(report, "native.create_first_command", runs, create_and_run, lambda sb: sb.close())
    sb = client.Sandbox.create(ttl=3600)
    try:
        sb.exec("true")
        timed(report, "native.command", runs * 10, lambda: sb.exec("true"))
        data = os.urandom(1024)
        timed(report, "native.file_write_read", runs * 10, lambda: (sb.write_file("/tmp/f", data), sb.read_file("/tmp/f")))
        timed(report, "native.fork1", runs, lambda: sb.fork(1), lambda kids: [k.close() for k in kids])
        timed(report, "native.fork4", runs, lambda: sb.fork(4), lambda kids: [k.close() for k in kids])

        def pause_resume() -> None:
            sb.pause()
            sb.resume()
            sb.exec("true")

        timed(report, "native.pause_resume", runs, pause_resume)
    finally:
        sb.close()
        client.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--runs", type=int, default=10, help="runs of each operation (x10 for the quick ones)")
    ap.add_argument("--only", choices=("all", "templates"), default="all", help="what to run")
    add_output_arg(ap, "e2b")
    args = ap.parse_args(argv)
    if args.only == "templates" and args.output == ap.get_default("output"):
        args.output = args.output.with_name("e2b-templates.json")  # the full run's results stay as they were
    report = Report("e2b", {k: v for k, v in vars(args).items() if k != "output"})
    with e2b_serving(report, "e2b", max_sandboxes=64) as (url, token):
        if args.only == "all":
            bench_native(report, url, token, args.runs)
            bench_e2b(report, args.runs)
        bench_template(report, url, token, args.runs)
    rows = []
    for key, label in PAIRS if args.only == "all" else ():
        x = report.add_ratio(f"{key} e2b/native", f"e2b.{key}", f"native.{key}")
        rows.append(Row(label, [report.results.get(f"e2b.{key}"), report.results.get(f"native.{key}")], x))
    rows += [Row("run_code, first (kernel starts)", [report.results.get("e2b.run_code_first"), None]),
             Row("run_code, warm", [report.results.get("e2b.run_code_warm"), None])] if args.only == "all" else []
    if rows:
        print_table("E2B SDK against agentenv serve, ms (ratio = E2B median / native client median, same server, "
                    "same run)", rows, sides=("e2b", "native"))
    x = report.add_ratio("template cold/restored", "template.cold", "template.restored")
    print_table("A template's start command running in a new sandbox, ms (ratio = cold boot + start median / "
                "restored median)", [Row("create -> start command ready", [report.results.get("template.restored"),
                                                                             report.results.get("template.cold")], x)],
                sides=("restored", "cold"))
    print_table("A small template's build (one COPY, one RUN, uncached) to ready, ms",
                [Row("Template.build", [report.results.get("template.build")])])
    report.print_errors()
    report.write(args.output)
    return 1 if report.fatal or report.errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
