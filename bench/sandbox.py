"""Benchmark agentenv sandboxes against the plain Docker path for the same operations.

What: median and p90 latency of each sandbox operation agentenv promises to make fast (create,
exec, filesystem and memory snapshots, fork(1), fork(8), pause, resume, restore in a fresh
process), next to the closest thing plain Docker offers through the Docker SDK (``docker run``,
``docker exec``, ``docker commit``, ``docker checkpoint create``, and fork the Docker way:
checkpoint + commit + create from the committed image + copy the checkpoint + start from it).

Why: agentenv bypasses Docker's container plumbing (runc directly, CRIU through ``runc
checkpoint``, an in-sandbox agent instead of ``docker exec``) to make RL rollouts cheap to fork and
resume. This script checks the issue's latency targets and shows the speed-up over plain Docker.

Both sides use the same image (``agentenv/base``), no network, 1 CPU and 1 GiB of memory. The
workloads are a git repository in /testbed with ~50 committed files and a few edits, and a Python
process holding ~100 MB of touched memory. Docker's checkpoint-based operations take seconds, so
they run ``--docker-runs`` times (cheap Docker operations run ``--runs`` times like agentenv's).
A failing operation is recorded with its error text; no figure is ever invented.

Results go to ``bench/results/sandbox.json``; everything created is removed at the end, on error too.

    .venv/bin/python bench/sandbox.py [--runs 10] [--docker-runs 3] [--quick] [--no-docker]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import docker
import docker.errors
from docker.models.containers import Container as DockerContainer
from rich.console import Console
from rich.table import Table

import agentenv
from agentenv import Sandbox, Snapshot

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "sandbox.json"
IMAGE = "agentenv/base"
CPUS = 1.0
MEMORY = "1g"
LABEL = "agentenv.bench"
MEM_MB = 100
MEM_CODE = (f"import time; b = bytearray({MEM_MB} << 20); b[::4096] = bytes([1]) * (len(b) // 4096); "
            "print('ready', flush=True); time.sleep(1e9)")
REPO_SETUP = """set -e
mkdir -p /testbed/src /testbed/tests && cd /testbed
git init -q . && git config user.email bench@example.com && git config user.name bench
for i in $(seq 1 40); do printf 'def f%d(x):\\n    return x + %d\\n' $i $i > src/mod_$i.py; done
for i in $(seq 1 9); do printf 'from src.mod_%d import f%d\\n\\ndef test_f%d():\\n    assert f%d(0) == %d\\n' \
  $i $i $i $i $i > tests/test_$i.py; done
printf '# testbed\\n' > README.md
git add -A && git commit -qm init
"""
# a few edits, different each run: two modified files, one new file
REPO_EDIT = """set -e
cd /testbed
printf '\\ndef g_{n}():\\n    return {n}\\n' >> src/mod_1.py
sed -i 's/return x + 2$/return x + 2 + {n} - {n}/' src/mod_2.py
printf 'print({n})\\n' > src/new_{n}.py
"""

# name shown, agentenv operation, Docker counterpart, target median in ms (None: no target)
OPERATIONS: list[tuple[str, str, str, float | None]] = [
    ("create", "create -> exec-ready", "docker run -> running", 150.0),
    ("exec", "exec `true` round trip", "docker exec `true`", 5.0),
    ("fs_snapshot", "fs snapshot (git repo+edits)", "docker commit", 50.0),
    ("mem_snapshot", f"memory snapshot ({MEM_MB} MB proc)", "checkpoint create", 150.0),
    ("fork1", "fork(1) -> child running", "ckpt+commit+create+cp+start", 250.0),
    ("fork1_exec", "first exec in forked child", "docker exec in child", None),
    ("fork8", "fork(8) -> all running", "ckpt+commit+8x(create+cp+start)", 1500.0),
    ("pause", f"pause ({MEM_MB} MB sandbox)", "checkpoint create --exit", None),
    ("resume", f"resume ({MEM_MB} MB sandbox)", "start --checkpoint", 250.0),
    ("restore", "restore, fresh proc (in-proc)", "create+cp+start --checkpoint", None),
    ("restore_wall", "restore, fresh proc (wall)", "-", None),
]
START_RETRIES = 5  # moby/moby#42900: start --checkpoint sometimes fails with "content ... already exists"

console = Console(width=max(170, shutil.get_terminal_size((170, 40)).columns))


# --- measurement bookkeeping -----------------------------------------------------------------------------


@dataclass
class Measure:
    """Samples (seconds) of one operation on one side, and the error that stopped it, if any."""

    samples: list[float] = field(default_factory=list)
    error: str | None = None
    note: str | None = None
    extra: dict[str, list[float]] = field(default_factory=dict)
    retries: int = 0
    retry_errors: list[str] = field(default_factory=list)

    def add_extra(self, name: str, seconds: float) -> None:
        self.extra.setdefault(name, []).append(seconds)

    def to_json(self) -> dict[str, Any]:
        return {"n": len(self.samples), "median_ms": ms(median(self.samples)), "p90_ms": ms(p90(self.samples)),
                "samples_ms": [round(s * 1e3, 3) for s in self.samples], "error": self.error, "note": self.note,
                "retries": self.retries, "retry_errors": self.retry_errors,
                "extra": {k: {"median_ms": ms(median(v)), "p90_ms": ms(p90(v)),
                              "samples_ms": [round(s * 1e3, 3) for s in v]} for k, v in self.extra.items()}}


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def p90(xs: list[float]) -> float | None:
    """90th percentile, linear interpolation between closest ranks (the sample itself when n == 1)."""
    if not xs:
        return None
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=10, method="inclusive")[8]


def ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 3)


@contextlib.contextmanager
def recording(m: Measure, what: str) -> Iterator[None]:
    """Run one benchmark phase; an exception stops the phase and is recorded, never a made-up number."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - recorded into the results and printed
        m.error = f"{type(e).__name__}: {e}".strip()
        console.print(f"[red]{what} failed:[/red] {m.error}")
        console.print(traceback.format_exc(limit=4), style="dim", markup=False, highlight=False)


class Timer:
    """``with Timer() as t: ...`` then ``t.s`` is the elapsed wall time in seconds."""

    def __enter__(self) -> Timer:
        self.t0 = time.perf_counter()
        self.s = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self.s = time.perf_counter() - self.t0


def wait_until(cond: Callable[[], bool], timeout: float, what: str, every: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not reached after {timeout} s")
        time.sleep(every)


# --- cleanup -------------------------------------------------------------------------------------------


class Cleanup:
    """Everything this run creates, removed at the end (and swept by label for what slipped through)."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.sandboxes: list[Sandbox] = []
        self.snapshots: list[Snapshot] = []
        self.containers: list[str] = []
        self.images: list[str] = []
        self.errors: list[str] = []

    @property
    def labels(self) -> dict[str, str]:
        return {LABEL: self.run_id}

    def _try(self, what: str, fn: Callable[[], object]) -> None:
        try:
            fn()
        except (agentenv.errors.SandboxNotFound, agentenv.errors.SnapshotNotFound, docker.errors.NotFound):
            pass
        except Exception as e:  # noqa: BLE001 - cleanup carries on, the failure is reported
            self.errors.append(f"{what}: {type(e).__name__}: {e}")

    def close_sandbox(self, sb: Sandbox) -> None:
        self._try(f"close {sb.id}", sb.close)
        with contextlib.suppress(ValueError):
            self.sandboxes.remove(sb)

    def delete_snapshot(self, snap: Snapshot) -> None:
        self._try(f"delete {snap.id}", snap.delete)
        with contextlib.suppress(ValueError):
            self.snapshots.remove(snap)

    def remove_container(self, client: docker.DockerClient, cid: str) -> None:
        self._try(f"rm {cid[:12]}", lambda: client.api.remove_container(cid, force=True, v=True))
        with contextlib.suppress(ValueError):
            self.containers.remove(cid)

    def remove_image(self, client: docker.DockerClient, iid: str) -> None:
        self._try(f"rmi {iid[:19]}", lambda: client.api.remove_image(iid, force=True, noprune=False))
        with contextlib.suppress(ValueError):
            self.images.remove(iid)

    def all(self, client: docker.DockerClient | None) -> None:
        for sb in list(self.sandboxes):
            self.close_sandbox(sb)
        for snap in list(self.snapshots):
            self.delete_snapshot(snap)
        # sweep by label: fork children and restores made in child processes carry the run's label
        with contextlib.suppress(Exception):
            for sb in Sandbox.list():
                if sb.labels.get(LABEL) == self.run_id:
                    self._try(f"close {sb.id}", sb.close)
        with contextlib.suppress(Exception):
            for snap in Snapshot.list():
                if snap.labels.get(LABEL) == self.run_id:
                    self._try(f"delete {snap.id}", snap.delete)
        if client is None:
            return
        for cid in list(self.containers):
            self.remove_container(client, cid)
        with contextlib.suppress(Exception):
            for c in client.api.containers(all=True, filters={"label": f"{LABEL}={self.run_id}"}):
                self.remove_container(client, c["Id"])
        for iid in list(self.images):
            self.remove_image(client, iid)
        with contextlib.suppress(Exception):
            for img in client.api.images(filters={"label": f"{LABEL}={self.run_id}"}):
                self.remove_image(client, img["Id"])


# --- agentenv side ---------------------------------------------------------------------------------------


class AgentenvBench:
    def __init__(self, runs: int, cleanup: Cleanup, fork_source: str) -> None:
        self.runs, self.cleanup, self.fork_source = runs, cleanup, fork_source
        self.results: dict[str, Measure] = {op: Measure() for op, *_ in OPERATIONS}
        self.info: dict[str, Any] = {}

    def new_sandbox(self) -> Sandbox:
        sb = Sandbox.create(IMAGE, cpus=CPUS, memory=MEMORY, labels=self.cleanup.labels)
        self.cleanup.sandboxes.append(sb)
        return sb

    def run_all(self) -> None:
        steps: list[tuple[str, Callable[[], None]]] = [
            ("create", self.bench_create), ("exec", self.bench_exec), ("repo", self.bench_repo),
            ("memory", self.bench_memory),
        ]
        for name, fn in steps:
            console.log(f"agentenv: {name}")
            fn()

    def bench_create(self) -> None:
        m = self.results["create"]
        m.note = "Sandbox.create() returns once the in-sandbox agent answers (exec-ready); extra: + first exec"
        with recording(m, "agentenv create"):
            self.cleanup.close_sandbox(self.new_sandbox())  # warm-up: image lookup, page cache
            for _ in range(self.runs):
                with Timer() as t:
                    sb = Sandbox.create(IMAGE, cpus=CPUS, memory=MEMORY, labels=self.cleanup.labels)
                self.cleanup.sandboxes.append(sb)
                with Timer() as t2:
                    r = sb.exec("true")
                if not r.ok:
                    raise RuntimeError(f"first exec failed: {r}")
                m.samples.append(t.s)
                m.add_extra("create_plus_first_exec", t.s + t2.s)
                self.cleanup.close_sandbox(sb)

    def bench_exec(self) -> None:
        m = self.results["exec"]
        with recording(m, "agentenv exec"):
            sb = self.new_sandbox()
            sb.exec("true")
            for _ in range(self.runs):
                with Timer() as t:
                    r = sb.exec("true")
                if not r.ok:
                    raise RuntimeError(f"exec failed: {r}")
                m.samples.append(t.s)
            self.cleanup.close_sandbox(sb)

    def setup_repo(self) -> Sandbox:
        sb = self.new_sandbox()
        r = sb.exec(REPO_SETUP, timeout=120)
        if not r.ok:
            raise RuntimeError(f"git repo setup failed: {r.stderr or r.stdout}")
        files = sb.exec("cd /testbed && git ls-files | wc -l").stdout.strip()
        self.info["repo_files"] = int(files)
        return sb

    def start_mem(self) -> tuple[Sandbox, agentenv.Process]:
        sb = self.new_sandbox()
        proc = sb.spawn(f'exec python3 -c "{MEM_CODE}"')

        def rss_kb() -> int:
            for line in sb.read_file(f"/proc/{proc.pid}/status").decode().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
            return 0

        wait_until(lambda: "ready" in proc.output() and rss_kb() >= MEM_MB * 1000, 60, "100 MB process")
        self.info["mem_rss_kb"] = rss_kb()
        return sb, proc

    def bench_repo(self) -> None:
        m = self.results["fs_snapshot"]
        repo: Sandbox | None = None
        with recording(m, "agentenv repo setup"):
            repo = self.setup_repo()
        if repo is None:
            for op in ("fork1", "fork1_exec", "fork8"):
                if self.fork_source == "repo":
                    self.results[op].error = f"repo setup failed: {m.error}"
            return
        with recording(m, "agentenv filesystem snapshot"):
            for i in range(self.runs):
                r = repo.exec(REPO_EDIT.format(n=i))
                if not r.ok:
                    raise RuntimeError(f"edit failed: {r.stderr}")
                with Timer() as t:
                    snap = repo.snapshot(memory=False, labels=self.cleanup.labels)
                self.cleanup.snapshots.append(snap)
                m.samples.append(t.s)
                if i == 0:
                    self.info["fs_snapshot_bytes"] = snap.size_bytes
                self.cleanup.delete_snapshot(snap)
        if self.fork_source == "repo":
            self.bench_fork(repo, check="cd /testbed && git status --porcelain | grep -q new_0.py")
        self.cleanup.close_sandbox(repo)

    def bench_fork(self, src: Sandbox, check: str) -> None:
        m1, me, m8 = self.results["fork1"], self.results["fork1_exec"], self.results["fork8"]
        m1.note = f"source: the {self.fork_source} sandbox; fork() returns children whose agent answered"
        m8.note = m1.note
        with recording(m1, "agentenv fork(1)"):
            for i in range(self.runs):
                with Timer() as t:
                    kids = cast("list[Sandbox]", src.fork(1))  # older agentenv: Sandbox.list shadowed list for mypy
                self.cleanup.sandboxes.extend(kids)
                m1.samples.append(t.s)
                try:
                    with Timer() as t2:
                        r = kids[0].exec("true")
                    if not r.ok:
                        raise RuntimeError(f"exec in child failed: {r}")
                    me.samples.append(t2.s)
                    if i == 0:
                        r = kids[0].exec(check)
                        if not r.ok:
                            raise RuntimeError(f"forked child lacks the parent's state ({check!r}): {r}")
                except Exception as e:
                    me.error = f"{type(e).__name__}: {e}"
                    raise
                finally:
                    for k in kids:
                        self.cleanup.close_sandbox(k)
        with recording(m8, "agentenv fork(8)"):
            for _ in range(self.runs):
                with Timer() as t:
                    kids = cast("list[Sandbox]", src.fork(8))
                self.cleanup.sandboxes.extend(kids)
                m8.samples.append(t.s)
                for k in kids:
                    self.cleanup.close_sandbox(k)

    def bench_memory(self) -> None:
        m = self.results["mem_snapshot"]
        mem: Sandbox | None = None
        proc: agentenv.Process | None = None
        with recording(m, "agentenv 100 MB process"):
            mem, proc = self.start_mem()
        if mem is None or proc is None:
            for op in ("pause", "resume", "restore", "restore_wall"):
                self.results[op].error = f"100 MB process setup failed: {m.error}"
            return
        with recording(m, "agentenv memory snapshot"):
            for i in range(self.runs):
                with Timer() as t:
                    snap = mem.snapshot(memory=True, labels=self.cleanup.labels)
                self.cleanup.snapshots.append(snap)
                m.samples.append(t.s)
                if i == 0:
                    self.info["mem_snapshot_bytes"] = snap.size_bytes
                self.cleanup.delete_snapshot(snap)
        if self.fork_source == "mem":
            self.bench_fork(mem, check=f"test -d /proc/{proc.pid}")
        self.bench_pause_resume(mem, proc)
        self.bench_restore(mem)
        self.cleanup.close_sandbox(mem)

    def bench_pause_resume(self, sb: Sandbox, proc: agentenv.Process) -> None:
        mp, mr = self.results["pause"], self.results["resume"]
        with recording(mp, "agentenv pause/resume"):
            for _ in range(self.runs):
                with Timer() as t:
                    sb.pause()
                mp.samples.append(t.s)
                try:
                    with Timer() as t2:
                        sb.resume()
                except Exception as e:
                    mr.error = f"{type(e).__name__}: {e}"
                    raise
                mr.samples.append(t2.s)
            if proc.exit_code is not None:
                raise RuntimeError(f"the 100 MB process died across pause/resume (exit {proc.exit_code})")
            status = sb.read_file(f"/proc/{proc.pid}/status").decode()
            self.info["mem_rss_after_resume"] = next(
                (ln.split(":", 1)[1].strip() for ln in status.splitlines() if ln.startswith("VmRSS:")), None)

    def bench_restore(self, sb: Sandbox) -> None:
        m, mw = self.results["restore"], self.results["restore_wall"]
        m.note = (f"Sandbox.restore(id) of a memory snapshot of the {MEM_MB} MB sandbox, timed inside a fresh "
                  "python process (after 'import agentenv'); extra: import time")
        mw.note = "from spawning the interpreter to its report (interpreter start + import + restore)"
        child = (
            "import json, sys, time\n"
            "t0 = time.perf_counter()\n"
            "import agentenv\n"
            "t1 = time.perf_counter()\n"
            f"sb = agentenv.Sandbox.restore(sys.argv[1], labels={{{LABEL!r}: sys.argv[2]}})\n"
            "t2 = time.perf_counter()\n"
            "print(json.dumps({'import_s': t1 - t0, 'restore_s': t2 - t1, 'sandbox': sb.id}), flush=True)\n"
            "ok = sb.exec('true').ok\n"
            "sb.close()\n"
            "sys.exit(0 if ok else 3)\n"
        )
        with recording(m, "agentenv restore"):
            snap = sb.snapshot(memory=True, labels=self.cleanup.labels)
            self.cleanup.snapshots.append(snap)
            for _ in range(self.runs):
                t0 = time.perf_counter()
                p = subprocess.Popen([sys.executable, "-c", child, snap.id, self.cleanup.run_id], cwd=ROOT,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                assert p.stdout is not None
                line = p.stdout.readline()
                wall = time.perf_counter() - t0
                try:
                    _, err = p.communicate(timeout=120)
                except subprocess.TimeoutExpired:
                    p.kill()
                    _, err = p.communicate()
                report: dict[str, Any] | None = None
                with contextlib.suppress(json.JSONDecodeError):
                    report = json.loads(line) if line.strip() else None
                if report is not None and p.returncode != 0:
                    with contextlib.suppress(Exception):
                        self.cleanup.close_sandbox(Sandbox.get(report["sandbox"]))
                if report is None or p.returncode != 0:
                    raise RuntimeError(f"restore child exited {p.returncode}: {(err or line).strip()[-800:]}")
                m.samples.append(report["restore_s"])
                m.add_extra("import_agentenv", report["import_s"])
                mw.samples.append(wall)
            self.cleanup.delete_snapshot(snap)
        if m.error:
            mw.error = m.error


# --- plain Docker side -----------------------------------------------------------------------------------


class DockerBench:
    def __init__(self, client: docker.DockerClient, runs: int, slow_runs: int, cleanup: Cleanup,
                 fork_source: str) -> None:
        self.client, self.api = client, client.api
        self.runs, self.slow_runs, self.cleanup, self.fork_source = runs, slow_runs, cleanup, fork_source
        self.results: dict[str, Measure] = {op: Measure() for op, *_ in OPERATIONS}
        self.results["restore_wall"].note = "no Docker counterpart measured"
        self.root = Path(client.info()["DockerRootDir"])
        self.info: dict[str, Any] = {}

    # low-level helpers: the SDK has no checkpoint calls
    def checkpoint(self, cid: str, name: str, exit_: bool) -> None:
        res = self.api._post_json(self.api._url("/containers/{0}/checkpoints", cid),
                                  data={"CheckpointID": name, "Exit": exit_})
        self.api._raise_for_status(res)

    def delete_checkpoint(self, cid: str, name: str) -> None:
        with contextlib.suppress(Exception):
            self.api._raise_for_status(self.api._delete(self.api._url("/containers/{0}/checkpoints/{1}", cid, name)))

    def start_from_checkpoint(self, cid: str, name: str, m: Measure) -> None:
        """Start from a checkpoint; the known 'already exists' race is retried (the time counts) and logged."""
        for attempt in range(START_RETRIES + 1):
            res = self.api._post(self.api._url("/containers/{0}/start", cid), params={"checkpoint": name})
            try:
                self.api._raise_for_status(res)
                return
            except docker.errors.APIError as e:
                if "already exists" not in str(e) or attempt == START_RETRIES:
                    raise
                m.retries += 1
                msg = str(e.explanation or e)
                if msg not in m.retry_errors and len(m.retry_errors) < 3:
                    m.retry_errors.append(msg)
                time.sleep(0.05 * 2**attempt)

    def place_checkpoint(self, src: str, dst: str, name: str) -> None:
        """Copy a checkpoint into another container's own folder: Docker refuses custom dirs on start.

        Each copy gets a nonce file (CRIU ignores it) so that its content digest is unique: Docker uploads
        the checkpoint into containerd's content store on start, and identical copies started close together
        collide there with "content ... already exists" (moby/moby#42900), which makes parallel forks fail.
        """
        target = self.root / "containers" / dst / "checkpoints" / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(self.root / "containers" / src / "checkpoints" / name, target, symlinks=True)
        (target / "bench-nonce").write_text(dst)

    def running(self, cid: str) -> bool:
        return bool(self.api.inspect_container(cid)["State"]["Running"])

    def create(self, image: str, command: list[str]) -> str:
        host_config = self.api.create_host_config(network_mode="none", nano_cpus=int(CPUS * 1e9), mem_limit=MEMORY)
        cid: str = self.api.create_container(image, command=command, host_config=host_config,
                                             labels=self.cleanup.labels)["Id"]
        self.cleanup.containers.append(cid)
        return cid

    def run(self, command: list[str]) -> DockerContainer:
        c = self.client.containers.run(IMAGE, command, detach=True, network_mode="none", nano_cpus=int(CPUS * 1e9),
                                       mem_limit=MEMORY, labels=self.cleanup.labels)
        self.cleanup.containers.append(c.id)
        return c

    def commit(self, cid: str) -> str:
        res = self.api.commit(cid, conf={"Labels": self.cleanup.labels})
        iid: str = res["Id"]
        self.cleanup.images.append(iid)
        return iid

    def exec_ok(self, c: DockerContainer, cmd: str | list[str]) -> str:
        code, out = c.exec_run(cmd)
        if code != 0:
            raise RuntimeError(f"docker exec {cmd!r} exited {code}: {out.decode(errors='replace')[-500:]}")
        return str(out.decode(errors="replace"))

    # the benchmarks
    def run_all(self) -> None:
        steps: list[tuple[str, Callable[[], None]]] = [
            ("run", self.bench_run), ("exec", self.bench_exec), ("repo", self.bench_repo),
            ("memory", self.bench_memory),
        ]
        for name, fn in steps:
            console.log(f"docker: {name}")
            fn()

    def bench_run(self) -> None:
        m = self.results["create"]
        m.note = "containers.run(detach=True) of 'sleep infinity' until State.Running"
        with recording(m, "docker run"):
            self.cleanup.remove_container(self.client, self.run(["sleep", "infinity"]).id)  # warm-up
            for _ in range(self.runs):
                with Timer() as t:
                    c = self.run(["sleep", "infinity"])
                    wait_until(functools.partial(self.running, c.id), 30, "docker run", every=0.001)
                m.samples.append(t.s)
                self.cleanup.remove_container(self.client, c.id)

    def bench_exec(self) -> None:
        m = self.results["exec"]
        with recording(m, "docker exec"):
            c = self.run(["sleep", "infinity"])
            self.exec_ok(c, "true")
            for _ in range(self.runs):
                with Timer() as t:
                    self.exec_ok(c, "true")
                m.samples.append(t.s)
            self.cleanup.remove_container(self.client, c.id)

    def bench_repo(self) -> None:
        m = self.results["fs_snapshot"]
        m.note = "docker commit (pauses the container) of the container with the git repo and edits"
        repo: DockerContainer | None = None
        with recording(m, "docker repo setup"):
            repo = self.run(["sleep", "infinity"])
            self.exec_ok(repo, ["sh", "-c", REPO_SETUP])
            self.info["repo_files"] = int(self.exec_ok(repo, ["sh", "-c", "cd /testbed && git ls-files | wc -l"]))
        if repo is None or m.error:
            return
        with recording(m, "docker commit"):
            for i in range(self.runs):
                self.exec_ok(repo, ["sh", "-c", REPO_EDIT.format(n=i)])
                with Timer() as t:
                    iid = self.commit(repo.id)
                m.samples.append(t.s)
                self.cleanup.remove_image(self.client, iid)
        if self.fork_source == "repo":
            self.bench_fork(repo.id, ["sleep", "infinity"], check="cd /testbed && git status --porcelain | grep -q new_0.py")
        self.cleanup.remove_container(self.client, repo.id)

    def fork_child(self, src: str, image: str, command: list[str], name: str, m: Measure, phases: bool) -> str:
        with Timer() as t_create:
            cid = self.create(image, command)
        with Timer() as t_copy:
            self.place_checkpoint(src, cid, name)
        with Timer() as t_start:
            self.start_from_checkpoint(cid, name, m)
            wait_until(lambda: self.running(cid), 60, "container restored from checkpoint", every=0.002)
        if phases:
            m.add_extra("create", t_create.s)
            m.add_extra("copy_checkpoint", t_copy.s)
            m.add_extra("start_checkpoint", t_start.s)
        return cid

    def bench_fork(self, src: str, command: list[str], check: str) -> None:
        m1, me, m8 = self.results["fork1"], self.results["fork1_exec"], self.results["fork8"]
        m1.note = (f"source: the {self.fork_source} container; checkpoint (leave running) + commit + create from "
                   "the committed image + copy the checkpoint into it + start --checkpoint, until running; "
                   "extra: the phases; each copy gets a nonce file against moby#42900 ('content already exists' "
                   "when identical checkpoints are started close together); a start still failing that way is "
                   "retried up to "
                   f"{START_RETRIES} times, the retries counting in the time and listed under 'retries'")
        m8.note = "one checkpoint + one commit, then 8 x (create + copy + start --checkpoint) in 8 threads"
        with recording(m1, "docker fork(1)"):
            for i in range(self.slow_runs):
                name = f"bf1-{i}-{uuid.uuid4().hex[:6]}"
                t0 = time.perf_counter()
                self.checkpoint(src, name, exit_=False)
                t1 = time.perf_counter()
                iid = self.commit(src)
                t2 = time.perf_counter()
                cid = self.fork_child(src, iid, command, name, m1, phases=True)
                m1.samples.append(time.perf_counter() - t0)
                m1.add_extra("checkpoint", t1 - t0)
                m1.add_extra("commit", t2 - t1)
                try:
                    child = self.client.containers.get(cid)
                    with Timer() as t:
                        self.exec_ok(child, "true")
                    me.samples.append(t.s)
                    if i == 0:
                        self.exec_ok(child, ["sh", "-c", check])
                except Exception as e:
                    me.error = f"{type(e).__name__}: {e}"
                    raise
                finally:
                    self.cleanup.remove_container(self.client, cid)
                    self.cleanup.remove_image(self.client, iid)
                    self.delete_checkpoint(src, name)
        with recording(m8, "docker fork(8)"):
            for i in range(self.slow_runs):
                name = f"bf8-{i}-{uuid.uuid4().hex[:6]}"
                kids: list[str] = []
                iid = ""
                try:
                    t0 = time.perf_counter()
                    self.checkpoint(src, name, exit_=False)
                    iid = self.commit(src)
                    with ThreadPoolExecutor(max_workers=8) as pool:
                        futures = [pool.submit(self.fork_child, src, iid, command, name, m8, False) for _ in range(8)]
                    for f in futures:
                        with contextlib.suppress(Exception):
                            kids.append(f.result())
                    for f in futures:
                        f.result()  # re-raise the first failure
                    m8.samples.append(time.perf_counter() - t0)
                finally:
                    for cid in kids:
                        self.cleanup.remove_container(self.client, cid)
                    # children whose start failed are still listed in cleanup.containers: swept at the end
                    if iid:
                        for cid in list(self.cleanup.containers):
                            with contextlib.suppress(Exception):
                                if self.api.inspect_container(cid)["Image"] == iid:
                                    self.cleanup.remove_container(self.client, cid)
                        self.cleanup.remove_image(self.client, iid)
                    self.delete_checkpoint(src, name)

    def bench_memory(self) -> None:
        m = self.results["mem_snapshot"]
        m.note = f"POST /containers/{{id}}/checkpoints Exit=false, the {MEM_MB} MB python process is PID 1"
        mem: DockerContainer | None = None
        with recording(m, "docker 100 MB process"):
            mem = self.run(["python3", "-c", MEM_CODE])

            def rss_kb() -> int:
                assert mem is not None
                out = self.exec_ok(mem, ["sh", "-c", "grep VmRSS /proc/1/status"])
                return int(out.split()[1])

            wait_until(lambda: rss_kb() >= MEM_MB * 1000, 60, "100 MB process", every=0.1)
            self.info["mem_rss_kb"] = rss_kb()
        if mem is None or m.error:
            for op in ("pause", "resume", "restore"):
                self.results[op].error = f"100 MB process setup failed: {m.error}"
            return
        with recording(m, "docker checkpoint create"):
            for i in range(self.slow_runs):
                name = f"bm-{i}-{uuid.uuid4().hex[:6]}"
                with Timer() as t:
                    self.checkpoint(mem.id, name, exit_=False)
                m.samples.append(t.s)
                self.delete_checkpoint(mem.id, name)
        if self.fork_source == "mem":
            self.bench_fork(mem.id, ["python3", "-c", MEM_CODE], check="test -d /proc/1")
        self.bench_pause_resume(mem.id)
        self.bench_restore(mem.id)
        self.cleanup.remove_container(self.client, mem.id)

    def bench_pause_resume(self, cid: str) -> None:
        mp, mr = self.results["pause"], self.results["resume"]
        mp.note = "checkpoint with Exit=true (frees the memory like agentenv's pause), until stopped"
        mr.note = "POST /containers/{id}/start?checkpoint=NAME on the same container, until running"
        with recording(mp, "docker pause (checkpoint --exit) / resume (start --checkpoint)"):
            for i in range(self.slow_runs):
                name = f"bp-{i}-{uuid.uuid4().hex[:6]}"
                with Timer() as t:
                    self.checkpoint(cid, name, exit_=True)
                    wait_until(lambda: not self.running(cid), 30, "container stopped by checkpoint", every=0.002)
                mp.samples.append(t.s)
                try:
                    with Timer() as t2:
                        self.start_from_checkpoint(cid, name, mr)
                        wait_until(lambda: self.running(cid), 60, "container restored", every=0.002)
                except Exception as e:
                    mr.error = f"{type(e).__name__}: {e}"
                    raise
                mr.samples.append(t2.s)
                self.delete_checkpoint(cid, name)

    def bench_restore(self, src: str) -> None:
        m = self.results["restore"]
        m.note = ("create a new container from the same image + copy the checkpoint into it + start --checkpoint, "
                  "until running (warm SDK client, no interpreter start)")
        with recording(m, "docker restore into a new container"):
            name = f"br-{uuid.uuid4().hex[:6]}"
            self.checkpoint(src, name, exit_=False)
            try:
                for _ in range(self.slow_runs):
                    with Timer() as t:
                        cid = self.fork_child(src, IMAGE, ["python3", "-c", MEM_CODE], name, m, phases=True)
                    m.samples.append(t.s)
                    self.cleanup.remove_container(self.client, cid)
            finally:
                self.delete_checkpoint(src, name)


# --- report ----------------------------------------------------------------------------------------------


def machine_info(client: docker.DockerClient | None) -> dict[str, Any]:
    def cmd(*args: str) -> str | None:
        try:
            r = subprocess.run(args, capture_output=True, text=True, timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"error: {e}"
        return (r.stdout or r.stderr).strip() or None

    cpu_model = None
    with contextlib.suppress(OSError):
        cpu_model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                          if ln.startswith("model name")), None)
    mem_total = None
    with contextlib.suppress(OSError, StopIteration):
        mem_total = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/meminfo").read_text().splitlines()
                         if ln.startswith("MemTotal"))
    info: dict[str, Any] = {
        "nproc": os.cpu_count(), "cpu_model": cpu_model, "mem_total": mem_total, "kernel": platform.release(),
        "os": cmd("sh", "-c", ". /etc/os-release && echo $PRETTY_NAME"), "python": platform.python_version(),
        "agentenv": agentenv.__version__, "criu": cmd("criu", "--version"), "runc": cmd("runc", "--version"),
        "git_commit": cmd("git", "-C", str(ROOT), "rev-parse", "HEAD"),
        "loadavg_start": os.getloadavg(),
    }
    if client is not None:
        try:
            v = client.version()
            d = client.info()
            info["docker"] = {"version": v.get("Version"), "api": v.get("ApiVersion"),
                              "experimental": v.get("Experimental"), "storage_driver": d.get("Driver"),
                              "cgroup_version": d.get("CgroupVersion"), "default_runtime": d.get("DefaultRuntime")}
        except Exception as e:  # noqa: BLE001
            info["docker"] = f"error: {e}"
    return info


def fmt(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1e3:.1f}" if x < 10 else f"{x * 1e3:.0f}"


def print_table(a: dict[str, Measure], d: dict[str, Measure] | None, runs: int, docker_runs: int) -> list[dict[str, Any]]:
    table = Table(title=f"agentenv vs plain Docker, ms (agentenv n={runs}; Docker n={runs}, checkpoint ops n={docker_runs}; "
                        "speed-up = Docker median / agentenv median)")
    for col, just in (("operation", "left"), ("agentenv med", "right"), ("p90", "right"),
                      ("plain Docker (how)", "left"), ("Docker med", "right"), ("p90", "right"),
                      ("speed-up", "right"), ("target", "right"), ("met", "center")):
        table.add_column(col, justify=just, no_wrap=True)  # type: ignore[arg-type]
    rows = []
    for op, label, docker_how, target in OPERATIONS:
        am = a[op]
        dm = d[op] if d is not None else Measure(note="--no-docker")
        amed, dmed = median(am.samples), median(dm.samples)
        ratio = f"{dmed / amed:.1f}x" if amed and dmed else "-"
        met = None if target is None or amed is None else amed * 1e3 <= target
        met_s = "-" if target is None else ("[red]n/a[/red]" if met is None else
                                            "[green]met[/green]" if met else "[red]missed[/red]")
        a_med = fmt(amed) if am.samples else ("[red]ERR[/red]" if am.error else "-")
        d_med = fmt(dmed) if dm.samples else ("[red]ERR[/red]" if dm.error else "-")
        if dm.retries:
            d_med += f" ({dm.retries}r)"
        table.add_row(label, a_med, fmt(p90(am.samples)), docker_how, d_med, fmt(p90(dm.samples)), ratio,
                      "-" if target is None else f"<= {target:g}", met_s)
        rows.append({"op": op, "label": label, "docker_how": docker_how, "target_ms": target, "met": met,
                     "speedup": round(dmed / amed, 2) if amed and dmed else None})
    console.print(table)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--runs", type=int, default=10, help="runs per agentenv operation (and cheap Docker ones)")
    ap.add_argument("--docker-runs", type=int, default=3, help="runs per Docker checkpoint-based operation")
    ap.add_argument("--quick", action="store_true", help="smoke run: 3 runs each, 1 per Docker checkpoint op")
    ap.add_argument("--no-docker", action="store_true", help="skip the plain Docker side")
    ap.add_argument("--fork-source", choices=("repo", "mem"), default="repo",
                    help="fork the git-repo sandbox (default) or the 100 MB one")
    ap.add_argument("--output", type=Path, default=RESULTS, help=f"JSON results (default {RESULTS})")
    args = ap.parse_args(argv)
    runs = 3 if args.quick else args.runs
    docker_runs = 1 if args.quick else args.docker_runs
    if runs < 1 or docker_runs < 1:
        ap.error("--runs and --docker-runs must be >= 1")

    # SIGTERM must run the finally blocks too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    cleanup = Cleanup(run_id)
    client: docker.DockerClient | None = None
    started = time.time()
    a_bench: AgentenvBench | None = None
    d_bench: DockerBench | None = None
    fatal: str | None = None
    info: dict[str, Any] = {}
    try:
        client = docker.from_env(timeout=300)
        client.ping()
        info = machine_info(client)
        console.log(f"run {run_id}: {runs} agentenv runs, {docker_runs} Docker checkpoint runs, "
                    f"{info['nproc']} CPUs, kernel {info['kernel']}")
        a_bench = AgentenvBench(runs, cleanup, args.fork_source)
        a_bench.run_all()
        if not args.no_docker:
            d_bench = DockerBench(client, runs, docker_runs, cleanup, args.fork_source)
            d_bench.run_all()
    except BaseException as e:
        fatal = f"{type(e).__name__}: {e}"
        console.print(f"[red]benchmark aborted:[/red] {fatal}")
        if not isinstance(e, KeyboardInterrupt | SystemExit):
            console.print(traceback.format_exc(), style="dim", markup=False, highlight=False)
    finally:
        console.log("cleaning up")
        cleanup.all(client)
    if a_bench is None:
        return 1

    a_res = a_bench.results
    d_res = d_bench.results if d_bench is not None else None
    rows = print_table(a_res, d_res, runs, docker_runs)
    errors = {f"{side}.{op}": m.error for side, res in (("agentenv", a_res), ("docker", d_res or {}))
              for op, m in res.items() if m.error}
    for k, v in errors.items():
        console.print(f"[red]error[/red] {k}: {v}", highlight=False)
    for op, m in (d_res or {}).items():
        if m.retries:
            console.print(f"[yellow]docker.{op}[/yellow]: start --checkpoint retried {m.retries}x after "
                          f"moby#42900 ({m.retry_errors[0][:160]}); the retries count in its time", highlight=False)
    if cleanup.errors:
        console.print("[yellow]cleanup problems:[/yellow] " + "; ".join(cleanup.errors), highlight=False)

    out = {
        "run_id": run_id, "started_at": started, "duration_s": round(time.time() - started, 1),
        "config": {"runs": runs, "docker_runs": docker_runs, "docker_cheap_runs": runs, "image": IMAGE, "cpus": CPUS,
                   "memory": MEMORY, "mem_process_mb": MEM_MB, "fork_source": args.fork_source,
                   "quick": args.quick, "no_docker": args.no_docker},
        "machine": {**(info or machine_info(client)), "loadavg_end": os.getloadavg()},
        "summary": rows,
        "agentenv": {op: m.to_json() for op, m in a_res.items()} | {"_info": a_bench.info},
        "docker": ({op: m.to_json() for op, m in d_bench.results.items()} | {"_info": d_bench.info})
        if d_bench else None,
        "errors": errors, "fatal": fatal, "cleanup_errors": cleanup.errors,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=2) + "\n")
    console.log(f"results: {args.output} ({out['duration_s']} s)")
    return 1 if fatal or errors else 0


if __name__ == "__main__":
    sys.exit(main())
