"""The agent's precompiled start (``agentenv.host.agent_start``) and the phase timer (``agentenv.phases``)."""

from __future__ import annotations

import binascii
import marshal
import os
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

from agentenv import phases
from agentenv.host.agent_start import AGENT_DEST, CODE_ENV, LOADER, agent_command, agent_env
from agentenv.inside import agent

PROBE = "import os, sys\nprint(sys.argv[1:], __name__, __file__.endswith('agent.py'), os.environ.get({var!r}))\n"


def run_loader(tmp_path: Path, tag: str, compiled: str, on_disk: str) -> str:
    """Run the loader as a sandbox's python3 would: ``compiled`` precompiled for the interpreter ``tag`` in the
    environment, ``on_disk`` in the bind-mounted file."""
    dest = tmp_path / "agent.py"
    dest.write_text(on_disk)
    blob = binascii.b2a_base64(zlib.compress(marshal.dumps(compile(compiled, str(dest), "exec"))),
                               newline=False).decode()
    src = LOADER.format(dest=str(dest), var=CODE_ENV, tag=tag)
    return subprocess.run([sys.executable, "-I", "-S", "-c", src], capture_output=True, text=True, check=True,
                          env={**os.environ, CODE_ENV: blob}).stdout


def test_the_loader_runs_the_precompiled_agent_where_the_python_matches(tmp_path: Path) -> None:
    out = run_loader(tmp_path, sys.implementation.cache_tag, "print('compiled'); " + PROBE.format(var=CODE_ENV),
                     "print('source')")
    assert out == "compiled\n[] __main__ True None\n"  # run as the main module; the variable is gone


def test_another_python_compiles_the_mounted_agent_instead(tmp_path: Path) -> None:
    out = run_loader(tmp_path, "cpython-00", "print('compiled')", "print('source'); " + PROBE.format(var=CODE_ENV))
    assert out == "source\n[] __main__ True None\n"


def test_the_command_is_short_and_the_environment_carries_this_hosts_agent() -> None:
    args = agent_command()
    assert args[:4] == ["python3", "-I", "-S", "-c"] and AGENT_DEST in args[4] and len(args[4]) < 400
    name, _, blob = agent_env().partition("=")
    assert name == CODE_ENV and len(agent_env().encode()) < 128 << 10  # the kernel's limit on one string
    code = marshal.loads(zlib.decompress(binascii.a2b_base64(blob)))
    assert code.co_filename == AGENT_DEST
    assert code.co_consts == compile(Path(agent.__file__).read_text(), AGENT_DEST, "exec").co_consts
def _wait(name: str, seconds: float) -> None:
    with phases.phase(name):
        time.sleep(seconds)


def test_phases_are_timed_only_while_recorded_and_from_every_thread() -> None:
    _wait("before", 0)
    with phases.recording() as found:
        _wait("a", 0.01)
        threads = [threading.Thread(target=_wait, args=("b", 0.05)) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    _wait("after", 0)
    assert sorted(p.name for p in found) == ["a", "b", "b", "b"]
    totals, spans = phases.totals(found), phases.spans(found)
    assert totals["a"] == spans["a"] >= 0.01
    assert totals["b"] >= 0.15 and spans["b"] < totals["b"]  # three at once: the sum is over the wall time
