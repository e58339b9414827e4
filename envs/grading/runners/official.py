"""The official SWE-bench harness, pinned, in a process of its own: eval scripts, log parsers, reports.

``swebench`` is used as a library — its test specs, eval scripts, log parsers and verdict functions are not
written again here — but never imported by ``envs``: ``import swebench`` pulls in docker, datasets and modal,
and 4.x and 5.x cannot share one environment. Each pinned version lives in a folder of its own
(``pip install --no-deps --target <home>/<version> swebench==<version> unidiff==0.7.5``, which
scripts/bootstrap.sh runs; ``<home>`` is ``$AGENTENV_SWEBENCH_HOME``, default ``swebench/`` inside the Python
environment, ``sys.prefix``), and is run by ``official_worker.py`` as ``python -I -S``: no site-packages, no
user environment, nothing but that folder and the standard library, with stand-ins for every module that
could reach a network (so nothing hangs offline: ``tests/unit/envs/test_envs_runners_official.py`` runs it
in a network namespace with no interface but loopback).

A batch of requests is one process (about 50 ms); a log is text the patch's code printed, so the process
has a deadline (``CALL_TIMEOUT``) and an answer cap: a pathological log cannot hang or flood the grader.

Why two folders rather than recorded fixtures: the verdict of every graded record is recomputed by the
package itself, at the pinned version, on the log the run produced — a fixture would only say what it said
once. Why recorded nowhere else: the versions' rules differ (``envs.grading.runners.verdicts``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentenv.errors import AgentEnvError

SWEBENCH_4 = "4.1.0"
SWEBENCH_5 = "5.0.2"
UNIDIFF = "0.7.5"
CALL_TIMEOUT = 120.0          # seconds for one batch
MAX_ANSWER = 64 << 20         # bytes of JSON a batch may answer
WORKER = Path(__file__).with_name("official_worker.py")


class OfficialHarnessError(AgentEnvError):
    """The pinned ``swebench`` folder is missing, or its process failed; the message says which and what to do."""


def home() -> Path:
    """Where the pinned versions live: ``$AGENTENV_SWEBENCH_HOME``, default ``<sys.prefix>/swebench``."""
    return Path(os.environ.get("AGENTENV_SWEBENCH_HOME") or Path(sys.prefix) / "swebench")


def install_command(version: str) -> str:
    return (f"{sys.executable} -m pip install --no-deps --target {home() / version} "
            f"swebench=={version} unidiff=={UNIDIFF}")


@dataclass(frozen=True)
class Harness:
    """One pinned ``swebench`` version's process."""

    version: str

    @property
    def folder(self) -> Path:
        return home() / self.version

    def check(self) -> None:
        """Raise ``OfficialHarnessError`` unless the folder holds this version."""
        dist = self.folder / f"swebench-{self.version}.dist-info"
        if not (self.folder / "swebench" / "__init__.py").is_file() or not dist.is_dir():
            raise OfficialHarnessError(f"the official SWE-bench harness {self.version} is not installed in "
                                       f"{self.folder}", fix=f"run scripts/bootstrap.sh, or: {install_command(self.version)}")

    def call(self, requests: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Answer a batch of requests (see ``official_worker``); a request that failed raises here."""
        if not requests:
            return []
        self.check()
        data = json.dumps(list(requests)).encode("utf-8", "surrogateescape")
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/nonexistent"}
        try:
            r = subprocess.run([sys.executable, "-I", "-S", str(WORKER), str(self.folder)], input=data,
                               capture_output=True, timeout=CALL_TIMEOUT, env=env, cwd="/", check=False)
        except subprocess.TimeoutExpired:
            raise OfficialHarnessError(f"the official harness {self.version} did not answer within "
                                       f"{CALL_TIMEOUT:g} s", fix="report the log that made it hang") from None
        if r.returncode != 0 or len(r.stdout) > MAX_ANSWER:
            tail = r.stderr.decode("utf-8", "replace").strip()[-800:]
            raise OfficialHarnessError(f"the official harness {self.version} failed (exit {r.returncode}): {tail}",
                                       fix=f"check the folder with: {install_command(self.version)}")
        answers: list[dict[str, Any]] = json.loads(r.stdout.decode("utf-8", "surrogateescape"))
        for req, ans in zip(requests, answers, strict=True):
            if not ans.get("ok"):
                raise OfficialHarnessError(f"the official harness {self.version} refused a {req.get('op')!r} "
                                           f"request: {ans.get('error')}", fix="check the record's fields")
        return answers


def harness(major: int) -> Harness:
    return Harness(SWEBENCH_5 if major == 5 else SWEBENCH_4)
