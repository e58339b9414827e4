"""Real servers on free loopback ports for the tests: the environment server (in a thread or a child process) and
the k3-mini policy server (``k3_mini_server``)."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from agentenv.server import create_app, uvicorn_config

TOKEN = "test-token-" + "x" * 20


def write_token_file(folder: Path) -> Path:
    """A file holding ``TOKEN`` (what ``agentenv serve --token-file`` reads)."""
    f = folder / "token"
    f.write_text(TOKEN + "\n")
    return f


def write_transfer_key(folder: Path) -> Path:
    """A file (0600) holding a new key, for servers that exchange snapshots (``agentenv serve --transfer-key``)."""
    f = folder / "shared-transfer.key"
    f.write_text(secrets.token_hex(32) + "\n")
    f.chmod(0o600)
    return f


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, proc: subprocess.Popen[bytes] | None = None, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"the server at {url} did not come up")


@contextmanager
def threaded_app(app: Any) -> Iterator[str]:
    """uvicorn serving ``app`` on a free loopback port in a thread of this process; yields its url once it
    listens and stops it after."""
    port = free_port()
    server = uvicorn.Server(uvicorn_config(app, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="agentenv-test-server", daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started or not thread.is_alive(), "the server listening")
        assert server.started, "the server did not start"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@contextmanager
def threaded_server(token: str = TOKEN, **app_kwargs: object) -> Iterator[str]:
    """uvicorn serving ``create_app`` in a thread of this process; yields its url and stops it after."""
    with threaded_app(create_app(token, **app_kwargs)) as url:  # type: ignore[arg-type]
        wait_healthy(url)
        yield url


@contextmanager
def e2b_server() -> Iterator[str]:
    """A threaded server with the E2B SDK's environment variables pointing at it (restored after)."""
    keys = ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "E2B_DOMAIN", "E2B_DEBUG")
    saved = {k: os.environ.get(k) for k in keys}
    with threaded_server() as url:
        os.environ.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY=TOKEN)
        os.environ.pop("E2B_DEBUG", None)
        try:
            yield url
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


@contextmanager
def e2b_domain_server(folder: Path, domain: str) -> Iterator[str]:
    """``agentenv serve --domain`` as a process (``get_host`` names route), the SDK's variables pointing at it."""
    port = free_port()
    proc = start_server_process(port, write_token_file(folder), "--domain", domain)
    url = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "E2B_DEBUG")}
    os.environ.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY=TOKEN)
    os.environ.pop("E2B_DEBUG", None)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def start_server_process(port: int, token_file: Path, *extra: str, env: dict[str, str] | None = None,
                         stdout: int = subprocess.DEVNULL) -> subprocess.Popen[bytes]:
    """``agentenv serve`` as a child process (same $AGENTENV_HOME, plus ``env``), waited for until it answers."""
    code = "import sys; from agentenv.cli import main; sys.argv[0] = 'agentenv'; main()"
    proc = subprocess.Popen([sys.executable, "-c", code, "serve", "--port", str(port), "--token-file", str(token_file),
                             "--reap-interval", "0.5", *extra], env={**os.environ, **(env or {})},
                            stdout=stdout, stderr=subprocess.PIPE)
    wait_healthy(f"http://127.0.0.1:{port}", proc)
    return proc


@contextmanager
def separate_servers(quotas: tuple[str, ...], prefix: str) -> Iterator[tuple[list[str], list[Path]]]:
    """``agentenv serve`` processes, the i-th with ``--max-sandboxes quotas[i]`` and a home of its own (its own store,
    volume and uid leases; the same Docker engine), all with one transfer key; yields their urls and homes, then
    stops them and fails on anything a home kept."""
    import shutil
    import signal

    from .conftest import cleanup, leaked

    homes = [Path(tempfile.mkdtemp(prefix=prefix, dir="/var/tmp")) for _ in quotas]
    token, key = write_token_file(homes[0]), write_transfer_key(homes[0])
    procs: list[subprocess.Popen[bytes]] = []
    ports = [free_port() for _ in homes]
    try:
        for home, port, quota in zip(homes, ports, quotas, strict=True):
            procs.append(start_server_process(port, token, "--max-sandboxes", quota, "--transfer-key", str(key),
                                              env={"AGENTENV_HOME": str(home)}))
        yield [f"http://127.0.0.1:{p}" for p in ports], homes
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=30)
        left = {}
        for home in homes:
            left[str(home)] = leaked(home)
            cleanup(home)
            shutil.rmtree(home, ignore_errors=True)
        assert not any(left.values()), f"the servers' homes kept: {left}"


@contextmanager
def k3_mini_server(token: str, ep: int = 1, max_model_len: int = 256, timeout: float = 180.0,
                   extra_args: list[str] | None = None) -> Iterator[Any]:
    """``agentenv policy serve --preset k3-mini`` (random weights, ``ep`` ranks, ``extra_args`` more) as a child
    process, healthy; yields its ``EngineSpec`` and stops it on exit."""
    from policy.engines import EngineSpec, start
    from policy.engines import wait_healthy as policy_healthy

    spec = EngineSpec("agentenv", "k3-mini", port=free_port(), data_parallel_size=ep, api_key=token,
                      max_model_len=max_model_len, extra_args=list(extra_args or []))
    proc = start(spec)
    try:
        policy_healthy(spec.base_url, timeout=timeout, interval=0.5)
        yield spec
    finally:
        proc.terminate()
        proc.wait(60)


def wait_for(check: Callable[[], object], what: str, limit: float = 30.0) -> None:
    """Wait on state: until ``check()`` is true, failing with ``what`` after ``limit`` seconds."""
    deadline = time.monotonic() + limit
    while not check():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)
