"""Schemathesis hooks (loaded through $SCHEMATHESIS_HOOKS): msgpack bodies and responses, as the server speaks both."""

from __future__ import annotations

from typing import Any

import msgpack
import schemathesis


def _fit(value: Any) -> Any:
    """msgpack has 64-bit integers only: bigger ones (never valid for this API) go as floats."""
    if isinstance(value, int) and not isinstance(value, bool) and not -(1 << 63) <= value < 1 << 64:
        return float(value)
    if isinstance(value, dict):
        return {k: _fit(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_fit(v) for v in value]
    return value


@schemathesis.serializer("application/msgpack")
def to_msgpack(ctx: Any, value: Any) -> bytes:
    return msgpack.packb(_fit(value), use_bin_type=True)  # type: ignore[no-any-return]


@schemathesis.deserializer("application/msgpack")
def from_msgpack(ctx: Any, response: Any) -> Any:
    return msgpack.unpackb(response.content, raw=False)
