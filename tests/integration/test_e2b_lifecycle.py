"""The sandbox lifecycle as the ``e2b`` SDK (2.63) and E2B's own tests expect it, against a real ``agentenv serve``:
key shape, what a timeout does, fork of a paused sandbox, metrics, listing, file edge cases, strict bodies."""

from __future__ import annotations

import datetime as dt
import re
import time
from pathlib import Path

import httpx
import pytest

e2b = pytest.importorskip("e2b", reason="the E2B SDK is a test extra; bootstrap installs it")

from e2b import Sandbox, SandboxQuery, SandboxState  # noqa: E402

from .server_fixtures import TOKEN, free_port, start_server_process, wait_for  # noqa: E402


def test_a_missing_token_file_gets_an_e2b_shaped_key_that_the_sdk_uses(tmp_path: Path) -> None:
    token_file = tmp_path / "new-token"
    port = free_port()
    proc = start_server_process(port, token_file, "--e2b")
    try:
        key = token_file.read_text().strip()
        assert re.fullmatch(r"e2b_[0-9a-f]{40}", key), key
        assert token_file.stat().st_mode & 0o077 == 0
        url = f"http://127.0.0.1:{port}"
        assert Sandbox.list(api_key=key, api_url=url).next_items() is not None
        with pytest.raises(e2b.AuthenticationException):
            Sandbox.list(api_key=TOKEN, api_url=url).next_items()
    finally:
        proc.terminate()
        proc.wait(30)
    proc = start_server_process(port, token_file, "--e2b")  # an existing file is read, not replaced
    try:
        assert token_file.read_text().strip() == key
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_timeout_kills_unless_the_caller_asked_for_auto_pause(e2b_url: str) -> None:
    killed = Sandbox.create(timeout=1)
    paused = Sandbox.create(timeout=1, lifecycle={"on_timeout": "pause"})
    try:
        assert killed.get_info().lifecycle == {"on_timeout": "kill", "auto_resume": False}
        assert paused.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": False}
        paused.files.write("/tmp/kept", "still here")
        wait_for(lambda: not killed.is_running() and paused.get_info().state == SandboxState.PAUSED,
              "the timeouts run out (the reaper looks every few seconds)")
        with pytest.raises(e2b.NotFoundException):
            Sandbox.get_info(killed.sandbox_id)
        assert Sandbox.connect(paused.sandbox_id).files.read("/tmp/kept") == "still here"
    finally:
        Sandbox.kill(killed.sandbox_id)
        Sandbox.kill(paused.sandbox_id)
    r = httpx.post(f"{e2b_url}/v2/sandboxes", json={"templateID": "base", "autoResume": {"enabled": True}},
                   headers={"X-API-KEY": TOKEN})  # a timeout that kills leaves nothing to resume
    assert r.status_code == 400 and "autoResume" in r.json()["message"], r.text
    r = httpx.post(f"{e2b_url}/v2/sandboxes", json={"templateID": "base", "autoPause": True, "autoPauseMemory": False,
                                                     "autoResume": {"enabled": True}}, headers={"X-API-KEY": TOKEN})
    assert r.status_code == 400 and "autoResume" in r.json()["message"], r.text  # a files-only pause never wakes


def test_a_paused_sandbox_forks_from_its_pause_snapshot(sandbox: Sandbox) -> None:
    sandbox.files.write("/tmp/who", "parent")
    sandbox.commands.run("sleep 600", background=True)
    assert sandbox.pause() is True
    kids = [k for k in sandbox.fork(count=2) if isinstance(k, Sandbox)]
    try:
        assert len(kids) == 2 and len({k.sandbox_id for k in kids} | {sandbox.sandbox_id}) == 3
        for kid in kids:
            assert kid.files.read("/tmp/who") == "parent"
            assert any("sleep 600" in " ".join([p.cmd, *p.args]) for p in kid.commands.list())  # memory came too
        kids[0].files.write("/tmp/who", "child")
        assert kids[1].files.read("/tmp/who") == "parent"
        assert Sandbox.get_info(sandbox.sandbox_id).state == SandboxState.PAUSED  # the parent stays paused
        again = Sandbox.connect(sandbox.sandbox_id)
        assert again.files.read("/tmp/who") == "parent"
    finally:
        for kid in kids:
            kid.kill()


def test_listing_orders_filters_and_pages_as_the_sdk_asks(e2b_url: str) -> None:
    tag = {"suite": f"list-{time.time_ns()}"}
    first = Sandbox.create(metadata=tag)
    time.sleep(1.1)
    second = Sandbox.create(metadata={**tag, "role": "second"})
    try:
        second.pause()
        query = SandboxQuery(metadata=tag)
        ids = [s.sandbox_id for s in Sandbox.list(query=query).next_items()]
        assert ids == [second.sandbox_id, first.sandbox_id]  # newest first, as E2B lists
        asc = [s.sandbox_id for s in Sandbox.list(query=query, order="asc").next_items()]
        assert asc == [first.sandbox_id, second.sandbox_id]
        pages = Sandbox.list(query=query, limit=1)
        assert [s.sandbox_id for s in pages.next_items()] == [second.sandbox_id] and pages.has_next
        assert [s.sandbox_id for s in pages.next_items()] == [first.sandbox_id] and not pages.has_next
        running = Sandbox.list(query=SandboxQuery(metadata=tag, state=[SandboxState.RUNNING])).next_items()
        assert [s.sandbox_id for s in running] == [first.sandbox_id]
        started = Sandbox.get_info(second.sandbox_id).started_at
        later = Sandbox.list(query=SandboxQuery(metadata=tag, started_after=started)).next_items()
        assert [s.sandbox_id for s in later] == [second.sandbox_id]
        assert Sandbox.list(query=SandboxQuery(metadata=tag, template="base")).next_items() != []
        assert Sandbox.list(query=SandboxQuery(metadata=tag, template="no-such")).next_items() == []
        assert [s.sandbox_id for s in Sandbox.list(query=SandboxQuery(metadata={"role": "second"})).next_items()
                if s.sandbox_id in (first.sandbox_id, second.sandbox_id)] == [second.sandbox_id]
        r = httpx.get(f"{e2b_url}/v2/sandboxes", params={"stat": "running"}, headers={"X-API-KEY": TOKEN})
        assert r.status_code == 400 and r.json()["code"] == 400 and "stat" in r.json()["message"]
    finally:
        first.kill()
        second.kill()


def test_bodies_are_strict_and_timeouts_are_only_extended_where_e2b_extends_them(sandbox: Sandbox,
                                                                                e2b_url: str) -> None:
    key = {"X-API-KEY": TOKEN}
    r = httpx.post(f"{e2b_url}/v2/sandboxes", json={"templateID": "base", "autoPuase": True}, headers=key)
    assert r.status_code == 400 and r.json()["code"] == 400 and "autoPuase" in r.json()["message"]
    end = Sandbox.get_info(sandbox.sandbox_id).end_at  # made with timeout=600
    Sandbox.connect(sandbox.sandbox_id, timeout=30)
    assert Sandbox.get_info(sandbox.sandbox_id).end_at >= end  # connect never shortens
    r = httpx.post(f"{e2b_url}/sandboxes/{sandbox.sandbox_id}/refreshes", json={"duration": 3000}, headers=key)
    assert r.status_code == 204
    refreshed = Sandbox.get_info(sandbox.sandbox_id).end_at
    assert refreshed - dt.datetime.now(dt.UTC) > dt.timedelta(seconds=2900)  # duration is read
    r = httpx.post(f"{e2b_url}/sandboxes/{sandbox.sandbox_id}/refreshes", json={"timeout": 10}, headers=key)
    assert r.status_code == 400 and "timeout" in r.json()["message"]
    sandbox.set_timeout(60)  # set_timeout sets, shorter too
    assert Sandbox.get_info(sandbox.sandbox_id).end_at - dt.datetime.now(dt.UTC) < dt.timedelta(seconds=61)


def test_metrics_read_the_sandboxs_cgroup_and_layer(sandbox: Sandbox, e2b_url: str) -> None:
    idle = sandbox.get_metrics()
    assert len(idle) == 1
    m = idle[0]
    assert m.cpu_count == 1 and m.mem_total == 1 << 30 and m.disk_total > 0 and 0 < m.mem_used < m.mem_total
    sandbox.commands.run("head -c 50000000 /dev/urandom > /tmp/blob && sync")
    sandbox.commands.run("timeout 30 sh -c 'while :; do :; done'", background=True)
    # one busy loop: as much of the sandbox's one CPU as the host gives it (a loaded host gives less than half),
    # read from its cgroup, so waited on until it shows, never timed
    deadline = time.monotonic() + 25
    while (busy := sandbox.get_metrics()[0]).cpu_used_pct < m.cpu_used_pct + 10:
        assert time.monotonic() < deadline, (busy, m)
        time.sleep(0.5)
    assert busy.disk_used >= m.disk_used + 40_000_000
    now = dt.datetime.now(dt.UTC)
    assert sandbox.get_metrics(start=now - dt.timedelta(hours=1), end=now - dt.timedelta(minutes=30)) == []
    r = httpx.get(f"{e2b_url}/sandboxes/metrics", params={"sandbox_ids": f"{sandbox.sandbox_id},sb-nonesuch"},
                  headers={"X-API-KEY": TOKEN})
    assert r.status_code == 200 and list(r.json()["sandboxes"]) == [sandbox.sandbox_id]
    assert r.json()["sandboxes"][sandbox.sandbox_id]["memTotal"] == 1 << 30
    sandbox.pause()
    assert sandbox.get_metrics() == []


def test_files_remove_a_missing_path_quietly_and_give_symlink_targets_resolved(sandbox: Sandbox) -> None:
    sandbox.files.remove("/tmp/never-was")  # envd gives no error
    sandbox.files.write("/tmp/real/file.txt", "x")
    sandbox.commands.run("ln -s file.txt /tmp/real/rel && ln -s /tmp/real /tmp/dirlink && ln -s dirlink/rel /tmp/chain")
    assert sandbox.files.get_info("/tmp/real/rel").symlink_target == "/tmp/real/file.txt"
    assert sandbox.files.get_info("/tmp/chain").symlink_target == "/tmp/real/file.txt"  # every hop resolved
    info = sandbox.files.get_info("/tmp/dirlink")
    assert info.symlink_target == "/tmp/real" and info.type == e2b.FileType.DIR  # envd: the target's type
    listed = {e.name: e.symlink_target for e in sandbox.files.list("/tmp/real")}
    assert listed == {"file.txt": None, "rel": "/tmp/real/file.txt"}


def test_a_connect_during_a_pause_waits_for_it_and_resumes(sandbox: Sandbox) -> None:
    """A sandbox being paused still reads 'running' until its pause is done: a connect then (E2B's test_create does
    it after a timeout's auto-pause began) waits for the pause and resumes the sandbox, instead of answering 200 for
    one that is paused a moment later."""
    import threading

    import agentenv

    sandbox.files.write("/tmp/kept", "before")
    native = agentenv.Sandbox.get(sandbox.sandbox_id)
    pausing = threading.Thread(target=native.pause)
    pausing.start()
    try:
        wait_for(lambda: agentenv.Sandbox.get(sandbox.sandbox_id).record.pausing is not None
                 or agentenv.Sandbox.get(sandbox.sandbox_id).recorded_state == "paused", "the pause to begin")
        resumed = sandbox.connect()
    finally:
        pausing.join(60)
    assert agentenv.Sandbox.get(sandbox.sandbox_id).recorded_state == "running"
    assert resumed.files.read("/tmp/kept") == "before"
