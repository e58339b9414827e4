"""``run_program``: a program's exit status and output, and a deadline that kills it (no infrastructure)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from agentenv.host.hostcalls import run_program


def test_exit_status_and_output() -> None:
    r = run_program([sys.executable, "-c", "import sys; print('x' * 200000); sys.exit(3)"], timeout=30, capture=True)
    assert r.returncode == 3
    assert r.stdout == "x" * 200000 + "\n"  # more than a pipe holds: read while it runs


def test_output_not_captured_unless_asked() -> None:
    r = run_program([sys.executable, "-c", "print('hello')"], timeout=30)
    assert (r.returncode, r.stdout) == (0, "")


def test_deadline_kills_the_program() -> None:
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_program([sys.executable, "-c", "import time; time.sleep(60)"], timeout=0.3)
    assert time.monotonic() - t0 < 30  # killed, not waited for


def test_a_child_left_holding_stdout_does_not_hold_the_caller() -> None:
    # like `runc run --detach`: the program exits, a process it started keeps the pipe open
    code = "import subprocess; print(subprocess.Popen(['sleep', '60']).pid, flush=True)"
    r = run_program([sys.executable, "-c", code], timeout=20, capture=True)
    os.kill(int(r.stdout), signal.SIGKILL)
    assert r.returncode == 0
