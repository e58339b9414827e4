"""A sandbox's record as typed fields (``agentenv.sandbox.record.SandboxRecord``) and its form on disk: the
unversioned form agentenv wrote before version 2, and version 2 (before ``forked_from``), are read and written back
in the current form, and a record of a later version, with a key that is no field (or not yet one in its version) or a
field of the wrong type, is refused with an error that names it."""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import pytest

from agentenv import Sandbox
from agentenv.api import Limits
from agentenv.config import paths
from agentenv.host import volume
from agentenv.host.runtime import ContainerSpec
from agentenv.sandbox.record import RECORD_VERSION, Record, RecordError, SandboxRecord, load, save
from agentenv.snapshot import store

SPEC = ContainerSpec(image_id="sha256:" + "ab" * 32, layers=["/var/lib/docker/overlay2/l1/diff"],
                     env=["PATH=/usr/bin:/bin", "TOKEN=secret"], workdir="/", limits=Limits(disk=10 << 30),
                     network=True, rules={"allow_out": [], "deny_out": []}, uids=165536).to_json()
# a running sandbox's record as agentenv wrote it before version 2: the keys ``Sandbox._new`` writes, and the two
# a start adds (its keeper's start time, its address); a fork's pooled child and a lazy restore add the others
TODAYS = {"id": "sb-0123456789ab", "image": "python:3.12-slim", "spec": SPEC, "state": "running",
          "created_at": 1764480000.25, "expires_at": 1764483600.25, "labels": {"team": "rl"},
          "init_pid": 4242, "paused_snapshot": None, "parent_snapshot": "snap-0123456789ab",
          "layer": "sb-0123456789ab", "owner": None, "pausing": None, "init_start": 987654, "address": "10.88.0.7"}
LATER_KEYS = {"retired_layers", "lazy_pages"}
V3_KEYS = {"forked_from"}  # what version 3 added
OLDEST = {"id": "sb-old", "image": "python:3.12-slim", "spec": SPEC, "state": "paused", "created_at": 1.5,
          "expires_at": None, "labels": {}, "init_pid": None, "paused_snapshot": "snap-p", "parent_snapshot": None}


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTENV_HOME", str(tmp_path))
    monkeypatch.setenv(volume.VOLUME_ENV, "off")  # unit tests never mount a volume
    return paths()


def _write(home, data: dict) -> None:
    folder = home.sandboxes / str(data.get("id", "sb-x"))
    folder.mkdir(mode=0o700)
    (folder / "sandbox.json").write_text(json.dumps(data))


def test_the_fields_are_the_keys_agentenv_ever_wrote():
    assert {f.name for f in dataclasses.fields(SandboxRecord)} == set(TODAYS) | LATER_KEYS | V3_KEYS


def test_todays_unversioned_record_loads_and_round_trips_in_the_current_form():
    rec = SandboxRecord.from_json(TODAYS)
    assert rec.state == "running" and rec.init_pid == 4242 and rec.spec == SPEC and rec.labels == {"team": "rl"}
    assert rec.forked_from is None
    assert rec.to_json() == {"version": RECORD_VERSION, **TODAYS, "retired_layers": None, "lazy_pages": None,
                             "forked_from": None}
    assert SandboxRecord.from_json(rec.to_json()) == rec
    assert SandboxRecord.from_json(json.loads(json.dumps(rec.to_json()))) == rec


def test_a_record_from_before_the_volume_takes_the_defaults_of_its_missing_fields():
    rec = SandboxRecord.from_json(OLDEST)
    assert rec.layer is None and rec.owner is None and rec.pausing is None and rec.address is None
    assert rec.to_json() == {"version": 3, **{f.name: None for f in dataclasses.fields(rec)}, **OLDEST}


def test_a_file_is_written_back_whole_in_the_current_form_and_private(tmp_path):
    path = tmp_path / "sandbox.json"
    path.write_text(json.dumps({**TODAYS, "lazy_pages": [77, 12345]}))
    rec = load(path)
    assert rec.lazy_pages == [77, 12345]
    save(path, rec)
    assert json.loads(path.read_text()) == {"version": 3, **TODAYS, "lazy_pages": [77, 12345], "retired_layers": None,
                                            "forked_from": None}
    assert os.stat(path).st_mode & 0o777 == 0o600  # its spec's env holds secrets
    assert load(path) == rec


def test_a_version_2_record_loads_with_its_lineage_unknown_and_is_written_back_as_version_3(tmp_path):
    path = tmp_path / "sandbox.json"
    path.write_text(json.dumps({"version": 2, **TODAYS, "lazy_pages": None, "retired_layers": None}))
    rec = load(path)
    assert rec.forked_from is None and rec.parent_snapshot == "snap-0123456789ab"
    save(path, dataclasses.replace(rec, forked_from="sb-parent"))
    assert json.loads(path.read_text())["version"] == RECORD_VERSION == 3
    assert load(path).forked_from == "sb-parent"


def test_a_field_its_version_did_not_have_is_refused():
    """A version 2 record naming ``forked_from`` was not written by an agentenv: it is not read as version 3."""
    with pytest.raises(RecordError, match=r"unknown field\(s\) forked_from \(a version 2 record has none such\)"):
        SandboxRecord.from_json({"version": 2, **TODAYS, "forked_from": "sb-x"})
    with pytest.raises(RecordError, match="unknown field.*forked_from.*version 1"):
        SandboxRecord.from_json({**TODAYS, "forked_from": "sb-x"})
    assert SandboxRecord.from_json({"version": 3, **TODAYS, "forked_from": "sb-x"}).forked_from == "sb-x"


@pytest.mark.parametrize(("key", "value"), [("forked_from", 7), ("forked_from", ["sb-x"])])
def test_an_ill_typed_forked_from_is_refused(key, value):
    with pytest.raises(RecordError, match=key):
        SandboxRecord.from_json({"version": 3, **TODAYS, key: value})


@pytest.mark.parametrize("version", [RECORD_VERSION + 1, 99])
def test_a_record_of_a_later_version_is_refused_naming_it(version):
    with pytest.raises(RecordError, match=f"version {version} is of a later agentenv") as e:
        SandboxRecord.from_json({**TODAYS, "version": version}, "/h/sandboxes/sb-x/sandbox.json")
    assert "/h/sandboxes/sb-x/sandbox.json" in str(e.value) and e.value.fix


@pytest.mark.parametrize("version", [0, -1, "2", 2.0, True, None])
def test_a_version_that_is_no_version_is_refused(version):
    with pytest.raises(RecordError, match="is no record version"):
        SandboxRecord.from_json({**TODAYS, "version": version})


@pytest.mark.parametrize("version", [None, 2])
def test_unknown_fields_are_refused_not_dropped(version):
    data = {**TODAYS, "ttl": 60, "on_expiry": "kill"} | ({"version": version} if version else {})
    with pytest.raises(RecordError, match="unknown field.*on_expiry, ttl"):
        SandboxRecord.from_json(data)


@pytest.mark.parametrize(("key", "value"), [("init_pid", "4242"), ("state", "sleeping"), ("state", "lost"),
                                            ("created_at", True), ("labels", ["a"]), ("spec", None),
                                            ("owner", 7), ("expires_at", "soon"), ("layer", 3)])
def test_an_ill_typed_field_is_refused_naming_it(key, value):
    with pytest.raises(RecordError, match=key):
        SandboxRecord.from_json({**TODAYS, key: value})


def test_a_missing_field_or_a_record_that_is_no_object_is_refused():
    with pytest.raises(RecordError, match="missing field.*spec, created_at"):
        SandboxRecord.from_json({k: v for k, v in TODAYS.items() if k not in ("spec", "created_at")})
    with pytest.raises(RecordError, match="not a JSON object"):
        SandboxRecord.from_json([TODAYS])


def test_changes_name_fields_the_record_has_and_never_its_id_or_state():
    rec = Record()
    rec.id, rec._rec = "sb-x", SandboxRecord.from_json({**TODAYS, "id": "sb-x"})
    before = rec.record
    for bad in ({"ttl": 5}, {"state": "paused"}, {"id": "sb-y"}):
        with pytest.raises(TypeError, match=next(iter(bad))):
            rec.amend(**bad)
        with pytest.raises(TypeError, match=next(iter(bad))):
            rec.transition("paused", **bad)
    assert rec.record == before
    rec.amend(pausing="snap-p", owner=[1, 2])
    assert rec.record == dataclasses.replace(before, pausing="snap-p", owner=[1, 2])
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.record.state = "paused"  # type: ignore[misc]


def test_a_sandbox_reads_a_record_of_either_form_and_lists_past_one_it_cannot_read(home, caplog):
    _write(home, TODAYS)
    _write(home, OLDEST)
    _write(home, {**TODAYS, "id": "sb-later", "version": RECORD_VERSION + 1})
    sb = Sandbox.get(TODAYS["id"])
    assert sb.record == SandboxRecord.from_json(TODAYS)
    assert (sb.image, sb.labels, sb.expires_at, sb.parent_snapshot) == ("python:3.12-slim", {"team": "rl"},
                                                                        1764480000.25 + 3600, "snap-0123456789ab")
    assert Sandbox.get("sb-old").paused_snapshot == "snap-p"
    with pytest.raises(RecordError, match="later agentenv"):
        Sandbox.get("sb-later")
    with caplog.at_level(logging.WARNING, "agentenv"):
        assert [s.id for s in Sandbox.list()] == ["sb-old", TODAYS["id"]]
    assert "passing over sandbox sb-later" in caplog.text


def test_the_readers_of_the_raw_file_still_find_its_keys(home):
    folder = home.sandboxes / "sb-x"
    folder.mkdir(mode=0o700)
    save(folder / "sandbox.json", SandboxRecord.from_json({**TODAYS, "id": "sb-x", "pausing": "snap-p"}))
    assert store.pausing() == {"snap-p"}  # as the store's gc and a home's layout read it: by its top-level keys
