"""What a sandbox reaches: a probe run inside it that tries TCP connections and reports each outcome."""

from __future__ import annotations

import json
import subprocess
from typing import Any

_PROBE = r"""
import json, socket, sys
out = {}
for target in json.loads(sys.argv[1]):
    host, port = target.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(b"GET / HTTP/1.0\r\n\r\n")
            s.shutdown(socket.SHUT_WR)
            s.settimeout(5)
            data = b""
            while chunk := s.recv(65536):
                data += chunk
            lines = data.decode(errors="replace").strip().splitlines()
            out[target] = "open " + (lines[-1] if lines else "")
    except OSError as e:
        out[target] = type(e).__name__
print(json.dumps(out))
"""


def probe(sb: Any, targets: list[str]) -> dict[str, str]:
    """``{"host:port": "open <last line of the answer>" | the error's class name}`` for each target, from inside
    ``sb``. A refused connection is ConnectionRefusedError at once (the rules reject, they do not drop)."""
    r = sb.exec(f"python3 -c {_quote(_PROBE)} {_quote(json.dumps(targets))}", timeout=120)
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def reached(result: dict[str, str]) -> list[str]:
    return sorted(t for t, v in result.items() if v.startswith("open"))


def host_addresses() -> list[str]:
    """Every IPv4 address of this host's own interfaces (loopback, the bridge's, eth0's, docker0's...)."""
    out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, check=True).stdout
    return sorted({line.split()[3].split("/")[0] for line in out.splitlines()})


def _quote(s: str) -> str:
    return "'" + s.replace("'", "'\"'\"'") + "'"
