"""The host's KSM switch (agentenv.host.ksm) over a stand-in sysfs folder: what it turns on, and that it puts
back exactly what it found; and the refusals of share_memory where the kernel cannot merge."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

import agentenv
from agentenv.errors import MemorySharingUnsupported
from agentenv.host import ksm
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



def test_the_server_takes_share_memory_as_a_strict_bool() -> None:
    assert CreateRequest().share_memory is False
    assert CreateRequest.model_validate({"share_memory": True}).share_memory is True
    with pytest.raises(ValidationError):
        CreateRequest.model_validate({"share_memory": "yes"})
