"""Fixtures of the rollout integration tests: scripted OpenAI-compatible policies served over HTTP, task files (the
two-node Ray cluster, ``ray_cluster``, is the whole suite's: ../conftest.py)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import uvicorn

from policy.tokenizer import load_tokenizer
from rollout import scripted
from rollout.agent import LocalTokenizer
from rollout.harnesses import GatewayServer

TOK = LocalTokenizer()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Served:
    """A scripted policy on a loopback port; ``delay`` seconds before each completion; ``stop()`` takes it away."""

    def __init__(self, script: scripted.Script) -> None:
        self.delay = 0.0
        inner = scripted.create_app(script, TOK)
        self.app = inner                 # its state.calls counts the generations asked for

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope.get("type") == "http" and scope.get("path", "").endswith("/completions") and self.delay:
                await asyncio.sleep(self.delay)
            await inner(scope, receive, send)

        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error",
                                                    timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        for _ in range(400):
            if self.server.started:
                break
            time.sleep(0.025)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture()
def serve_policy() -> Iterator[Callable[[scripted.Script], Served]]:
    made: list[Served] = []

    def start(script: scripted.Script) -> Served:
        made.append(Served(script))
        return made[-1]

    yield start
    for s in made:
        s.stop()



@pytest.fixture()
def serve_gateway() -> Iterator[Callable[..., GatewayServer]]:
    """The LLM gateway (``rollout.gateway``) in front of an engine URL, on a loopback port of its own."""
    made: list[GatewayServer] = []

    def start(upstream_url: str, token: str | None = None) -> GatewayServer:
        made.append(GatewayServer(upstream_url, token, load_tokenizer()))
        return made[-1]

    yield start
    for g in made:
        g.close()
