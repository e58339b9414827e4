"""Benchmark the environment server: HTTP overhead of exec, fork(8) over HTTP, and a bounded load run.

What: (1) exec round trip through ``agentenv.connect`` (msgpack over loopback HTTP) against the same
call through the local API on the same sandbox — the overhead goal is under 2 ms at the median;
(2) ``fork(8)`` over HTTP; (3) a load run: ``--clients`` concurrent clients (32 by default) each
looping create -> exec -> snapshot -> fork(1) -> delete for ``--seconds`` seconds (and at most
``--max-ops`` loops each), reporting operations/s, p50/p99 latency per operation and errors; at the
end it counts leaked containers, Docker networks and snapshot files (all must be zero).

Why: rollout workers on other machines reach sandboxes through this server; its cost must stay small
next to the sandbox operations themselves.

The server runs as a child process (``agentenv serve``) on 127.0.0.1 with a private $AGENTENV_HOME,
so nothing else on the machine is touched; only 127.0.0.1 is ever contacted. Results go to
``bench/results/server.json``.

    .venv/bin/python bench/server.py [--runs 300] [--clients 32] [--seconds 20] [--max-ops 20]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

import agentenv

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "server.json"
HOST = "127.0.0.1"


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000, 3)


def timed(fn: Callable[[], object], runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def start_server(home: Path, token: str, max_sandboxes: int) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind((HOST, 0))
        port = s.getsockname()[1]
    tok = home / "token"
    tok.write_text(token)
    env = {**os.environ, "AGENTENV_HOME": str(home)}
    code = "import sys; from agentenv.cli import main; sys.argv[0] = 'agentenv'; main()"
    proc = subprocess.Popen([sys.executable, "-c", code, "serve", "--host", HOST, "--port", str(port),
                             "--token-file", str(tok), "--max-sandboxes", str(max_sandboxes), "--max-memory", "256g",
                             "--reap-interval", "60"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://{HOST}:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("the server did not start")


def docker_networks() -> int:
    r = subprocess.run(["docker", "network", "ls", "-q"], capture_output=True, text=True, check=False)
    return len(r.stdout.split())


def leaks(home: Path) -> dict[str, int]:
    runc = subprocess.run(["runc", "--root", str(home / "runc"), "list", "-q"], capture_output=True, text=True,
                          check=False).stdout.split()
    mounts = [ln for ln in Path("/proc/self/mounts").read_text().splitlines() if str(home) in ln.split()[1]]
    snaps = list((home / "snapshots").iterdir()) if (home / "snapshots").exists() else []
    sbs = list((home / "sandboxes").iterdir()) if (home / "sandboxes").exists() else []
    return {"containers": len(runc), "mounts": len(mounts), "snapshot_files": len(snaps), "sandbox_records": len(sbs)}


def bench_exec(client: agentenv.client.Client, home: Path, runs: int) -> dict[str, Any]:
    remote = client.Sandbox.create(memory="256m")
    try:
        os.environ["AGENTENV_HOME"] = str(home)
        local = agentenv.Sandbox.get(remote.id)
        for _ in range(20):  # warm both paths (connections, caches)
            local.exec("true")
            remote.exec("true")
        loc, rem = [], []
        for _ in range(runs):  # interleaved, so both see the same machine load
            loc += timed(lambda: local.exec("true"), 1)
            rem += timed(lambda: remote.exec("true"), 1)
        fork8 = []
        for _ in range(3):
            t = time.perf_counter()
            kids = remote.fork(8)
            fork8.append(time.perf_counter() - t)
            for k in kids:
                k.close()
    finally:
        remote.close()
    return {"exec_local": loc, "exec_http": rem, "fork8_http": fork8}


def load(url: str, token: str, clients: int, seconds: float, max_ops: int) -> dict[str, Any]:
    lat: dict[str, list[float]] = defaultdict(list)
    errors: dict[str, int] = defaultdict(int)
    lock = threading.Lock()
    deadline = time.monotonic() + seconds
    loops = [0]

    def worker() -> None:
        c = agentenv.connect(url, token, timeout=300)
        try:
            for _ in range(max_ops):
                if time.monotonic() > deadline:
                    return
                made: list[Any] = []
                snap = None

                def step(op: str, fn: Callable[[], Any]) -> Any:
                    t = time.perf_counter()
                    out = fn()
                    with lock:
                        lat[op].append(time.perf_counter() - t)
                    return out

                try:
                    sb = step("create", lambda: c.Sandbox.create(memory="128m"))
                    made.append(sb)
                    step("exec", functools.partial(sb.exec, "echo hi"))
                    snap = step("snapshot", sb.snapshot)
                    made.extend(step("fork1", functools.partial(sb.fork, 1)))
                    with lock:
                        loops[0] += 1
                except Exception as e:  # noqa: BLE001 - counted, the run goes on
                    with lock:
                        errors[type(e).__name__] += 1
                finally:
                    for m in made:
                        t = time.perf_counter()
                        try:
                            m.close()
                            with lock:
                                lat["delete"].append(time.perf_counter() - t)
                        except Exception as e:  # noqa: BLE001
                            with lock:
                                errors[f"delete:{type(e).__name__}"] += 1
                    if snap is not None:
                        try:
                            snap.delete()
                        except Exception as e:  # noqa: BLE001
                            with lock:
                                errors[f"snapshot-delete:{type(e).__name__}"] += 1
        finally:
            c.close()

    started = time.monotonic()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - started
    total = sum(len(v) for v in lat.values())
    return {"clients": clients, "seconds": wall, "loops": loops[0], "operations": total,
            "ops_per_s": total / wall if wall else None, "errors": dict(errors),
            "latency": {op: {"n": len(v), "p50_ms": ms(pct(v, 0.5)), "p99_ms": ms(pct(v, 0.99))}
                        for op, v in lat.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=300, help="exec round trips per side")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=20.0, help="bound on the load run's duration")
    ap.add_argument("--max-ops", type=int, default=20, help="bound on loops per client")
    args = ap.parse_args()
    console = Console()
    home = Path(tempfile.mkdtemp(prefix="agentenv-bench-server-", dir="/var/tmp"))
    token = secrets.token_urlsafe(24)
    nets_before = docker_networks()
    proc, url = start_server(home, token, max_sandboxes=4 * args.clients + 16)
    result: dict[str, Any] = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
                              "args": vars(args)}
    try:
        client = agentenv.connect(url, token)
        ex = bench_exec(client, home, args.runs)
        client.close()
        lo = load(url, token, args.clients, args.seconds, args.max_ops)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    left = leaks(home)
    left["docker_networks"] = docker_networks() - nets_before
    if not any(left.values()):
        shutil.rmtree(home, ignore_errors=True)
    med_l, med_r = statistics.median(ex["exec_local"]), statistics.median(ex["exec_http"])
    result["exec"] = {"local": {"p50_ms": ms(med_l), "p90_ms": ms(pct(ex["exec_local"], 0.9))},
                      "http": {"p50_ms": ms(med_r), "p90_ms": ms(pct(ex["exec_http"], 0.9))},
                      "overhead_p50_ms": ms(med_r - med_l), "goal_overhead_p50_ms": 2.0,
                      "meets_goal": med_r - med_l < 0.002}
    result["fork8_http"] = {"p50_ms": ms(statistics.median(ex["fork8_http"])), "p90_ms": ms(pct(ex["fork8_http"], 0.9)),
                            "runs": len(ex["fork8_http"])}
    result["load"] = lo
    result["leaks"] = left

    t = Table("measure", "p50 ms", "p90/p99 ms", "note")
    t.add_row("exec true, local API", f"{ms(med_l)}", f"{ms(pct(ex['exec_local'], 0.9))} (p90)", f"n={args.runs}")
    t.add_row("exec true, HTTP msgpack", f"{ms(med_r)}", f"{ms(pct(ex['exec_http'], 0.9))} (p90)", f"n={args.runs}")
    t.add_row("HTTP overhead", f"{ms(med_r - med_l)}", "", "goal < 2 ms: " + ("met" if med_r - med_l < 0.002 else "MISSED"))
    t.add_row("fork(8) over HTTP", f"{result['fork8_http']['p50_ms']}", f"{result['fork8_http']['p90_ms']} (p90)", "n=3")
    for op, v in lo["latency"].items():
        t.add_row(f"load: {op}", f"{v['p50_ms']}", f"{v['p99_ms']} (p99)", f"n={v['n']}")
    console.print(t)
    console.print(f"load: {lo['clients']} clients, {lo['seconds']:.1f} s, {lo['operations']} operations, "
                  f"{lo['ops_per_s']:.1f} ops/s, {lo['loops']} full loops, errors: {lo['errors'] or 'none'}")
    console.print(f"leaks after the run: {left}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    console.print(f"written to {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
