"""Shared pieces of the rollout unit tests: a scripted policy in process, a tiny forkable env on the fake backend."""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gymnasium
import httpx
import uvicorn

from envs.base import SandboxEnv
from envs.spaces import UnicodeText
from policy.client import PolicyClient
from rollout import scripted
from rollout.agent import LocalTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "envs"))
from fakes import FakeBackend  # noqa: E402, F401  (re-exported for the tests)

TOK = LocalTokenizer()
FORKY = "test/Forky-v0"


def solve_calc(prompt: str, turn: int) -> str:
    if turn == 0:
        return "Let me compute." + scripted.tool_call("calculator", {"expression": "37 * 1234 - 5678"})
    return scripted.tool_call("answer", {"answer": "39980"})


def bash_then_submit(prompt: str, turn: int) -> str:
    return scripted.tool_call("bash", {"command": "echo work" if turn == 0 else "submit"})


class FlakyTransport(httpx.AsyncBaseTransport):
    """The scripted app, until ``down`` is set: then every request fails to connect (the server went away)."""

    def __init__(self, app: Any, fail_after: int | None = None) -> None:
        self.inner = httpx.ASGITransport(app=app)
        self.fail_after, self.calls, self.down = fail_after, 0, False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/completions"):
            self.calls += 1
            if self.fail_after is not None and self.calls > self.fail_after:
                self.down = True
        if self.down:
            raise httpx.ConnectError("connection refused")
        return await self.inner.handle_async_request(request)


def policy_factory(script, transport: httpx.AsyncBaseTransport | None = None):
    app = scripted.create_app(script, TOK)
    tr = transport or httpx.ASGITransport(app=app)
    if isinstance(tr, FlakyTransport):
        tr.inner = httpx.ASGITransport(app=app)

    def make() -> PolicyClient:
        return PolicyClient("http://scripted", transport=tr, max_retries=0, backoff=0.01)

    return make


class ForkyEnv(SandboxEnv[str]):
    """A shell-like env on any backend: its sandbox starts at reset with a file holding the task; a bash call runs
    (``submit`` ends with reward 1); ``failures`` (a shared list holding one count) makes that many steps raise."""

    def __init__(self, api: Any = None, max_steps: int | None = 5, failures: list[int] | None = None,
                 reset_failures: list[int] | None = None) -> None:
        super().__init__(api=api, max_steps=max_steps)
        self.observation_space = UnicodeText(10_000)
        self.action_space = UnicodeText(10_000)
        self.failures = failures if failures is not None else [0]
        self.reset_failures = reset_failures if reset_failures is not None else [0]

    def _resolve_task(self, ref: Any) -> str:
        return str(ref or "t0")

    def _task_id(self, task: str) -> str:
        return task

    def _start_sandbox(self, task: str):
        if self.reset_failures[0] > 0:
            self.reset_failures[0] -= 1
            raise ConnectionError("the image is gone")
        sb = self.api.Sandbox.create("fake")
        sb.write_file("/testbed/state", f"task {task}")
        return sb

    def _first_observation(self, task: str) -> str:
        return f"Do task {task}."

    def _info(self) -> dict[str, Any]:
        return {"task": self.task}

    def _act(self, action: Any) -> tuple[str, float, bool, dict[str, Any]]:
        if self.failures[0] > 0:
            self.failures[0] -= 1
            raise ConnectionError("the sandbox went away")
        if action == "submit":
            return "submitted", 1.0, True, {}
        return self.box().exec(str(action)).stdout, 0.0, False, {}


if FORKY not in gymnasium.registry:
    gymnasium.register(FORKY, entry_point=ForkyEnv)


@contextlib.contextmanager
def serve_app(app: Any) -> Iterator[str]:
    """``app`` on a free loopback port in a thread (uvicorn); yields its URL, stops it after."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            if server.started:
                break
            time.sleep(0.05)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)
