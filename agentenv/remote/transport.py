"""The HTTP connection to one server, under ``agentenv.remote.client.Client``: what every call shares.

Connections are pooled (httpx, keep-alive), bodies are msgpack (``agentenv.wire``) and the token goes with each
request. A call that could not reach the server is retried (a connection that was never made cannot have done
anything); a call that may have reached it is retried only when it is idempotent. Every call has a timeout; a
server that does not answer raises ``ConnectionLost``, and a server's error comes back as the typed error it
names (``errors.from_wire``). The sandboxes and snapshots built on these calls are ``client.py``'s.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Generator
from typing import Any, cast

import httpx

from agentenv import wire
from agentenv.api import OutputCallback
from agentenv.errors import ConnectionLost, from_wire

DEFAULT_TIMEOUT = 120.0
CONNECT_TIMEOUT = 5.0
_RETRY_ALWAYS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
_RETRY_IDEMPOTENT = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError, httpx.ReadTimeout)


class Transport:
    """A pool of connections to the server at ``url``, with the token; ``down`` once it stopped answering."""

    def __init__(self, url: str, token: str, *, timeout: float = DEFAULT_TIMEOUT, retries: int = 3) -> None:
        self.url = url.rstrip("/")
        self.token = token  # handed to another server only to pull a snapshot from this one (Pool.restore)
        self.timeout, self.retries = timeout, retries
        self.down = False
        self._http = httpx.Client(
            base_url=self.url, timeout=httpx.Timeout(timeout, connect=CONNECT_TIMEOUT),
            headers={"Authorization": f"Bearer {token}", "Accept": wire.MSGPACK},
            limits=httpx.Limits(max_connections=128, max_keepalive_connections=64, keepalive_expiry=4.0))

    def close(self) -> None:
        self._http.close()  # the connection pool; sandboxes on the server are not touched

    def request(self, method: str, path: str, body: Any = None, *, params: dict[str, Any] | None = None,
                content: bytes | None = None, timeout: float | None = None, idempotent: bool = False) -> Any:
        """One call, retried on connection errors; the decoded reply, or the server's error re-raised."""
        headers = {}
        if body is not None:
            content = wire.encode(body, True)
            headers["Content-Type"] = wire.MSGPACK
        elif content is not None:
            headers["Content-Type"] = "application/octet-stream"
        t = httpx.Timeout(self.timeout if timeout is None else timeout, connect=CONNECT_TIMEOUT)
        r = self._send(lambda: self._http.request(method, path, content=content, params=params, headers=headers,
                                                  timeout=t), idempotent)
        return self._decode(r)

    def _send(self, call: Callable[[], httpx.Response], idempotent: bool) -> httpx.Response:
        delay = 0.05
        for attempt in range(self.retries + 1):
            try:
                r = call()
                self.down = False
                return r
            except _RETRY_ALWAYS + _RETRY_IDEMPOTENT as e:
                retry = isinstance(e, _RETRY_ALWAYS) or idempotent
                if not retry or attempt == self.retries:
                    self.down = isinstance(e, _RETRY_ALWAYS)
                    raise ConnectionLost(f"the server at {self.url} does not answer ({type(e).__name__}: {e})",
                                         fix="check that 'agentenv serve' runs there and is reachable") from e
                time.sleep(delay)
                delay *= 2
            except httpx.TimeoutException as e:
                raise ConnectionLost(f"the server at {self.url} did not answer in time ({e})") from e
        raise AssertionError("unreachable")

    @staticmethod
    def _decode(r: httpx.Response) -> Any:
        ctype = r.headers.get("content-type", "")
        if ctype.startswith("application/octet-stream"):
            data: Any = r.content
        elif r.content:
            try:
                data = wire.decode(r.content, ctype)
            except wire.WireError:
                data = {"message": r.text[:500]}
        else:
            data = None
        if r.status_code >= 400:
            raise from_wire(data, r.status_code)
        return data

    def exec_stream(self, sandbox_id: str, body: dict[str, Any], on_output: OutputCallback,
                    timeout: float | None) -> dict[str, Any]:
        """Run a command with its output passed to ``on_output`` as it comes; returns the result fields."""
        with contextlib.closing(self.stream(f"/v1/sandboxes/{sandbox_id}/exec/stream", body, timeout)) as frames:
            for item in frames:
                if "stream" in item:
                    on_output(item["stream"], item["data"])
                elif "result" in item:
                    return cast(dict[str, Any], item["result"])
        raise ConnectionLost(f"the server at {self.url} ended the stream without a result")

    def stream(self, path: str, body: dict[str, Any], timeout: float | None) -> Generator[dict[str, Any], None, None]:
        """POST ``body`` to a streaming route: its frames as they come, an error frame raised (not retried once
        the request may have reached the server). Close it to drop the connection."""
        t = httpx.Timeout(timeout, connect=CONNECT_TIMEOUT)
        headers = {"Content-Type": wire.MSGPACK}

        def call() -> httpx.Response:
            req = self._http.build_request("POST", path, content=wire.encode(body, True), headers=headers, timeout=t)
            return self._http.send(req, stream=True)

        r = self._send(call, idempotent=False)
        try:
            if r.status_code >= 400:
                r.read()
                self._decode(r)
            for item in wire.read_frames(r.iter_bytes(), wire.is_msgpack(r.headers.get("content-type"))):
                if "error" in item:
                    raise from_wire(item["error"], 500)
                yield item
        except (httpx.ReadError, httpx.RemoteProtocolError, httpx.ReadTimeout) as e:
            raise ConnectionLost(f"the server at {self.url} broke off the stream ({type(e).__name__}: {e})") from e
        finally:
            r.close()
