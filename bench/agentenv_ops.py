"""The agentenv side of ``bench.sandbox``: one method per operation of its table (public API only)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any, TypeVar, cast

import agentenv
from agentenv import phases
from agentenv.host import admission
from agentenv.sandbox import warm
from bench.harness import ROOT, Result, Timer, recording
from bench.sandbox_common import (
    BURST,
    CPUS,
    IMAGE,
    LABEL,
    MEM_CODE,
    MEM_MB,
    MEMORY,
    POOL,
    REPO_CHECK,
    REPO_EDIT,
    REPO_SETUP,
    Fixture,
    Side,
    run_burst,
    wait_until,
)

RESTORE_CHILD = (
    "import json, sys, time\n"
    "t0 = time.perf_counter()\n"
    "import agentenv\n"
    "from agentenv import phases\n"
    "t1 = time.perf_counter()\n"
    "with phases.recording() as found:\n"
    f"    sb = agentenv.Sandbox.restore(sys.argv[1], labels={{{LABEL!r}: sys.argv[2]}})\n"
    "t2 = time.perf_counter()\n"
    "print(json.dumps({'import_s': t1 - t0, 'restore_s': t2 - t1, 'sandbox': sb.id,\n"
    "                  'phases': phases.totals(found)}), flush=True)\n"
    "ok = sb.exec('true').ok\n"
    "sb.close()\n"
    "sys.exit(0 if ok else 3)\n"
)


T = TypeVar("T")


class AgentenvSide(Side):
    name = "agentenv"

    def new_sandbox(self) -> agentenv.Sandbox:
        sb = agentenv.Sandbox.create(IMAGE, cpus=CPUS, memory=MEMORY, labels=self.cleanup.labels)
        self.cleanup.sandboxes.append(sb)
        return sb

    # fixtures
    def setup(self, name: str) -> Fixture:
        sb = self.new_sandbox()
        if name == "repo":
            r = sb.exec(REPO_SETUP, timeout=120)
            if not r.ok:
                raise RuntimeError(f"git repo setup failed: {r.stderr or r.stdout}")
            self.info["repo_files"] = int(sb.exec("cd /testbed && git ls-files | wc -l").stdout.strip())
            return Fixture(sb, REPO_CHECK)
        proc = sb.spawn(f'exec python3 -c "{MEM_CODE}"')

        def rss_kb() -> int:
            for line in sb.read_file(f"/proc/{proc.pid}/status").decode().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
            return 0

        wait_until(lambda: "ready" in proc.output() and rss_kb() >= MEM_MB * 1000, 60, "100 MB process")
        self.info["mem_rss_kb"] = rss_kb()
        return Fixture(sb, f"test -d /proc/{proc.pid}", proc=proc)

    def teardown(self, fx: Fixture) -> None:
        self.cleanup.close_sandbox(fx.handle)

    # operations
    def create(self, runs: int, name: str = "create", network: bool = False) -> None:
        m = self.result(name)
        m.note = "Sandbox.create() returns once the in-sandbox agent answers (exec-ready); extra: + first exec"
        if network:
            m.note += "; with network=True (its own namespace, a veth on the isolated bridge, NAT, nftables rules)"
        with recording(m, f"agentenv {name}"):
            self.cleanup.close_sandbox(self.new_sandbox())  # warm-up: image lookup, page cache
            for _ in range(runs):
                with Timer() as t:
                    sb = agentenv.Sandbox.create(IMAGE, cpus=CPUS, memory=MEMORY, labels=self.cleanup.labels,
                                                 network=network)
                self.cleanup.sandboxes.append(sb)
                with Timer() as t2:
                    r = sb.exec("true")
                if not r.ok:
                    raise RuntimeError(f"first exec failed: {r}")
                m.add(t.s)
                m.add_extra("create_plus_first_exec", t.s + t2.s)
                self.cleanup.close_sandbox(sb)

    def create_net(self, runs: int) -> None:
        self.create(runs, "create_net", network=True)

    def exec(self, runs: int) -> None:
        m = self.result("exec")
        with recording(m, "agentenv exec"):
            sb = self.new_sandbox()
            sb.exec("true")
            for _ in range(runs):
                with Timer() as t:
                    r = sb.exec("true")
                if not r.ok:
                    raise RuntimeError(f"exec failed: {r}")
                m.add(t.s)
            self.cleanup.close_sandbox(sb)

    def fs_snapshot(self, runs: int) -> None:
        m = self.result("fs_snapshot")
        with recording(m, "agentenv filesystem snapshot"):
            repo = self.fixture("repo").handle
            for i in range(runs):
                r = repo.exec(REPO_EDIT.format(n=i))
                if not r.ok:
                    raise RuntimeError(f"edit failed: {r.stderr}")
                snap = self.timed(m, lambda: repo.snapshot(memory=False, labels=self.cleanup.labels))
                self.cleanup.snapshots.append(snap)
                if i == 0:
                    self.info["fs_snapshot_bytes"] = snap.size_bytes
                self.cleanup.delete_snapshot(snap)

    def burst(self, runs: int) -> None:
        self._burst("burst", None)

    def burst_unbounded(self, runs: int) -> None:
        self._burst("burst_unbounded", BURST)

    def burst_warm(self, runs: int) -> None:
        def fill() -> None:
            warm.configure(IMAGE, BURST, cpus=CPUS, memory=MEMORY)
            if not warm.wait_full(600):
                raise RuntimeError(f"the warm pool did not fill: {warm.ready()} of {BURST} started")

        try:
            self._burst("burst_warm", None, fill)
        finally:
            warm.drain()

    def _burst(self, op: str, bound: int | None, prepare: Callable[[], None] | None = None) -> None:
        """BURST creates at once, each then exec('true'), with the admission bound ``bound`` (None: default),
        after ``prepare()`` (e.g. filling a warm pool)."""
        m = self.result(op)
        admission.set_limit(bound)
        m.note = (f"{BURST} threads at once: Sandbox.create() + exec('true'); sample = release -> answer; "
                  f"at most {admission.limit()} starting at once" + ("; from a warm pool" if prepare else ""))

        def one() -> None:
            sb = agentenv.Sandbox.create(IMAGE, cpus=CPUS, memory=MEMORY, labels=self.cleanup.labels)
            self.cleanup.sandboxes.append(sb)
            if not sb.exec("true").ok:
                raise RuntimeError(f"first exec in {sb.id} failed")

        try:
            with recording(m, f"agentenv {op}"):
                self.cleanup.close_sandbox(self.new_sandbox())  # warm-up
                if prepare is not None:
                    prepare()
                with phases.recording() as found:
                    run_burst(m, BURST, one)
                for name, secs in phases.totals(found).items():
                    m.fields[f"phase_total_ms:{name}"] = round(secs * 1e3, 1)
                m.fields["peak_starting"] = admission.peak()
        finally:
            admission.set_limit(None)
            for sb in list(self.cleanup.sandboxes):
                self.cleanup.close_sandbox(sb)

    def timed(self, m: Result, fn: Callable[[], T]) -> T:
        """``fn()`` as one sample of ``m``, with where its time went (``agentenv.phases``) as extras ``phase:<name>``
        (each summed over its occurrences: a fork of 8 counts its 8 children's)."""
        with phases.recording() as found, Timer() as t:
            out = fn()
        m.add(t.s)
        for name, secs in phases.totals(found).items():
            m.add_extra(f"phase:{name}", secs)
        return out

    def forks(self, op: str, n: int, memory: bool, runs: int, pool: int = 0) -> None:
        """fork(n) of the fork fixture, ``runs`` times; for n = 1 also the first exec in the child (``<op>_exec``).
        With ``pool``, a warm pool of that many sandboxes made like the fixture, full before each fork, and a fixture
        of its own taken from the pool."""
        m = self.result(op)
        what = "files and processes" if memory else "files only, fresh processes"
        m.note = (f"source: the {self.fork_source} sandbox; fork({n}, memory={memory}) ({what}) returns children "
                  "whose agent answered; extra: where the time went, summed over the children"
                  + (f"; children from a warm pool of {pool}, refilled between runs (untimed)" if pool else ""))
        with recording(m, f"agentenv {op}"), contextlib.ExitStack() as stack:
            if pool:  # the source taken from the pool: its fork family (one uid range), whose sandboxes alone
                warm.configure(IMAGE, pool, cpus=CPUS, memory=MEMORY)  # can be its children (agentenv.host.userns)
                stack.callback(warm.drain)
                if not warm.wait_full(600):
                    raise RuntimeError(f"the warm pool did not fill: {warm.ready()} of {pool} started")
                fx = self.setup(self.fork_source)
                stack.callback(self.teardown, fx)
            else:
                fx = self.fixture("fork")
            for i in range(runs):
                if pool and not warm.wait_full(600):
                    raise RuntimeError(f"the warm pool did not fill: {warm.ready()} of {pool} started")
                kids = self.timed(m, lambda: cast("list[agentenv.Sandbox]", fx.handle.fork(n, memory=memory)))
                self.cleanup.sandboxes.extend(kids)
                try:
                    if n == 1:
                        me = self.result(f"{op}_exec")
                        with Timer() as t2:
                            r = kids[0].exec("true")
                        if not r.ok:
                            raise RuntimeError(f"exec in child failed: {r}")
                        me.add(t2.s)
                    if i == 0:
                        check = fx.check if memory or self.fork_source == "repo" else "true"  # no process in an fs fork
                        r = kids[-1].exec(check)
                        if not r.ok:
                            raise RuntimeError(f"forked child lacks the parent's state ({check!r}): {r}")
                finally:
                    for k in kids:
                        self.cleanup.close_sandbox(k)
        if m.error and n == 1:
            self.result(f"{op}_exec").fail(m.error)

    def fork1(self, runs: int) -> None:
        """fork(1) with memory, and the first exec in the child (``fork1_exec``)."""
        self.forks("fork1", 1, True, runs)

    def fork8(self, runs: int) -> None:
        self.forks("fork8", 8, True, runs)

    def fork1_fs(self, runs: int) -> None:
        """fork(1, memory=False): the files only, and the first exec in the child (``fork1_fs_exec``)."""
        self.forks("fork1_fs", 1, False, runs)

    def fork8_fs(self, runs: int) -> None:
        self.forks("fork8_fs", 8, False, runs)

    def fork1_fs_pool(self, runs: int) -> None:
        self.forks("fork1_fs_pool", 1, False, runs, pool=POOL)

    def fork8_fs_pool(self, runs: int) -> None:
        self.forks("fork8_fs_pool", 8, False, runs, pool=POOL)

    def fork32_fs(self, runs: int) -> None:
        self.forks("fork32_fs", 32, False, runs)

    def fork32_fs_pool(self, runs: int) -> None:
        self.forks("fork32_fs_pool", 32, False, runs, pool=32)

    def mem_snapshot(self, runs: int) -> None:
        m = self.result("mem_snapshot")
        with recording(m, "agentenv memory snapshot"):
            mem = self.fixture("mem").handle
            for i in range(runs):
                snap = self.timed(m, lambda: mem.snapshot(memory=True, labels=self.cleanup.labels))
                self.cleanup.snapshots.append(snap)
                if i == 0:
                    self.info["mem_snapshot_bytes"] = snap.size_bytes
                self.cleanup.delete_snapshot(snap)

    def pause(self, runs: int) -> None:
        """pause(), then resume() (``resume``), of the 100 MB sandbox."""
        mp, mr = self.result("pause"), self.result("resume")
        with recording(mp, "agentenv pause/resume"):
            fx = self.fixture("mem")
            sb, proc = fx.handle, fx.proc
            for _ in range(runs):
                self.timed(mp, sb.pause)
                try:
                    self.timed(mr, sb.resume)
                except Exception as e:
                    mr.fail(e)
                    raise
            if proc.exit_code is not None:
                raise RuntimeError(f"the 100 MB process died across pause/resume (exit {proc.exit_code})")
            status = sb.read_file(f"/proc/{proc.pid}/status").decode()
            self.info["mem_rss_after_resume"] = next(
                (ln.split(":", 1)[1].strip() for ln in status.splitlines() if ln.startswith("VmRSS:")), None)

    def restore(self, runs: int) -> None:
        """Sandbox.restore in a fresh interpreter: timed inside it (``restore``) and from outside (``restore_wall``)."""
        m, mw = self.result("restore"), self.result("restore_wall")
        m.note = (f"Sandbox.restore(id) of a memory snapshot of the {MEM_MB} MB sandbox, timed inside a fresh "
                  "python process (after 'import agentenv'); extra: import time")
        mw.note = "from spawning the interpreter to its report (interpreter start + import + restore)"
        with recording(m, "agentenv restore"):
            sb = self.fixture("mem").handle
            snap = sb.snapshot(memory=True, labels=self.cleanup.labels)
            self.cleanup.snapshots.append(snap)
            for _ in range(runs):
                with Timer() as tw:
                    p = subprocess.Popen([sys.executable, "-c", RESTORE_CHILD, snap.id, self.cleanup.run_id],
                                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                    assert p.stdout is not None
                    line = p.stdout.readline()
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
                        self.cleanup.close_sandbox(agentenv.Sandbox.get(report["sandbox"]))
                if report is None or p.returncode != 0:
                    raise RuntimeError(f"restore child exited {p.returncode}: {(err or line).strip()[-800:]}")
                m.add(report["restore_s"])
                m.add_extra("import_agentenv", report["import_s"])
                for name, secs in report["phases"].items():
                    m.add_extra(f"phase:{name}", secs)
                mw.add(tw.s)
            self.cleanup.delete_snapshot(snap)
        if m.error:
            mw.fail(m.error)
