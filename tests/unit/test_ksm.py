"""The host's KSM switch (agentenv.host.ksm) over a stand-in sysfs folder: what it turns on, at what rate, and
that it puts back exactly what it found; who may share (one owner at a time); and share_memory's default (where
the host can) against its refusals (True where the kernel cannot merge)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

import agentenv
from agentenv.errors import MemorySharingUnsupported
from agentenv.host import ksm
from agentenv.host.hostcalls import proc_start_time
from agentenv.server.schemas import CreateRequest

FOUND = {"run": "0", "advisor_mode": "[none] scan-time", "advisor_target_scan_time": "200",
         "advisor_max_cpu": "70", "sleep_millisecs": "20", "pages_to_scan": "100"}


@pytest.fixture
def sysfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "ksm"
    d.mkdir()
    for name, value in FOUND.items():
        (d / name).write_text(value + "\n")
    monkeypatch.setattr(ksm, "KSM", d)
    return d


def read(d: Path) -> dict[str, str]:
    return {p.name: p.read_text().strip() for p in d.iterdir()}


def test_switch_on_throttles_and_off_puts_back_what_it_found(sysfs: Path, tmp_path: Path) -> None:
    saved = tmp_path / "found.json"
    ksm.switch(True, saved)
    now = read(sysfs)
    assert now["run"] == "1" and now["advisor_mode"] == "none"
    assert now["pages_to_scan"] == ksm.PAGES and now["sleep_millisecs"] == ksm.SLEEP_MS
    assert json.loads(saved.read_text())["pages_to_scan"] == "100"
    ksm.switch(True, saved)  # idempotent: the settings found stay the first ones
    assert json.loads(saved.read_text())["run"] == "0"
    ksm.switch(False, saved)
    back = read(sysfs)
    assert back["run"] == "0" and back["advisor_mode"] == "none" and back["advisor_max_cpu"] == "70"
    assert back["sleep_millisecs"] == "20"
    assert back["pages_to_scan"] == "100" and not saved.exists()


def test_a_host_that_runs_ksm_itself_keeps_its_settings(sysfs: Path, tmp_path: Path) -> None:
    (sysfs / "run").write_text("1")
    saved = tmp_path / "found.json"
    ksm.switch(True, saved)
    ksm.switch(False, saved)
    assert read(sysfs)["run"] == "1" and read(sysfs)["pages_to_scan"] == "100"


def test_no_ksm_is_refused_with_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ksm, "KSM", tmp_path / "absent")
    with pytest.raises(MemorySharingUnsupported, match="CONFIG_KSM") as e:
        ksm.require()
    assert e.value.fix and "share_memory" in e.value.fix
    with pytest.raises(MemorySharingUnsupported):
        agentenv.Sandbox.create(share_memory=True)


def test_share_memory_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="share_memory"):
        agentenv.Sandbox.create(share_memory="yes")  # type: ignore[arg-type]



def test_the_server_takes_share_memory_as_a_strict_bool_or_null() -> None:
    assert CreateRequest().share_memory is False
    assert CreateRequest.model_validate({"share_memory": True}).share_memory is True
    assert CreateRequest.model_validate({"share_memory": None}).share_memory is None
    with pytest.raises(ValidationError):
        CreateRequest.model_validate({"share_memory": "yes"})


NO_KSM = MemorySharingUnsupported("this kernel has no KSM", fix="...")


@pytest.mark.parametrize(("asked", "why_not", "holder", "shares"), [
    (False, None, None, False), (False, NO_KSM, "/other", False),   # the opt-out never asks the host
    (None, None, None, True), (None, None, "/home", True),          # the default: where the host can
    (None, NO_KSM, None, False), (None, None, "/other", False),     # ... and no sharing elsewhere, no error
    (True, None, None, True), (True, None, "/home", True),
    (True, NO_KSM, None, "this kernel has no KSM"), (True, None, "/other", "another agentenv home")])
def test_who_shares(asked: bool | None, why_not: MemorySharingUnsupported | None, holder: str | None,
                    shares: bool | str) -> None:
    if isinstance(shares, str):
        with pytest.raises(MemorySharingUnsupported, match=shares) as e:
            ksm.decide(asked, "/home", why_not, holder)
        assert e.value.fix
    else:
        assert ksm.decide(asked, "/home", why_not, holder) is shares


def test_the_default_falls_back_where_ksm_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ksm, "KSM", tmp_path / "absent")
    assert ksm.choose(None) is False and ksm.choose(False) is False
    with pytest.raises(MemorySharingUnsupported, match="CONFIG_KSM"):
        ksm.choose(True)


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(ksm, "STATE", tmp_path / "agentenv-ksm")
    monkeypatch.setattr(ksm, "owner", lambda: "/home/a")
    return tmp_path / "agentenv-ksm"


def test_the_hosts_merging_is_one_owners_at_a_time(state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert ksm.holder() is None
    ksm.claim()
    assert ksm.holder() == "/home/a"
    ksm.claim()  # the same owner again: its forks, restores and new sandboxes
    monkeypatch.setattr(ksm, "owner", lambda: "/home/b")
    monkeypatch.setattr(ksm, "unsupported", lambda: None)
    with pytest.raises(MemorySharingUnsupported, match="/home/a"):
        ksm.claim()
    assert ksm.choose(None) is False  # b's default: no sharing, no error
    with pytest.raises(MemorySharingUnsupported):
        ksm.choose(True)
    # a claim holds while some process has mergeable memory; without any, only while it is fresh (a start in
    # flight) and its process lives
    me = {"pid": os.getpid(), "start": proc_start_time(os.getpid())}
    gone = subprocess.Popen(["true"])
    gone.wait()
    monkeypatch.setattr(ksm, "wanted", lambda: False)
    for at, by, holds in ((time.time(), me, True), (time.time(), {"pid": gone.pid, "start": 1}, False),
                          (time.time() - ksm.CLAIM_HOLD_S - 1, me, False)):
        state.with_suffix(".owner").write_text(json.dumps({"owner": "/home/a", "at": at, **by}))
        assert ksm.holder() == ("/home/a" if holds else None) and ksm.choose(None) is not holds
    monkeypatch.setattr(ksm, "wanted", lambda: True)
    assert ksm.holder() == "/home/a" and ksm.choose(None) is False
    monkeypatch.setattr(ksm, "wanted", lambda: False)
    ksm.claim()
    assert ksm.holder() == "/home/b"


def test_the_scan_rate_follows_the_mergeable_memory() -> None:
    gib = 1 << 30
    rates = [ksm.pages_for(b) for b in (0, 64 << 20, gib // 4, gib, 4 * gib, 64 * gib)]
    assert rates[0] == ksm.MIN_PAGES and rates[-1] == int(ksm.PAGES)
    assert rates == sorted(rates) and ksm.MIN_PAGES < rates[2] < rates[3] < int(ksm.PAGES)
    # a full pass of 1 GiB in SCAN_S seconds: pages per wake x wakes = the GiB's pages
    wakes = ksm.SCAN_S * 1000 / int(ksm.SLEEP_MS)
    assert abs(rates[3] * wakes - gib / 4096) / (gib / 4096) < 0.01


def test_sync_tunes_ksmd_to_the_fork_load_and_puts_back_what_it_found(
        sysfs: Path, state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    load = {"bytes": 256 << 20}
    monkeypatch.setattr(ksm, "mergeable_bytes", lambda: load["bytes"])
    assert ksm.sync()
    one = int(read(sysfs)["pages_to_scan"])
    assert read(sysfs)["run"] == "1" and one == ksm.pages_for(256 << 20)
    load["bytes"] = 17 * (256 << 20)  # the sandbox and 16 forks of it
    assert ksm.sync()
    assert int(read(sysfs)["pages_to_scan"]) == ksm.pages_for(load["bytes"]) > one
    load["bytes"] = 0
    assert not ksm.sync()
    assert read(sysfs)["run"] == "0" and read(sysfs)["pages_to_scan"] == "100"


def test_a_host_running_ksm_itself_keeps_its_rate(sysfs: Path, state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (sysfs / "run").write_text("1")
    monkeypatch.setattr(ksm, "mergeable_bytes", lambda: 8 << 30)
    assert ksm.sync()
    assert read(sysfs)["pages_to_scan"] == "100"
