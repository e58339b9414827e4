"""The grader's guard in the test process: what it is told, and reading what it saw.

The tests run under ``envs/grading/sandbox_guard.py`` (written into the grading folder from the host, outside
/testbed, so nothing of the agent's patch decides it), which installs a PEP 578 audit hook before any
repository code runs and refuses, and logs, the means of reaching the runner or the grader from the code
the patch added (see that file's doc). This module builds its configuration from the kept patch
(``config``: each touched file's added lines, by absolute path) and reads its log (``read_log``).

Why added lines and not whole files: the repository's own code (a module the fix touches, at import) may
use frames or set class attributes for its own reasons; the patch's code has no business doing so.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envs.grading.patch import WORKDIR, FilteredPatch

GUARD_FILE = "guard.py"
CONFIG_FILE = "guard.json"
LOG_FILE = "audit.log"
GUARD_EXIT = 97     # the guard's exit status when its log was closed or replaced under it
_HUNK = re.compile(rb"^@@ -\d+(?:,\d+)? \+(\d+)(?:,\d+)? @@")


SOLO_FILE = "solo.py"   # the isolated run, run by the guard from beside it (its SOLO_FILE)
RUNNERS_FILE = "runners.py"   # the modes of runners other than pytest (its RUNNERS_FILE)


def guard_files() -> dict[str, bytes]:
    """The guard program's files, by their names in the grading folder: ``sandbox_guard.py``, the isolated run it
    loads (``sandbox_solo.py``) and the modes of other runners (``sandbox_runners.py``)."""
    here = Path(__file__).parent
    return {GUARD_FILE: (here / "sandbox_guard.py").read_bytes(), SOLO_FILE: (here / "sandbox_solo.py").read_bytes(),
            RUNNERS_FILE: (here / "sandbox_runners.py").read_bytes()}


def added_lines(text: bytes) -> list[int] | None:
    """The new-side line numbers a file's ``diff --git`` section adds; None when it adds the whole file."""
    lines: list[int] = []
    new_line = 0
    in_hunk = False
    for raw in text.split(b"\n"):
        m = _HUNK.match(raw)
        if m:
            new_line, in_hunk = int(m.group(1)), True
            continue
        if not in_hunk:
            if raw.startswith(b"--- /dev/null"):
                return None
            continue
        if raw.startswith(b"+"):
            lines.append(new_line)
            new_line += 1
        elif raw.startswith(b" "):
            new_line += 1
        elif raw.startswith(b"\\") or raw.startswith(b"-") or raw == b"":
            continue
        else:
            in_hunk = False
    return lines


def module_names(path: str) -> set[str]:
    """The dotted names a repository file is imported under (from the root, and from ``src/``)."""
    if not path.endswith(".py"):
        return set()
    dotted = path[:-3].removesuffix("/__init__").replace("/", ".")
    return {dotted, dotted.removeprefix("src.")} - {""}


def config(folder: str, filtered: FilteredPatch, solo: list[str]) -> dict[str, Any]:
    """The guard's configuration: where to log, what the patch added, which tests to call on their own."""
    patched: dict[str, list[int] | None] = {}
    modules: set[str] = set()
    for change in filtered.changes:
        if change.deleted or not change.path.endswith((".py", ".pyw")):
            continue
        patched[f"{WORKDIR}/{change.path}"] = added_lines(change.text)
        modules |= module_names(change.path)
    return {"log": f"{folder}/{LOG_FILE}", "folder": folder, "root": WORKDIR, "patched": patched,
            "modules": sorted(modules), "paths": [folder, "/proc/", "/var/lib/agentenv-grade"], "solo": solo}


def config_bytes(cfg: dict[str, Any]) -> bytes:
    return json.dumps(cfg).encode()


@dataclass(frozen=True)
class AuditLog:
    starts: int                                 # how many guarded processes started (one per run)
    events: tuple[dict[str, str], ...]          # what the hook refused: event, detail, where

    def reasons(self) -> list[str]:
        return [f"the audit hook refused {e.get('event', '?')} ({e.get('detail', '')[:80]}) from the patch's code "
                f"at {e.get('where', '?')}" for e in self.events]


def read_log(data: bytes) -> AuditLog:
    """The guard's log: its start lines and the events it refused (a line that is not JSON counts as one)."""
    starts = 0
    events: list[dict[str, str]] = []
    for line in data.decode("utf-8", "replace").splitlines():
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            entry = {"event": "unreadable log line", "detail": line[:80], "where": "?"}
        if not isinstance(entry, dict):
            entry = {"event": "unreadable log line", "detail": line[:80], "where": "?"}
        if entry.get("event") == "started" and len(entry) == 1:
            starts += 1
        else:
            events.append({k: str(entry.get(k, "")) for k in ("event", "detail", "where")})
    return AuditLog(starts, tuple(events))
