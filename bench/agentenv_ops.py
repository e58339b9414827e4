"""The agentenv side of ``bench.sandbox``: one method per operation of its table (public API only)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from typing import Any, cast

import agentenv
from bench.harness import ROOT, Timer, recording
from bench.sandbox_common import (
    CPUS,
    IMAGE,
    LABEL,
    MEM_CODE,
    MEM_MB,
    MEMORY,
    REPO_CHECK,
    REPO_EDIT,
    REPO_SETUP,
    Fixture,
    Side,
    wait_until,
)

RESTORE_CHILD = (
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
    def create(self, runs: int) -> None:
        m = self.result("create")
        m.note = "Sandbox.create() returns once the in-sandbox agent answers (exec-ready); extra: + first exec"
        with recording(m, "agentenv create"):
            self.cleanup.close_sandbox(self.new_sandbox())  # warm-up: image lookup, page cache
            for _ in range(runs):
                with Timer() as t:
                    sb = agentenv.Sandbox.create(IMAGE, cpus=CPUS, memory=MEMORY, labels=self.cleanup.labels)
                self.cleanup.sandboxes.append(sb)
                with Timer() as t2:
                    r = sb.exec("true")
                if not r.ok:
                    raise RuntimeError(f"first exec failed: {r}")
                m.add(t.s)
                m.add_extra("create_plus_first_exec", t.s + t2.s)
                self.cleanup.close_sandbox(sb)

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
                with Timer() as t:
                    snap = repo.snapshot(memory=False, labels=self.cleanup.labels)
                self.cleanup.snapshots.append(snap)
                m.add(t.s)
                if i == 0:
                    self.info["fs_snapshot_bytes"] = snap.size_bytes
                self.cleanup.delete_snapshot(snap)

    def fork1(self, runs: int) -> None:
        """fork(1), and the first exec in the child (``fork1_exec``)."""
        m1, me = self.result("fork1"), self.result("fork1_exec")
        m1.note = f"source: the {self.fork_source} sandbox; fork() returns children whose agent answered"
        with recording(m1, "agentenv fork(1)"):
            fx = self.fixture("fork")
            for i in range(runs):
                with Timer() as t:
                    kids = cast("list[agentenv.Sandbox]", fx.handle.fork(1))
                self.cleanup.sandboxes.extend(kids)
                m1.add(t.s)
                try:
                    with Timer() as t2:
                        r = kids[0].exec("true")
                    if not r.ok:
                        raise RuntimeError(f"exec in child failed: {r}")
                    me.add(t2.s)
                    if i == 0:
                        r = kids[0].exec(fx.check)
                        if not r.ok:
                            raise RuntimeError(f"forked child lacks the parent's state ({fx.check!r}): {r}")
                except Exception as e:
                    me.fail(e)
                    raise
                finally:
                    for k in kids:
                        self.cleanup.close_sandbox(k)

    def fork8(self, runs: int) -> None:
        m8 = self.result("fork8")
        m8.note = f"source: the {self.fork_source} sandbox; fork() returns children whose agent answered"
        with recording(m8, "agentenv fork(8)"):
            src = self.fixture("fork").handle
            for _ in range(runs):
                with Timer() as t:
                    kids = cast("list[agentenv.Sandbox]", src.fork(8))
                self.cleanup.sandboxes.extend(kids)
                m8.add(t.s)
                for k in kids:
                    self.cleanup.close_sandbox(k)

    def mem_snapshot(self, runs: int) -> None:
        m = self.result("mem_snapshot")
        with recording(m, "agentenv memory snapshot"):
            mem = self.fixture("mem").handle
            for i in range(runs):
                with Timer() as t:
                    snap = mem.snapshot(memory=True, labels=self.cleanup.labels)
                self.cleanup.snapshots.append(snap)
                m.add(t.s)
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
                with Timer() as t:
                    sb.pause()
                mp.add(t.s)
                try:
                    with Timer() as t2:
                        sb.resume()
                except Exception as e:
                    mr.fail(e)
                    raise
                mr.add(t2.s)
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
                mw.add(tw.s)
            self.cleanup.delete_snapshot(snap)
        if m.error:
            mw.fail(m.error)
