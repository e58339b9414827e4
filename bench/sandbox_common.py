"""What both sides of ``bench.sandbox`` share: the workloads, the fixtures they set up, and the cleanup."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import docker
import docker.errors

import agentenv
from bench.harness import Result, console, percentile

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
printf 'print(0)\\n' > src/new_0.py
"""  # new_0.py: an edit not committed, which every fork must carry (REPO_CHECK), whichever operations run
# a few edits, different each run: two modified files, one new file
REPO_EDIT = """set -e
cd /testbed
printf '\\ndef g_{n}():\\n    return {n}\\n' >> src/mod_1.py
sed -i 's/return x + 2$/return x + 2 + {n} - {n}/' src/mod_2.py
printf 'print({n})\\n' > src/new_{n}.py
"""
REPO_CHECK = "cd /testbed && git status --porcelain | grep -q new_0.py"  # a fork carries the edits


def wait_until(cond: Callable[[], bool], timeout: float, what: str, every: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not reached after {timeout} s")
        time.sleep(every)


@dataclass
class Fixture:
    """A long-lived sandbox / container several operations measure: the git repo, or the 100 MB process."""

    handle: Any  # agentenv: the Sandbox; Docker: the container id
    check: str  # shell test that a fork of it carries its state
    command: list[str] = field(default_factory=list)  # Docker: the container's command (fork children reuse it)
    proc: Any = None  # agentenv: the 100 MB Process


class FixtureError(RuntimeError):
    pass


class Side:
    """One side of the comparison: its results, and fixtures made on first use and released when done."""

    name = "side"

    def __init__(self, cleanup: Cleanup, fork_source: str) -> None:
        self.cleanup, self.fork_source = cleanup, fork_source
        self.results: dict[str, Result] = {}
        self.info: dict[str, Any] = {}
        self.fixtures: dict[str, Fixture] = {}
        self.fixture_errors: dict[str, str] = {}

    def result(self, op: str) -> Result:
        return self.results.setdefault(op, Result())

    def fixture(self, name: str) -> Fixture:
        """The "repo" or "mem" fixture ("fork" is the one --fork-source names), set up on first use."""
        name = self.fork_source if name == "fork" else name
        if name in self.fixture_errors:
            raise FixtureError(f"{name} setup failed: {self.fixture_errors[name]}")
        if name not in self.fixtures:
            console.log(f"{self.name}: setting up the {name} fixture")
            try:
                self.fixtures[name] = self.setup(name)
            except Exception as e:
                self.fixture_errors[name] = f"{type(e).__name__}: {e}"
                raise FixtureError(f"{name} setup failed: {self.fixture_errors[name]}") from e
        return self.fixtures[name]

    def release(self, keep: set[str]) -> None:
        """Tear down the fixtures no later operation uses (names as in ``fixture``)."""
        keep = {self.fork_source if k == "fork" else k for k in keep}
        for name in [n for n in self.fixtures if n not in keep]:
            self.teardown(self.fixtures.pop(name))

    def setup(self, name: str) -> Fixture:
        raise NotImplementedError

    def teardown(self, fx: Fixture) -> None:
        raise NotImplementedError


class Cleanup:
    """Everything this run creates, removed at the end (and swept by label for what slipped through)."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.sandboxes: list[agentenv.Sandbox] = []
        self.snapshots: list[agentenv.Snapshot] = []
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

    def close_sandbox(self, sb: agentenv.Sandbox) -> None:
        self._try(f"close {sb.id}", sb.close)
        with contextlib.suppress(ValueError):
            self.sandboxes.remove(sb)

    def delete_snapshot(self, snap: agentenv.Snapshot) -> None:
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
            for sb in agentenv.Sandbox.list():
                if sb.labels.get(LABEL) == self.run_id:
                    self._try(f"close {sb.id}", sb.close)
        with contextlib.suppress(Exception):
            for snap in agentenv.Snapshot.list():
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


BURST = 64  # sandboxes asked for at once by the burst rows
POOL = 8  # sandboxes in the warm pool of the pooled fork rows
BURST_P99_TARGET_MS = 1000.0


def run_burst(m: Result, n: int, start_one: Callable[[], object]) -> None:
    """Call ``start_one`` (make a sandbox and have its first command answered) from ``n`` threads released at
    once; each success is a sample of ``m`` from the release to its answer, each failure is recorded."""
    gate = threading.Barrier(n + 1)
    t0 = [0.0]
    errors: list[str] = []

    def one() -> None:
        gate.wait()
        try:
            start_one()
        except Exception as e:  # noqa: BLE001 - counted and reported, the burst goes on
            errors.append(f"{type(e).__name__}: {e}")
            return
        m.add(time.perf_counter() - t0[0])

    threads = [threading.Thread(target=one, name=f"burst-{i}") for i in range(n)]
    for t in threads:
        t.start()
    t0[0] = time.perf_counter()
    gate.wait()
    for t in threads:
        t.join()
    p99 = percentile(m.samples, 0.99)
    m.fields.update(burst=n, failed=len(errors), p99_target_ms=BURST_P99_TARGET_MS,
                    p99_met=None if p99 is None else p99 * 1e3 <= BURST_P99_TARGET_MS)
    if errors:
        m.fail(f"{len(errors)} of {n} failed, e.g. {errors[0]}")
