"""A fake Backend for the envs' unit tests: sandboxes whose files are a dict and whose exec knows a few commands.

It keeps what the envs need of the contract in ``agentenv.api`` (create / restore / get / list, exec, files,
snapshot, fork, close, the deadline: ``ttl`` as made and each ``set_ttl``) and counts what is open, so a test can
check that an env closes what it made.
"""

from __future__ import annotations

import itertools
import posixpath
import re

from agentenv.api import ExecResult

HEAD = "0" * 40  # what `git rev-parse HEAD` answers (the base commit of fake tasks)


def result(stdout: str = "", exit_code: int = 0, timed_out: bool = False) -> ExecResult:
    return ExecResult(exit_code=exit_code, stdout=stdout, stderr="", duration=0.0, timed_out=timed_out)


class FakeSnapshot:
    def __init__(self, backend: FakeBackend, files: dict[str, str], labels: dict[str, str]) -> None:
        self.backend, self.files, self.labels = backend, dict(files), dict(labels)
        self.id = f"snap-{next(backend.ids)}"
        self.parent_id, self.created_at, self.size_bytes, self.has_memory, self.sandbox_id = None, 0.0, 0, False, None
        backend.snapshots[self.id] = self

    def delete(self, background: bool = False) -> None:
        self.backend.snapshots.pop(self.id, None)


class FakeSandbox:
    """Files in a dict; exec understands the few commands the tools send besides bash, and a few for tests."""

    def __init__(self, backend: FakeBackend | None = None, image: str = "fake", files: dict[str, str] | None = None,
                 links: dict[str, str] | None = None, labels: dict[str, str] | None = None,
                 ttl: float | None = None) -> None:
        self.backend, self.image, self.labels = backend, image, dict(labels or {})
        self.ttl, self.ttl_moves = ttl, []  # the deadline it was made with; each set_ttl since
        self.files, self.links, self.commands = dict(files or {}), dict(links or {}), []
        self.id = f"sb-{next(backend.ids)}" if backend else "sb"
        self.state = "running"
        if backend:
            backend.sandboxes[self.id] = self

    def _kind(self, p: str) -> str:
        if p in self.files:
            return "file"
        return "dir" if any(f.startswith(p.rstrip("/") + "/") for f in self.files) else "missing"

    def exec(self, command, *, timeout=None, cwd=None, env=None, on_output=None):
        assert self.state == "running", f"exec in a {self.state} sandbox"
        self.commands.append(command)
        m = re.match(r"realpath -m -- (\S+);", command)
        if m:
            p = m.group(1).strip("'")
            real = posixpath.normpath(self.links.get(p, p))
            return result(f"{real}\n{self._kind(real)}\n")
        if command.startswith("stat -c %a"):
            return result("755\n")
        if command == "git rev-parse HEAD":
            return result(HEAD + "\n")
        if "sleep" in command:
            return result("partial\n", exit_code=-9, timed_out=True)
        if "printf" in command:
            return result("hello\n\xff", exit_code=3)
        return result("x" * 50_000 if "yes" in command else "ran\n", exit_code=3 if "false" in command else 0)

    def read_file(self, path):
        return self.files[path].encode()

    def write_file(self, path, data, mode=0o644):
        self.files[path] = data if isinstance(data, str) else data.decode()
        self.mode = mode

    def snapshot(self, memory=False, *, labels=None):
        assert self.backend is not None
        return FakeSnapshot(self.backend, self.files, labels or {})

    def fork(self, n=1, *, memory=False, ttl=None):
        assert self.backend is not None
        return [type(self)(self.backend, self.image, self.files, self.links, self.labels, ttl) for _ in range(n)]

    def set_ttl(self, ttl):
        self.ttl_moves.append(ttl)

    def close(self):
        self.state = "closed"
        if self.backend:
            self.backend.sandboxes.pop(self.id, None)


class _Sandboxes:
    kind: type[FakeSandbox] = FakeSandbox

    def __init__(self, backend: FakeBackend) -> None:
        self.backend = backend

    def create(self, image="agentenv/base", *, labels=None, **kwargs):
        self.backend.created.append((image, kwargs))
        return self.kind(self.backend, image, labels=labels, ttl=kwargs.get("ttl"))

    def restore(self, snapshot, *, labels=None, ttl=None):
        snap = self.backend.snapshots[snapshot if isinstance(snapshot, str) else snapshot.id]
        return self.kind(self.backend, "restored", snap.files, labels=labels, ttl=ttl)

    def get(self, sandbox_id):
        return self.backend.sandboxes[sandbox_id]

    def list(self):
        return list(self.backend.sandboxes.values())


class _Snapshots:
    def __init__(self, backend: FakeBackend) -> None:
        self.backend = backend

    def get(self, snapshot_id):
        return self.backend.snapshots[snapshot_id]

    def list(self):
        return list(self.backend.snapshots.values())


class FakeBackend:
    """Where fake sandboxes live; ``sandboxes`` holds the open ones."""

    def __init__(self) -> None:
        self.ids = itertools.count()
        self.sandboxes: dict[str, FakeSandbox] = {}
        self.snapshots: dict[str, FakeSnapshot] = {}
        self.created: list[tuple[str, dict]] = []
        self.Sandbox = _Sandboxes(self)
        self.Snapshot = _Snapshots(self)
