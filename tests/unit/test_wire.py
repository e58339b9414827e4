"""The wire codec (msgpack / JSON by Content-Type and Accept) and the error round trip server -> client."""

from __future__ import annotations

import base64
import json

import msgpack
import pytest

from agentenv import errors, wire
from agentenv.errors import from_wire, status_of, to_wire


def test_content_type_and_accept_negotiation():
    assert wire.is_msgpack("application/msgpack") and wire.is_msgpack("application/x-msgpack; charset=binary")
    assert not wire.is_msgpack("application/json") and not wire.is_msgpack(None)
    assert wire.wants_msgpack("application/msgpack")
    assert not wire.wants_msgpack("application/json")
    assert not wire.wants_msgpack(None) and not wire.wants_msgpack("*/*")
    assert wire.wants_msgpack("application/json;q=0.5, application/msgpack")
    assert not wire.wants_msgpack("application/msgpack;q=0.1, application/json")
    assert not wire.wants_msgpack("application/msgpack;q=0, text/html")


@pytest.mark.parametrize("mp", [True, False])
def test_encode_decode_round_trip(mp):
    obj = {"a": 1, "b": [1.5, None, True], "s": "é\n"}
    body = wire.encode(obj, mp)
    assert wire.decode(body, wire.MSGPACK if mp else wire.JSON) == obj


def test_bytes_are_bytes_in_msgpack_and_base64_in_json():
    data = bytes(range(256))
    assert msgpack.unpackb(wire.encode({"d": data}, True))["d"] == data
    assert base64.b64decode(json.loads(wire.encode({"d": data}, False))["d"]) == data


@pytest.mark.parametrize(("body", "ctype"), [(b"\xc1", wire.MSGPACK), (b"\x92\x01", wire.MSGPACK),
                                             (b"{nope", wire.JSON), (b"\xff\xfe", wire.JSON)])
def test_malformed_bodies_raise_wire_error_with_a_reason(body, ctype):
    with pytest.raises(wire.WireError, match="malformed"):
        wire.decode(body, ctype)


@pytest.mark.parametrize("mp", [True, False])
def test_frames_survive_any_chunking(mp):
    frames = [{"stream": "stdout", "data": b"x" * 1000}, {"stream": "stderr", "data": b"\n"}, {"result": {"ok": 1}}]
    blob = b"".join(wire.frame(f, mp) for f in frames)
    chunks = [blob[i:i + 7] for i in range(0, len(blob), 7)]
    got = list(wire.read_frames(iter(chunks), mp))
    if not mp:  # JSON carries bytes as base64
        for g in got[:2]:
            g["data"] = base64.b64decode(g["data"])
    assert got == frames


@pytest.mark.parametrize(("exc", "status"), [
    (errors.SandboxNotFound("no sandbox 'sb-1'"), 404),
    (errors.SnapshotNotFound("no snapshot 'x'"), 404),
    (errors.SandboxStateError("sandbox sb-1 is paused", fix="resume() it"), 409),
    (errors.StoreFullError("store full", fix="delete snapshots"), 507),
    (errors.QuotaExceeded("too many", retry_after=7), 429),
    (errors.Unauthorized("wrong token"), 401),
    (errors.CheckpointError("CRIU dump failed", fix="run criu check"), 500),
    (errors.ConnectionLost("agent gone"), 502),
    (errors.DiskLimitUnsupported("no quotas here", fix="run bootstrap, or pass disk=None"), 501),
    (errors.DiskLimitRequired("a disk limit is required", fix="send disk"), 403),
])
def test_agentenv_errors_map_to_a_status_and_back_to_the_same_class(exc, status):
    assert status_of(exc) == status
    body = to_wire(exc, "sb-1")
    assert body["id"] == "sb-1"
    back = from_wire(json.loads(json.dumps(body)), status)
    assert type(back) is type(exc)
    assert str(back) == str(exc)
    assert back.fix == exc.fix
    if isinstance(exc, errors.QuotaExceeded):
        assert back.retry_after == 7


def test_builtin_errors_come_back_as_themselves():
    fnf = FileNotFoundError(2, "[Errno 2] No such file or directory: '/x'")  # an agent's message has the errno in it
    back = from_wire(to_wire(fnf), 404)
    assert isinstance(back, FileNotFoundError) and str(back) == "[Errno 2] No such file or directory: '/x'"  # once
    assert str(from_wire(to_wire(back), 404)) == str(back)
    assert isinstance(from_wire(to_wire(ValueError("bad size")), 400), ValueError)
    assert isinstance(from_wire({"error": "ValidationError", "message": "count: too big"}, 422), ValueError)
    assert isinstance(from_wire({"error": "ProcessLookupError", "message": "no process 5"}, 404), ProcessLookupError)
    assert status_of(RuntimeError("bug")) is None  # unknown exceptions are 500s, never a typed status
    too_long = from_wire({"error": "OSError", "errno": 36, "message": "File name too long: '/aaa'"})  # from an agent
    assert type(too_long) is OSError and too_long.errno == 36 and status_of(too_long) == 400
    assert type(from_wire(to_wire(too_long), 400)) is OSError
    assert status_of(OSError(5, "I/O error")) is None  # any other: the server's failure
    assert status_of(OSError(122, "Disk quota exceeded")) == 507  # the sandbox's disk limit: Insufficient Storage


def test_unknown_error_names_fall_back_by_status():
    assert isinstance(from_wire({"error": "Weird", "message": "m"}, 429), errors.QuotaExceeded)
    assert isinstance(from_wire("not a dict", 503), errors.AgentEnvError)
