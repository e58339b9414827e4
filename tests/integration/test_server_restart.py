"""Restart safety (kill -9 of a real server process) and the Pool across servers."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

import agentenv
from agentenv.errors import ConnectionLost

from .conftest import cleanup, leaked
from .server_fixtures import TOKEN, free_port, start_server_process

pytestmark = pytest.mark.integration


def test_kill_9_then_restart_lists_reattaches_and_reports_lost(token_file):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server_process(port, token_file)
    c = agentenv.connect(url, TOKEN, retries=1)
    try:
        running = c.Sandbox.create(memory="256m")
        running.write_file("/testbed/x", "kept")
        paused = c.Sandbox.create(memory="256m")
        paused.exec("echo 41 > /testbed/n")
        paused.pause()
        doomed = c.Sandbox.create(memory="256m")
        snap = running.snapshot(memory=False)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        with pytest.raises(ConnectionLost):
            running.exec("true")
        # while the server is down, the processes of one sandbox die behind its back
        init_pid = int((Path(os.environ["AGENTENV_HOME"]) / "sandboxes" / doomed.id / "init.pid").read_text())
        os.kill(init_pid, signal.SIGKILL)
        proc = start_server_process(port, token_file)
        states = {s.id: s.state for s in c.Sandbox.list()}
        assert states[running.id] == "running" and states[paused.id] == "paused" and states[doomed.id] == "lost"
        assert snap.id in [s.id for s in c.Snapshot.list()]
        recovered = c.server_info()["recovered"]
        assert running.id in recovered["running"] and paused.id in recovered["paused"]
        assert doomed.id in recovered["lost"]
        assert running.read_file("/testbed/x") == b"kept"  # reattached
        paused.resume()
        assert paused.exec("cat /testbed/n").stdout == "41\n"
        for s in (running, paused, doomed):
            s.close()
        snap.delete()
        assert c.Sandbox.list() == [] or all(s.id not in states for s in c.Sandbox.list())
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        c.close()


def test_pool_places_by_capacity_keeps_forks_and_survives_a_dead_server(token_file):
    homes = [Path(tempfile.mkdtemp(prefix="agentenv-pool-", dir="/var/tmp")) for _ in range(2)]
    ports = [free_port(), free_port()]
    procs: list[subprocess.Popen[bytes]] = []
    old_home = os.environ["AGENTENV_HOME"]
    try:
        for home, port, quota in zip(homes, ports, ("2", "6"), strict=True):
            os.environ["AGENTENV_HOME"] = str(home)  # each server its own host state
            procs.append(start_server_process(port, token_file, "--max-sandboxes", quota))
        os.environ["AGENTENV_HOME"] = old_home
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        with agentenv.Pool(urls, TOKEN, reprobe=0.0) as pool:
            first = pool.Sandbox.create(memory="256m")
            assert first.client.url == urls[1]  # 6 free slots beat 2
            kids = first.fork(2)
            assert {k.client.url for k in kids} == {urls[1]}  # forks stay with their source
            # the big server has 3 free slots and the small one 2: the next goes big, then they tie at 2 and
            # the small one wins on free memory
            more = [pool.Sandbox.create(memory="256m")]
            assert more[0].client.url == urls[1]
            other = pool.Sandbox.create(memory="256m")
            assert other.client.url == urls[0]
            on_big = [first, *kids, *more]
            assert {s.id for s in pool.Sandbox.list()} == {s.id for s in [*on_big, other]}
            procs[1].send_signal(signal.SIGKILL)
            procs[1].wait(timeout=30)
            with pytest.raises(ConnectionLost):
                first.exec("true")
            assert first.state == "lost"
            assert set(pool.lost()) == {s.id for s in on_big}
            assert other.exec("echo alive").stdout == "alive\n"  # the others keep working
            again = pool.Sandbox.create(memory="256m")
            assert again.client.url == urls[0]
            listed = {s.id: s.state for s in pool.Sandbox.list()}
            assert listed[other.id] == "running" and all(listed[s.id] == "lost" for s in on_big)
            other.close()
            again.close()
    finally:
        os.environ["AGENTENV_HOME"] = old_home
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=30)
        for home in homes:
            cleanup(home)  # the killed server's sandboxes are still running there: stop them
            left = leaked(home)
            shutil.rmtree(home, ignore_errors=True)  # leaked() asked runc, which made its root again
            assert not left
