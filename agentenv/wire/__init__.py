"""The wire format of the environment server: msgpack or JSON bodies, chosen by Content-Type and Accept.

msgpack (``application/msgpack``) is the default of the Python client: it is smaller and faster and
carries bytes as bytes. JSON is accepted and produced on every route too; in JSON, byte strings (the
output chunks of a streamed exec) travel as base64 text. A streamed exec is a sequence of frames:
concatenated msgpack objects, or one JSON object per line (``application/x-ndjson``).

Both ends read this one module: the client (``agentenv.remote.client``) and the server (``agentenv.server``'s
``routing``, ``limits`` and routes). It is part of the contract, beside ``agentenv.api``, so that neither end imports
the other's room and the client stays apart from the host; it imports the standard library and msgpack only. (A
package rather than ``agentenv/wire.py``: agentenv keeps at most ten modules at its top, ``tests/unit/test_layout.py``.)
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import msgpack

MSGPACK = "application/msgpack"
JSON = "application/json"
NDJSON = "application/x-ndjson"
_MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")


class WireError(ValueError):
    """A body that is not valid msgpack or JSON."""


def is_msgpack(content_type: str | None) -> bool:
    """True when a Content-Type (or an Accept entry) names msgpack."""
    return bool(content_type) and content_type.split(";", 1)[0].strip().lower() in _MSGPACK_TYPES  # type: ignore[union-attr]


def wants_msgpack(accept: str | None) -> bool:
    """True when the Accept header prefers msgpack over JSON (by q-value, then by order)."""
    if not accept:
        return False
    best: tuple[float, int, bool] | None = None
    for order, item in enumerate(accept.split(",")):
        media, _, params = item.partition(";")
        media = media.strip().lower()
        if media not in (*_MSGPACK_TYPES, JSON, "application/*", "*/*"):
            continue
        q = 1.0
        for p in params.split(";"):
            k, _, v = p.partition("=")
            if k.strip() == "q":
                try:
                    q = float(v)
                except ValueError:
                    q = 0.0
        if q <= 0:
            continue
        cand = (q, -order, media in _MSGPACK_TYPES)
        if best is None or cand[:2] > best[:2]:
            best = cand
    return bool(best and best[2])


def _json_default(obj: Any) -> Any:
    if isinstance(obj, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(obj)).decode("ascii")
    raise TypeError(f"cannot encode {type(obj).__name__} as JSON")


def encode(obj: Any, msgpack_body: bool) -> bytes:
    """Serialise ``obj`` as msgpack or compact JSON."""
    if msgpack_body:
        return msgpack.packb(obj, use_bin_type=True)
    return json.dumps(obj, default=_json_default, separators=(",", ":"), ensure_ascii=False).encode()


def decode(body: bytes, content_type: str | None) -> Any:
    """Parse a body by its Content-Type (msgpack, else JSON); WireError with the reason when malformed."""
    if is_msgpack(content_type):
        try:
            return msgpack.unpackb(body, raw=False, strict_map_key=True)
        except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError, TypeError) as e:
            raise WireError(f"malformed msgpack body ({type(e).__name__}: {e})") from None
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"malformed JSON body ({type(e).__name__}: {e})") from None


def frame(obj: Any, msgpack_body: bool) -> bytes:
    """One frame of a stream: a msgpack object, or a JSON line."""
    return encode(obj, True) if msgpack_body else encode(obj, False) + b"\n"


def read_frames(chunks: Iterator[bytes], msgpack_body: bool) -> Iterator[Any]:
    """Parse a stream of frames as it arrives (chunk boundaries need not match frame boundaries)."""
    if msgpack_body:
        unpacker = msgpack.Unpacker(raw=False)
        for chunk in chunks:
            unpacker.feed(chunk)
            yield from unpacker
        return
    buf = b""
    for chunk in chunks:
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line.strip():
                yield json.loads(line)
    if buf.strip():
        yield json.loads(buf)
