"""What the E2B SDK is told about a sandbox and how its in-sandbox calls prove who they are.

The SDK sends the API key only to the control plane; calls into a sandbox carry one of the two tokens that
create/connect returned, each in its own header, and each opens its own routes:
- ``envdAccessToken`` (``X-Access-Token``): the sandbox's owner's. envd's port (commands, files, watches) and the
  code interpreter's, whose ``/execute`` runs code as envd's commands do.
- ``trafficAccessToken`` (``E2B-Traffic-Access-Token``): what a user gives whoever may reach the sandbox's web
  ports (``allowPublicTraffic`` off). Every port but envd's; on the interpreter's, its contexts only (what the
  code-interpreter SDK sends it to: it sends both tokens to ``/execute``), never ``/execute``.

Each is an HMAC of the sandbox id under the server's token with a label of its own (``e2b-envd``,
``e2b-traffic``): nothing to store, valid across restarts, useless for any other sandbox, and neither tells
anything of the other or of the server's token.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Literal

CLIENT_ID = "agentenv"
# what the SDK keys features on: 0.5.7 = stdin control, octet-stream uploads, recursive watch; 0.6.2 = file
# metadata (``user.e2b.*`` xattrs); 0.6.3 = watch events with their entry; 0.6.4 = watching network mounts
ENVD_VERSION = "0.6.4"
ENVD_PORT, INTERPRETER_PORT = 49983, 49999

Kind = Literal["envd", "traffic"]
HEADERS: dict[Kind, bytes] = {"envd": b"x-access-token", "traffic": b"e2b-traffic-access-token"}
LABELS: dict[Kind, str] = {"envd": "e2b-envd", "traffic": "e2b-traffic"}  # envd's is the one tokens always had


def token_of(kind: Kind, token: str, sandbox_id: str) -> str:
    """The sandbox's ``kind`` token under the server's ``token``."""
    return hmac.new(token.encode(), f"{LABELS[kind]}:{sandbox_id}".encode(), hashlib.sha256).hexdigest()


def envd_token(token: str, sandbox_id: str) -> str:
    """The ``envdAccessToken``: envd's routes and the interpreter's (signed file URLs are made with it)."""
    return token_of("envd", token, sandbox_id)


def traffic_token(token: str, sandbox_id: str) -> str:
    """The ``trafficAccessToken``: the sandbox's web ports and the interpreter's contexts."""
    return token_of("traffic", token, sandbox_id)


def opens(port: int) -> tuple[Kind, ...]:
    """The tokens that may open a request for ``port`` (the interpreter's ``/execute`` then asks for envd's); a
    number that is no TCP port takes either, since it opens nothing (its request is told so: a 502)."""
    if port == ENVD_PORT:
        return ("envd",)
    return ("envd", "traffic") if port == INTERPRETER_PORT or not 0 < port < 65536 else ("traffic",)


def sent(headers: dict[bytes, bytes]) -> bool:
    """Whether a request carries a token of a sandbox at all (a wrong one counts against its sender:
    ``policy.authlimit``)."""
    return any(headers.get(h) for h in HEADERS.values())


def presented(headers: dict[bytes, bytes], token: str, sandbox_id: str, kinds: tuple[Kind, ...]) -> Kind | None:
    """The first of ``kinds`` whose own header holds that token of the sandbox (compared in constant time)."""
    for kind in kinds:
        given = headers.get(HEADERS[kind], b"")
        if given and hmac.compare_digest(token_of(kind, token, sandbox_id).encode(), given):
            return kind
    return None
