"""Snapshots and paused sandboxes made before the PID-1 helper was renamed (agent → keeper) restore with the code
of after it, on real runc + CRIU.

The helper's path in the sandbox is a bind mount, and a CRIU image records every mount it found: one dumped when
the helper was ``/.agentenv/agent.py`` names that path, and CRIU refuses to restore it into a config that mounts
``/.agentenv/keeper.py`` instead. ``before_the_rename`` writes a sandbox's config.json as the code before the
rename did (the mount's destination, the loader's command line naming it and its code variable, the environment's
marker), so the sandboxes below run with the old layout; the snapshots, the pause and every restore after that use
today's code (``agentenv.host.keeper_start.mount_as_dumped``). An E2B template is such a snapshot, restored the same
way.
"""

from __future__ import annotations

from typing import Any

import pytest

import agentenv
from agentenv.cli.tour import COUNTER
from agentenv.host import runtime
from agentenv.host.keeper_start import CODE_ENV, KEEPER_DEST, OLD_DEST
from agentenv.snapshot.restore import DIRECT_RESTORE_ENV
from agentenv.snapshot.store import Snapshot

from .conftest import ask, start_counter

pytestmark = pytest.mark.integration

OLD_CODE_ENV = "AGENTENV_AGENT_CODE"  # the variable that carried the compiled helper before the rename
OLD_MARK, MARK = "AGENTENV_KEEPER=1", "AGENTENV_KEEPER=1"


def before_the_rename(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` (today's config.json) as the code before the rename wrote it."""
    for m in config["mounts"]:
        if m["destination"] == KEEPER_DEST:
            m["destination"] = OLD_DEST
    process = config["process"]
    process["args"] = [a.replace(KEEPER_DEST, OLD_DEST).replace(CODE_ENV, OLD_CODE_ENV) for a in process["args"]]
    process["env"] = [OLD_MARK if e == MARK else OLD_CODE_ENV + e[len(CODE_ENV):] if e.startswith(CODE_ENV + "=")
                      else e for e in process["env"]]
    return config


def helper_paths(sb: agentenv.Sandbox) -> list[str]:
    """Where the helper is mounted in the sandbox, then the path PID 1's command line names."""
    return sb.exec("python3 -c \"import re; print(*[f.split()[4] for f in open('/proc/1/mountinfo') "
                   "if f.split()[4].startswith('/.agentenv/')], *re.findall(r'/[.]agentenv/[a-z]+[.]py', "
                   "open('/proc/1/cmdline').read()))\"").stdout.split()


@pytest.mark.parametrize("direct", ["1", "0"], ids=["criu", "runc-restore"])
def test_snapshots_and_a_paused_sandbox_from_before_the_rename_restore_and_answer(direct: str,
                                                                                 monkeypatch: pytest.MonkeyPatch):
    """Both ways a restore runs: CRIU directly, and ``runc restore`` (which maps the config's bind mounts too)."""
    monkeypatch.setenv(DIRECT_RESTORE_ENV, direct)
    snaps: list[Snapshot] = []
    made: list[agentenv.Sandbox] = []
    try:
        today = runtime.oci_config
        with monkeypatch.context() as m:  # the sandboxes, snapshots and pause of the code before the rename
            m.setattr(runtime, "oci_config", lambda *a, **k: before_the_rename(today(*a, **k)))
            sb = agentenv.Sandbox.create()
            made.append(sb)
            paused = agentenv.Sandbox.create()
            made.append(paused)
            assert helper_paths(sb) == [OLD_DEST, OLD_DEST]  # the layout of before the rename
            for s in (sb, paused):
                start_counter(s)
            snaps.append(sb.snapshot(memory=True))
            snaps.append(sb.snapshot())  # files only
            paused.pause()
        # today's code from here on
        kid = agentenv.Sandbox.restore(snaps[0])
        made.append(kid)
        assert ask(kid) == 2 and kid.exec("echo hi").stdout == "hi\n"  # its memory and its calls came back
        kid.write_file("/tmp/x", b"data")
        assert kid.read_file("/tmp/x") == b"data"
        assert helper_paths(kid) == [OLD_DEST, OLD_DEST]  # the old process, mounted where it was
        snaps.append(kid.snapshot(memory=True))  # whose images record the old path again
        grandkid = agentenv.Sandbox.restore(snaps[-1])
        made.append(grandkid)
        assert ask(grandkid) == 3

        fresh = agentenv.Sandbox.restore(snaps[1])  # files only: the helper starts anew, in today's layout
        made.append(fresh)
        assert fresh.read_file("/opt/counter.py").decode() == COUNTER
        assert helper_paths(fresh) == [KEEPER_DEST, KEEPER_DEST]

        paused.resume()
        assert ask(paused) == 2 and paused.exec("echo hi").stdout == "hi\n"
    finally:
        for sandbox in made:
            sandbox.close()
        for snap in snaps:
            snap.delete()
