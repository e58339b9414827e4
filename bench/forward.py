"""A forward's overhead: an HTTP round trip from inside a sandbox through ``Sandbox.forward`` against the same
request made straight to the server over the host's loopback, in the same run.

What: an HTTP/1.1 server on the host's loopback (``http.server``, threads) answering a small JSON body (an LLM
gateway's non-streamed reply is about that) or 1 MiB. One client script (``http.client``, timing each request with
``time.perf_counter``) runs twice per mode, alternated so that the machine's load falls on both alike: inside a
sandbox without network (cpus=2) against ``127.0.0.1:8000``, its forward, and on the host against the server
directly. Modes: ``new`` (a connection per request: the forward's per-connection setup, a waiting keeper connection
taken and the target's connect, is in each sample), ``keepalive`` (one connection, many requests: the relay's
per-byte cost alone), ``1mib`` (keep-alive, a 1 MiB answer). Ratios: forward median / direct median.
Results: ``bench/results/forward.json``.

    .venv/bin/python -m bench.forward [--requests 300] [--rounds 3] [--output F]
"""

from __future__ import annotations

import argparse
import http.server
import json
import subprocess
import sys
import threading

import agentenv
from bench.harness import Report, Row, add_output_arg, print_table

PORT = 8000  # in the sandbox
MODES = {"new": "/small", "keepalive": "/small", "1mib": "/big"}
SMALL = json.dumps({"id": "chatcmpl-1", "choices": [{"message": {"role": "assistant", "content": "x" * 120}}]}).encode()
BIG = bytes(range(256)) * 4096
CLIENT = """
import http.client, json, sys, time
port, mode, path, n = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
out = []
conn = None
for i in range(n + 5):
    if conn is None or mode == "new":
        if conn is not None:
            conn.close()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    t = time.perf_counter()
    conn.request("GET", path)
    r = conn.getresponse()
    body = r.read()
    dt = time.perf_counter() - t
    assert r.status == 200 and body, (r.status, len(body))
    if i >= 5:  # the first few warm the path up
        out.append(dt)
print(json.dumps(out))
"""


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # as servers of HTTP APIs do: its header and body writes go out at once

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = BIG if self.path == "/big" else SMALL
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _samples(out: str) -> list[float]:
    return [float(x) for x in json.loads(out)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--requests", type=int, default=300, help="timed requests per round and mode")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each running every mode both ways")
    add_output_arg(ap, "forward")
    args = ap.parse_args(argv)
    report = Report("forward", {k: v for k, v in vars(args).items() if k != "output"})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host_port = int(server.server_address[1])
    try:
        with agentenv.Sandbox.create(cpus=2.0) as sb:
            sb.forward(PORT, ("127.0.0.1", host_port))
            sb.write_file("/tmp/client.py", CLIENT)
            for _ in range(args.rounds):
                for mode, path in MODES.items():
                    r = sb.exec(f"python3 /tmp/client.py {PORT} {mode} {path} {args.requests}", timeout=600)
                    if r.exit_code != 0:
                        report.result(f"forward.{mode}").fail(r.stderr[-500:])
                        continue
                    for s in _samples(r.stdout):
                        report.result(f"forward.{mode}").add(s)
                    direct = subprocess.run([sys.executable, "-c", CLIENT, str(host_port), mode, path,
                                             str(args.requests)], capture_output=True, text=True, check=True)
                    for s in _samples(direct.stdout):
                        report.result(f"direct.{mode}").add(s)
    except Exception as e:  # noqa: BLE001 - recorded, the report is still written
        report.fatal = f"{type(e).__name__}: {e}"
    finally:
        server.shutdown()
        server.server_close()
    rows = []
    labels = {"new": "a connection per request", "keepalive": "keep-alive, small reply", "1mib": "keep-alive, 1 MiB"}
    for mode, label in labels.items():
        x = report.add_ratio(f"{mode} forward/direct", f"forward.{mode}", f"direct.{mode}")
        rows.append(Row(label, [report.results.get(f"direct.{mode}"), report.results.get(f"forward.{mode}")], x))
    print_table("An HTTP round trip, ms (ratio = through a sandbox's forward / straight over the host's loopback, same "
                "run)", rows, sides=("direct", "forward"))
    report.print_errors()
    report.write(args.output)
    return 1 if report.fatal or report.errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
