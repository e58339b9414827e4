"""Nothing left running unless asked (issue 45): every sandbox gets a deadline by default, forks and restores
included; the home's reaper (``agentenv.sandbox.watchdog``) holds it with no server running and goes away once
nothing is left to watch; an expired sandbox nobody asked to keep is closed, not paused; the README's tour
leaves nothing behind in a fresh home. Each waits on state, never on a clock."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import agentenv
from agentenv.api import DEFAULT_TTL
from agentenv.host import cgroups
from agentenv.sandbox import sweep, watchdog

from .conftest import cleanup, leaked
from .home_checks import agentenv_cli, reapers

ROOT = Path(__file__).resolve().parents[2]
PATIENCE = 180.0  # seconds a wait on state may take at most on a loaded host before the test fails


def _until(what: str, done: object) -> None:
    end = time.monotonic() + PATIENCE
    while not done():  # type: ignore[operator]
        assert time.monotonic() < end, f"still waiting, after {PATIENCE:.0f} s, for {what}"
        time.sleep(0.5)


@pytest.fixture
def fresh_home() -> Iterator[Path]:
    """An agentenv home of this test's own, for the processes the test starts (and this one's checks)."""
    home = Path(tempfile.mkdtemp(prefix="agentenv-deadline-", dir="/var/tmp"))
    old = os.environ["AGENTENV_HOME"]
    os.environ["AGENTENV_HOME"] = str(home)
    try:
        yield home
    finally:
        os.environ["AGENTENV_HOME"] = old
        cleanup(home)


def _run(code: str, home: Path) -> str:
    """``code`` run by a new Python process in ``home``; its stdout (it fails the test if the process fails)."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=False,
                       cwd=ROOT, env={**os.environ, "AGENTENV_HOME": str(home), "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_create_fork_and_restore_get_the_default_deadline_and_none_only_when_asked():
    with agentenv.Sandbox.create() as sb:
        assert sb.expires_at is not None and sb.expires_at - sb.created_at == pytest.approx(DEFAULT_TTL)
        snap = sb.snapshot()
        kids = sb.fork(2) + sb.fork(1, memory=False) + [agentenv.Sandbox.restore(snap)]
        forever = agentenv.Sandbox.restore(snap, ttl=None)
        try:
            for k in kids:
                assert k.expires_at is not None and k.expires_at - k.created_at == pytest.approx(DEFAULT_TTL, abs=5)
            assert forever.expires_at is None
        finally:
            for k in [*kids, forever]:
                k.close()
            snap.delete()
    with pytest.raises(ValueError, match="ttl must be positive"):
        agentenv.Sandbox.create(ttl=0)


def test_a_deadline_that_passed_while_paused_starts_again_at_the_resume():
    """A paused sandbox has no running deadline; one that passed meanwhile would have the reaper close the sandbox
    right after its resume (it did): the resume gives it DEFAULT_TTL from then. One still ahead is kept."""
    with agentenv.Sandbox.create(ttl=3600) as sb:
        sb.pause()
        sb.set_ttl(0.01)
        while sb.expires_at > time.time():  # the deadline passes while it is paused
            time.sleep(0.01)
        sb.resume()
        assert sb.state == "running" and sb.expires_at - time.time() == pytest.approx(DEFAULT_TTL, abs=30)
        sb.pause()
        sb.set_ttl(7200)
        ahead = sb.expires_at
        sb.resume()
        assert sb.expires_at == ahead


def test_a_sandbox_its_maker_left_is_closed_at_its_deadline_with_no_server(fresh_home):
    """A process makes sandboxes with a short deadline (one, a fork of it, one that asked to be paused at its
    deadline) and a paused one, and exits without closing them; no server runs. The first two are closed (not
    paused: nobody asked to keep them), the third paused, the paused one stays; the reaper then exits."""
    ids = json.loads(_run("import json, agentenv\n"
                          "sb = agentenv.Sandbox.create(ttl=1)\n"
                          "kid, = sb.fork(1, ttl=1, memory=False)\n"
                          "asked = agentenv.Sandbox.create(ttl=1, labels={'agentenv.on_expiry': 'pause'})\n"
                          "kept = agentenv.Sandbox.create(ttl=1); kept.pause()\n"
                          "print(json.dumps([sb.id, kid.id, asked.id, kept.id]))\n", fresh_home))
    _until("the reaper to close the two sandboxes left running",
           lambda: not any((fresh_home / "sandboxes" / i).exists() for i in ids[:2]))
    _until("the reaper to pause the sandbox that asked for it", lambda: agentenv.Sandbox.get(ids[2]).state == "paused")
    _until("the reaper to exit", lambda: not watchdog.running())
    asked, kept = agentenv.Sandbox.get(ids[2]), agentenv.Sandbox.get(ids[3])
    assert kept.state == "paused"
    assert sorted(s.id for s in agentenv.Snapshot.list()) == sorted([asked.paused_snapshot, kept.paused_snapshot])
    asked.close()
    kept.close()
    assert agentenv.Snapshot.list() == []


def test_a_home_removed_under_its_reaper_stays_removed(fresh_home):
    """A test suite (or a user) removes a home while a sandbox with a deadline runs there: the reaper exits and
    never lays the home out again (it once did, leaving empty homes behind every test)."""
    _run("import agentenv; agentenv.Sandbox.create(ttl=600)", fresh_home)
    assert reapers(fresh_home)
    cleanup(fresh_home)
    _until("the reaper of the removed home to exit", lambda: not reapers(fresh_home))
    assert not fresh_home.exists()


def _readme_tour() -> str:
    text = (ROOT / "README.md").read_text()
    tour = text[text.index("## A 30-second tour of the API"):]
    found = re.search(r"```python\n(.*?)```", tour, re.S)
    assert found, "the README's tour has no python block"
    return found.group(1)


def test_the_tours_leave_nothing_behind_in_a_fresh_home(fresh_home):
    """What `agentenv tour` and the README's tour make is all gone once they return: sandboxes, their mounts, uid
    leases and cgroups; then `agentenv gc` gives back the idle home's own mounts, and says so."""
    assert "tour done" in agentenv_cli(fresh_home, "tour")
    assert leaked(fresh_home) == {}
    made = json.loads(_run(
        "import json\n"
        "from agentenv.sandbox import lifecycle\n"
        "made, make = [], lifecycle.make\n"
        "def counted(*a, **k):\n"
        "    sb = make(*a, **k); made.append(sb.id); return sb\n"
        "lifecycle.make = counted\n"
        + _readme_tour() + "\nprint(json.dumps(made))\n", fresh_home).splitlines()[-1])
    assert len(made) >= 6  # the sandbox, its 4 forks and the restored one
    assert leaked(fresh_home) == {}
    assert [sid for sid in made if cgroups.existing(f"/agentenv/ae-{sid}")] == []
    _until("the reaper to exit", lambda: not watchdog.running())
    # what the idle home still holds in the mount table goes with `agentenv gc`, which says so (--dry-run first)
    held = sweep.home_mounts()
    assert str(fresh_home / "volume") in held and any("/uids/" in m for m in held)
    preview = agentenv_cli(fresh_home, "gc", "--dry-run")
    assert all(f"would unmount {m}" in preview for m in held) and sweep.home_mounts() == held
    said = agentenv_cli(fresh_home, "gc")
    assert all(f"unmounted {m}" in said for m in held)
    assert sweep.home_mounts() == [] and agentenv_cli(fresh_home, "gc") == f"nothing to collect in {fresh_home}"
    # and the home works again: its next sandbox mounts what it needs
    with agentenv.Sandbox.create() as sb:
        assert sb.exec("echo back").stdout == "back\n"
    assert str(fresh_home / "volume") in sweep.home_mounts()

