"""Benchmark the environment server: HTTP overhead of exec, fork(8) over HTTP, and a bounded load run.

What: (1) exec round trip through ``agentenv.connect`` (msgpack over loopback HTTP) against the same
call through the local API on the same sandbox — the overhead goal is under 2 ms at the median;
(2) ``fork(8)`` over HTTP; (3) a load run: ``--clients`` concurrent clients (32 by default) each
looping create -> exec -> snapshot -> fork(1) -> delete for ``--seconds`` seconds (and at most
``--max-ops`` loops each), reporting operations/s, median/p99 latency per operation and errors; at the
end it counts leaked containers, Docker networks and snapshot files (all must be zero).

Why: rollout workers on other machines reach sandboxes through this server; its cost must stay small
next to the sandbox operations themselves.

The server runs as a child process (``agentenv serve``) on 127.0.0.1 with a private $AGENTENV_HOME,
so nothing else on the machine is touched; only 127.0.0.1 is ever contacted. Results go to
``bench/results/server.json`` (keys ``exec.local``, ``exec.http``, ``fork8.http``, ``load.<op>``).

    .venv/bin/python -m bench.server [--runs 300] [--clients 32] [--seconds 20] [--max-ops 20]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

import agentenv
from bench.harness import Report, Row, Timer, add_output_arg, console, median, ms, print_table, recording

HOST = "127.0.0.1"
GOAL_OVERHEAD_MS = 2.0
FORK8_RUNS = 3
LOAD_OPS = ("create", "exec", "snapshot", "fork1", "delete")


def start_server(home: Path, token: str, max_sandboxes: int, log: Path | None = None,
                 reap_interval: float = 60, extra: Sequence[str] = ()) -> tuple[subprocess.Popen[bytes], str]:
    """``agentenv serve`` on a free loopback port with ``home`` as $AGENTENV_HOME, waited for until it answers.
    Its stderr goes to ``log`` when given (a long run would fill an unread pipe and stall the server);
    ``reap_interval``: seconds between its TTL checks (tests of timeouts need a short one); ``extra``: more
    options of ``agentenv serve`` (e.g. ``--shared-store DIR``)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        port = s.getsockname()[1]
    tok = home / "token"
    tok.write_text(token)
    env = {**os.environ, "AGENTENV_HOME": str(home)}
    code = "import sys; from agentenv.cli import main; sys.argv[0] = 'agentenv'; main()"  # the console script
    argv = [sys.executable, "-c", code, "serve", "--host", HOST, "--port", str(port), "--token-file", str(tok),
            "--max-sandboxes", str(max_sandboxes), "--max-memory", "256g",
            "--max-disk", f"{10 * max_sandboxes}g",  # each sandbox's default disk limit is 10 GiB: the count bounds
            "--reap-interval", str(reap_interval), *extra]
    if log is None:
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    else:
        with log.open("ab") as err_file:  # the child keeps its own copy of the descriptor
            proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err_file)
    url = f"http://{HOST}:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.05)
        if proc.poll() is not None:
            break
    proc.kill()
    _, err = proc.communicate()
    if log is not None:
        err = log.read_bytes()
    raise RuntimeError(f"the server did not start: {err.decode(errors='replace').strip()[-800:]}")


def stop_server(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM (the server closes what it holds), then SIGKILL after a minute."""
    if proc is not None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextlib.contextmanager
def e2b_serving(report: Report, name: str, max_sandboxes: int) -> Iterator[tuple[str, str]]:
    """A server in a private home for one benchmark run, the E2B SDK's variables pointing at it: yields (url,
    token). An error in the body is the report's ``fatal``; the server stops and its leaks are recorded after."""
    home = Path(tempfile.mkdtemp(prefix=f"agentenv-bench-{name}-", dir="/var/tmp"))
    token = secrets.token_urlsafe(24)
    proc: subprocess.Popen[bytes] | None = None
    try:
        proc, url = start_server(home, token, max_sandboxes=max_sandboxes, log=home / "server.log")
        os.environ.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY=token)
        yield url, token
    except Exception as e:  # noqa: BLE001 - recorded, the report is still written
        report.fatal = f"{type(e).__name__}: {e}"
    finally:
        stop_server(proc)
    record_leaks(report, home)


def record_leaks(report: Report, home: Path, **more: int) -> dict[str, int]:
    """What a run left under its home (plus ``more`` counts), also into the report; the home goes (its own
    volume and uid pins with it) when nothing was left."""
    left = {**leaks(home, home_mounts=False), **more}
    report.info["leaks"] = left
    if not any(left.values()):
        drop_home(home)
    else:
        report.notes.append(f"leaks after the run (kept {home}): {left}")
    return left


def drop_home(home: Path) -> None:
    """Remove a stopped server's home, its own mounts (the volume, the uid ranges' namespace pins) unmounted
    on the way and never deleted through (``agentenv.host.trees``)."""
    from agentenv.host.trees import remove_tree

    remove_tree(home)


class Servers:
    """Servers of one bench, each with a home of its own (``homes[i]`` serves ``urls[i]``); ``left``: what they
    left behind, filled when they stop."""

    def __init__(self, name: str, count: int) -> None:
        self.token = secrets.token_urlsafe(24)
        self.homes = [Path(tempfile.mkdtemp(prefix=f"agentenv-bench-{name}-", dir="/var/tmp")) for _ in range(count)]
        self.urls: list[str] = []
        self.left: dict[str, int] = {}
        self.key = self.homes[0] / "shared-transfer.key"  # the key they share: each imports what the others seal
        fd = os.open(self.key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")


@contextlib.contextmanager
def separate_servers(report: Report, name: str, settings: Sequence[dict[str, Any]]) -> Iterator[Servers]:
    """Servers on this host connected only over HTTP, one per ``settings`` (``start_server``'s keywords; ``log``
    True: its stderr in its home's server.log), sharing one transfer key, for a bench of what crosses between
    servers. An exception in the body becomes the report's fatal (the report is still written); on exit the servers
    stop and what they left is recorded (``drop_clean_homes``)."""
    servers = Servers(name, len(settings))
    procs = []
    try:
        try:
            for home, kw in zip(servers.homes, settings, strict=True):
                kw = dict(kw, log=home / "server.log" if kw.get("log") else None,
                          extra=[*kw.get("extra", ()), "--transfer-key", str(servers.key)])
                proc, url = start_server(home, servers.token, **kw)
                procs.append(proc)
                servers.urls.append(url)
        except Exception as e:  # noqa: BLE001 - the body then fails at once; this is the reason kept
            report.fatal = f"starting the servers: {type(e).__name__}: {e}"
        yield servers
    except Exception as e:  # noqa: BLE001 - recorded, the report is still written
        report.fatal = report.fatal or f"{type(e).__name__}: {e}"
    finally:
        for proc in procs:
            stop_server(proc)
        servers.left.update(drop_clean_homes(report, servers.homes))


def drop_clean_homes(report: Report, homes: Sequence[Path]) -> dict[str, int]:
    """What sandboxes or snapshots the servers of ``homes`` left (into the report); the homes go when nothing
    was left, and are kept (and named in a note) when something was."""
    left: dict[str, int] = {}
    for home in homes:  # the home's own volume and uid pins are not leaks: they go with it
        left.update({k: v for k, v in leaks(home, home_mounts=False).items() if v})
    report.info["leaks"] = left
    if left:
        report.notes.append(f"leaks after the run (homes kept: {[str(h) for h in homes]}): {left}")
    else:
        for home in homes:
            drop_home(home)
    return left


def docker_networks() -> int:
    r = subprocess.run(["docker", "network", "ls", "-q"], capture_output=True, text=True, check=False)
    return len(r.stdout.split())


def leaks(home: Path, home_mounts: bool = True) -> dict[str, int]:
    """Containers, mounts, snapshot files and sandbox records left under ``home``; ``home_mounts=False`` leaves
    out the home's own volume and uid-namespace pins, which a home kept for the next run holds by design."""
    runc = subprocess.run(["runc", "--root", str(home / "runc"), "list", "-q"], capture_output=True, text=True,
                          check=False).stdout.split()
    mounts = [ln.split()[1] for ln in Path("/proc/self/mounts").read_text().splitlines() if str(home) in ln.split()[1]]
    if not home_mounts:
        mounts = [m for m in mounts if m != str(home / "volume") and not m.startswith(str(home / "uids") + "/")]
    snaps = list((home / "snapshots").iterdir()) if (home / "snapshots").exists() else []
    sbs = list((home / "sandboxes").iterdir()) if (home / "sandboxes").exists() else []
    return {"containers": len(runc), "mounts": len(mounts), "snapshot_files": len(snaps), "sandbox_records": len(sbs)}


def bench_exec(report: Report, url: str, token: str, home: Path, runs: int) -> None:
    """exec `true` through the local API and over HTTP on the same sandbox, interleaved; then fork(8) over HTTP."""
    loc = report.result("exec.local", note="exec `true` through the local API (agentenv.Sandbox.get of the same sandbox)")
    rem = report.result("exec.http", note="exec `true` through agentenv.connect (msgpack over loopback HTTP)")
    f8 = report.result("fork8.http", note="fork(8) through agentenv.connect, until 8 children answer")
    with recording(rem, "exec over HTTP"):
        client = agentenv.connect(url, token)
        remote = client.Sandbox.create(memory="256m")
        try:
            os.environ["AGENTENV_HOME"] = str(home)
            local = agentenv.Sandbox.get(remote.id)
            for _ in range(20):  # warm both paths (connections, caches)
                local.exec("true")
                remote.exec("true")
            for _ in range(runs):  # interleaved, so both see the same machine load
                with Timer() as t:
                    local.exec("true")
                loc.add(t.s)
                with Timer() as t:
                    remote.exec("true")
                rem.add(t.s)
            with recording(f8, "fork(8) over HTTP"):
                for _ in range(FORK8_RUNS):
                    with Timer() as t:
                        kids = remote.fork(8)
                    f8.add(t.s)
                    for k in kids:
                        k.close()
        finally:
            remote.close()
            client.close()


def load(report: Report, url: str, token: str, clients: int, seconds: float, max_ops: int) -> dict[str, Any]:
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
    for op in LOAD_OPS:
        report.result(f"load.{op}").samples.extend(lat.get(op, []))
    total = sum(len(v) for v in lat.values())
    return {"clients": clients, "seconds": round(wall, 2), "loops": loops[0], "operations": total,
            "ops_per_s": round(total / wall, 2) if wall else None, "errors": dict(errors)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--runs", type=int, default=300, help="exec round trips per side")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=20.0, help="bound on the load run's duration")
    ap.add_argument("--max-ops", type=int, default=20, help="bound on loops per client")
    add_output_arg(ap, "server")
    args = ap.parse_args(argv)
    report = Report("server", {k: v for k, v in vars(args).items() if k != "output"})
    home = Path(tempfile.mkdtemp(prefix="agentenv-bench-server-", dir="/var/tmp"))
    token = secrets.token_urlsafe(24)
    nets_before = docker_networks()
    proc: subprocess.Popen[bytes] | None = None
    try:
        proc, url = start_server(home, token, max_sandboxes=4 * args.clients + 16)
        bench_exec(report, url, token, home, args.runs)
        console.log(f"load: {args.clients} clients, at most {args.seconds} s and {args.max_ops} loops each")
        lo = report.info["load"] = load(report, url, token, args.clients, args.seconds, args.max_ops)
    except Exception as e:  # noqa: BLE001 - recorded, the report is still written
        report.fatal = f"{type(e).__name__}: {e}"
        lo = None
    finally:
        stop_server(proc)
    left = record_leaks(report, home, docker_networks=docker_networks() - nets_before)

    loc, rem = report.results.get("exec.local"), report.results.get("exec.http")
    med_l, med_r = median(loc.samples) if loc else None, median(rem.samples) if rem else None
    overhead = None if med_l is None or med_r is None else med_r - med_l
    report.info["exec_overhead"] = {"median_ms": ms(overhead), "goal_ms": GOAL_OVERHEAD_MS,
                                    "meets_goal": None if overhead is None else overhead * 1e3 < GOAL_OVERHEAD_MS}
    x = report.add_ratio("exec http/local", "exec.http", "exec.local")
    goal = "-" if overhead is None else f"{overhead * 1e3:.2f} ms over local, goal < {GOAL_OVERHEAD_MS:g} ms: " + (
        "[green]met[/green]" if overhead * 1e3 < GOAL_OVERHEAD_MS else "[red]MISSED[/red]")
    rows = [Row("exec true, local API", [loc]), Row("exec true, HTTP msgpack", [rem], x, {"note": goal}),
            Row("fork(8) over HTTP", [report.results.get("fork8.http")])]
    rows += [Row(f"load: {op}", [report.results.get(f"load.{op}")]) for op in LOAD_OPS]
    print_table("environment server on loopback, ms (ratio = HTTP median / local median)", rows, p99=True)
    if lo is not None:
        console.print(f"load: {lo['clients']} clients, {lo['seconds']:.1f} s, {lo['operations']} operations, "
                      f"{lo['ops_per_s']} ops/s, {lo['loops']} full loops, errors: {lo['errors'] or 'none'}",
                      highlight=False)
    console.print(f"leaks after the run: {left}", highlight=False)
    report.print_errors()
    report.write(args.output)
    return 1 if report.fatal or report.errors or any(left.values()) or (lo is not None and lo["errors"]) else 0


if __name__ == "__main__":
    sys.exit(main())
