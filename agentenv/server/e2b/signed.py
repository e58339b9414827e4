"""Signed file URLs: ``Sandbox.download_url`` / ``upload_url`` of a secured sandbox, reached with no token.

The SDK signs ``path:operation:user:envdAccessToken[:expiration]`` (sha256, base64 without padding, ``v1_``
before it) and puts the signature in the URL's query. Such a URL goes to ``E2B_SANDBOX_URL`` with no header
naming the sandbox, and the envd token is per sandbox (``tokens.envd_token``), so the sandbox is the one
whose token makes the signature: each sandbox of this host is tried (at most ``MAX_SCAN`` of them, every one
compared in constant time). Where the request names its sandbox (headers, or a ``get_host`` name), only that
one is checked. A signature opens ``/files`` alone: GET with a ``read`` signature, POST with a ``write`` one;
never the Connect services or another port. The signature fixes the account too, so a signed request may carry
no ``Authorization`` header (which would name another), and an upload writes the one path signed (``SCOPE_KEY``
marks the request for the ``/files`` routes, which then take neither a second file nor a file's own name).
As envd: a wrong signature is ``invalid signature`` (401), a right
one past its expiration ``signature is already expired`` (401).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
import urllib.parse

from agentenv.config import paths
from agentenv.server.e2b.ports import Refused
from agentenv.server.e2b.tokens import envd_token

SCOPE_KEY = "agentenv.e2b_signed"  # in the ASGI scope of a request admitted by its signature (``files`` reads it)
MAX_SCAN = 10_000  # sandboxes tried for a signature that names none; past that the request must name its sandbox
OPERATIONS = {"GET": "read", "POST": "write"}
FIELDS = ("path", "username", "signature", "signature_expiration")


def signature(token: str, sandbox_id: str, path: str, operation: str, user: str, expiration: str | None) -> str:
    """The v1 signature the SDK makes for this sandbox's access token (``e2b.sandbox.signature``'s scheme)."""
    parts = [path, operation, user, envd_token(token, sandbox_id)] + ([expiration] if expiration is not None else [])
    digest = hashlib.sha256(":".join(parts).encode()).digest()
    return "v1_" + base64.b64encode(digest).rstrip(b"=").decode("ascii")


def signed(scope_path: str, query: bytes) -> bool:
    """Whether a request is a signed ``/files`` one (a ``signature`` in its query)."""
    return scope_path == "/files" and b"signature=" in query


def _fields(method: str, query: bytes) -> tuple[str, str, str, str, str | None]:
    """(operation, path, user, signature, expiration) of a signed request; Refused where it cannot be one."""
    operation = OPERATIONS.get(method)
    if operation is None:
        raise Refused(401, f"a signed URL is for GET (read) or POST (write) of /files, not {method[:16]}")
    pairs = urllib.parse.parse_qsl(query.decode("latin-1"), keep_blank_values=True)
    given: dict[str, str] = {}
    for k, v in pairs:
        if k in FIELDS and k in given:
            raise Refused(400, f"the query parameter {k} is given more than once")
        given[k] = v
    expiration = given.get("signature_expiration")
    if expiration is not None and not (expiration.lstrip("-").isdigit() and len(expiration) <= 20):
        raise Refused(401, f"signature_expiration {expiration[:24]!r} is not a Unix time")
    return operation, given.get("path", ""), given.get("username", ""), given.get("signature", ""), expiration


def _sandbox_ids() -> list[str]:
    ids = []
    for d in paths().sandboxes.iterdir():
        ids.append(d.name)
        if len(ids) > MAX_SCAN:
            raise Refused(401, f"over {MAX_SCAN} sandboxes here: a signed URL must name its sandbox "
                               "(the E2b-Sandbox-Id header, or its get_host name)")
    return ids


def sandbox_of(method: str, query: bytes, token: str, named: str | None = None) -> str:
    """The sandbox whose access token signed this ``/files`` request (only ``named`` where the request names
    one); Refused (401, envd's messages) if none did or the signature has expired."""
    operation, path, user, given, expiration = _fields(method, query)
    if not given:
        raise Refused(401, "missing signature query parameter")
    found = None
    for sid in [named] if named is not None else _sandbox_ids():
        want = signature(token, sid, path, operation, user, expiration)
        if hmac.compare_digest(want.encode(), given.encode()) and found is None:  # no early exit: all compared
            found = sid
    if found is None:
        raise Refused(401, f"invalid signature (not one of a {operation} of {path[:256]!r} as "
                           f"{user or 'the default user'!r} by this sandbox's access token)")
    if expiration is not None and int(expiration) < time.time():
        raise Refused(401, "signature is already expired")
    return found
