"""What the E2B SDK is told about a sandbox and how its in-sandbox calls prove who they are.

The SDK sends the API key only to the control plane; calls into a sandbox carry the ``envdAccessToken``
(``X-Access-Token``) or ``trafficAccessToken`` (``E2B-Traffic-Access-Token``) that create/connect returned.
Both are an HMAC of the sandbox id under the server's token: nothing to store, valid across restarts,
and useless for any other sandbox.
"""

from __future__ import annotations

import hashlib
import hmac

CLIENT_ID = "agentenv"
# what the SDK keys features on: 0.5.7 = stdin control, octet-stream uploads, recursive watch; 0.6.2 = file
# metadata (``user.e2b.*`` xattrs); 0.6.3 = watch events with their entry; 0.6.4 = watching network mounts
ENVD_VERSION = "0.6.4"
ENVD_PORT, INTERPRETER_PORT = 49983, 49999


def access_token(token: str, sandbox_id: str) -> str:
    """The per-sandbox token for in-sandbox calls."""
    return hmac.new(token.encode(), f"e2b-envd:{sandbox_id}".encode(), hashlib.sha256).hexdigest()


def valid(token: str, sandbox_id: str, given: str) -> bool:
    return hmac.compare_digest(access_token(token, sandbox_id).encode(), given.encode())
