"""The env-server fleet on Ray, the serving side: ``up`` starts one ``agentenv serve`` per alive Ray node that has
none, as a detached named actor pinned to its node (``EnvServer``); ``down`` stops them (``agentenv cluster``).
Clients find them through ``agentenv.remote.fleet``. Servers bind loopback unless ``host="node"``.
"""

from __future__ import annotations

import inspect
import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

from agentenv.errors import AgentEnvError, Unauthorized
from agentenv.remote.fleet import (
    ANSWER_TIMEOUT,
    DEFAULT_PORT,
    NAMESPACE,
    NODE,
    PREFIX,
    FleetError,
    actors,
    ask,
    fingerprint,
    handle_of,
    joined,
)

log = logging.getLogger(__name__)

START_TIMEOUT = 120.0           # seconds a new server has to come up (Ray may first start a worker process)


def _server_options() -> set[str]:
    from agentenv.server import create_app

    return {p for p in inspect.signature(create_app).parameters if p != "token"}


def _check_host(host: str) -> None:
    if host == NODE:
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        raise FleetError(f"host {host!r} is neither loopback nor {NODE!r}: one address cannot be bound on every node",
                         fix=f"use 127.0.0.1 (clients on each node) or {NODE!r} (each server binds its node's "
                             "address, reachable from the other hosts)")


class EnvServer:
    """``agentenv serve`` inside a Ray actor on one node: uvicorn in a thread of the actor's process, so the server
    goes when the actor does. ``info()`` publishes it; ``stop()`` ends it."""

    def __init__(self, token: str, host: str, port: int, server: Mapping[str, Any], settings: Mapping[str, Any]) -> None:
        import ray
        import uvicorn

        from agentenv.server import create_app, uvicorn_config

        ctx = ray.get_runtime_context()
        self.node_id, self.node_ip = ctx.get_node_id(), ray.util.get_node_ip_address()
        app = create_app(token, **server)  # bad settings fail here, before a port is taken
        self.service = app.state.service
        bind = self.node_ip if host == NODE else host
        family = socket.AF_INET6 if ":" in bind else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((bind, port))
        except OSError as e:
            self.sock.close()
            raise FleetError(f"node {self.node_id} cannot bind {bind}:{port}: {e.strerror}",
                             fix="pick a free --port (0: any free port)") from e
        self.port = int(self.sock.getsockname()[1])
        self.url = f"http://{f'[{bind}]' if family == socket.AF_INET6 else bind}:{self.port}"
        self.token_ref = fingerprint(token)
        self.settings = dict(settings)
        self.server = uvicorn.Server(uvicorn_config(app, bind, self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="agentenv-fleet-server", daemon=True)
        self.thread.start()

    def ready(self, limit: float = 60.0) -> bool:
        """Whether uvicorn has started: waited on for up to ``limit`` seconds, until it has or its thread ended."""
        deadline = time.monotonic() + limit
        while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
            self.thread.join(0.05)
        return bool(self.server.started)

    def info(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "node_ip": self.node_ip, "url": self.url, "token": self.token_ref,
                "capacity": self.service.capacity().model_dump(), "settings": self.settings,
                "serving": self.thread.is_alive()}

    def stop(self, close_sandboxes: bool = False) -> list[str]:
        """Stop serving (the lifespan's shutdown runs: reaper, warm pool); with ``close_sandboxes``, close every
        sandbox of this node after; returns the ids closed."""
        self.server.should_exit = True
        self.thread.join(ANSWER_TIMEOUT)
        closed: list[str] = []
        if close_sandboxes:
            from agentenv import Sandbox

            for sb in Sandbox.list():
                try:
                    sb.close()
                    closed.append(sb.id)
                except AgentEnvError as e:
                    log.warning("cannot close %s: %s", sb.id, e)
        return closed


# --- starting and stopping the fleet -------------------------------------------------------------------


def up(token: str, *, address: str | None = None, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
       cpus: float = 0.0, home: str | None = None, server: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """Start an env server on every alive Ray node that has none (idempotent: one already up with the same
    settings is kept; one with other settings is refused); returns every server's ``info()`` plus ``started``.

    ``host``: loopback (default) or ``"node"`` (each node's address); ``port``: 0 takes any free port; ``cpus``:
    what Ray reserves for each; ``home``: the agentenv home on each node (``{node}`` becomes the node id, for
    simulated nodes on one machine); ``server``: ``create_app`` options (quotas, e2b, ...)."""
    if not token:
        raise Unauthorized("the fleet's servers need a token", fix="pass --token-file or set $AGENTENV_TOKEN")
    _check_host(host)
    server = dict(server or {})
    unknown = set(server) - _server_options()
    if unknown:
        raise FleetError(f"unknown server option(s) {sorted(unknown)}", fix=f"use {sorted(_server_options())}")
    if not 0 <= port < 65536:
        raise FleetError(f"port {port} is out of range", fix="give 0 (any free port) to 65535")
    with joined(address) as ray:
        return _up(ray, token, host, port, cpus, home, server)


def _up(ray: Any, token: str, host: str, port: int, cpus: float, home: str | None, server: dict[str, Any]
        ) -> list[dict[str, Any]]:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    settings = {"host": host, "port": port, "cpus": cpus, "home": home, "token": fingerprint(token), **server}
    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    for name in actors(ray):  # servers of nodes that left the cluster
        if name[len(PREFIX):] not in alive and (h := handle_of(ray, name)) is not None:
            ray.kill(h, no_restart=True)
    remote = ray.remote(EnvServer)
    out, fresh = [], []
    for node in sorted(alive):
        name = PREFIX + node
        h = handle_of(ray, name)
        if h is not None:
            have = ask(ray, h)
            if have is not None and have["serving"]:
                if have["settings"] != settings:
                    raise FleetError(f"node {node} already runs a fleet server with other settings "
                                     f"({have['settings']})", fix="run `agentenv cluster down` first")
                out.append({**have, "started": False})
                continue
            ray.kill(h, no_restart=True)  # not answering, or its server died: replace it
        env = {"AGENTENV_HOME": home.replace("{node}", node)} if home else {}
        h = remote.options(name=name, namespace=NAMESPACE, lifetime="detached", num_cpus=cpus, max_restarts=0,
                           max_concurrency=4, runtime_env={"env_vars": env} if env else None,
                           scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
                           ).remote(token, host, port, server, settings)
        fresh.append((node, h))
    for node, h in fresh:
        try:
            ok = ray.get(h.ready.remote(), timeout=START_TIMEOUT)
        except Exception as e:  # noqa: BLE001 - one clear error, and the half-started server taken away
            ray.kill(h, no_restart=True)
            raise FleetError(f"the env server on node {node} did not start: {type(e).__name__}: {e}") from None
        info = ask(ray, h) if ok else None
        if info is None:
            ray.kill(h, no_restart=True)
            raise FleetError(f"the env server on node {node} did not start serving")
        out.append({**info, "started": True})
    return sorted(out, key=lambda i: i["node_id"])


def down(*, address: str | None = None, close_sandboxes: bool = False) -> list[dict[str, Any]]:
    """Stop every fleet server (with ``close_sandboxes``, close each node's sandboxes too) and remove its actor;
    returns ``{node_id, url, closed}`` of each."""
    with joined(address) as ray:
        return [_stop(ray, name, close_sandboxes) for name in actors(ray)]


def _stop(ray: Any, name: str, close_sandboxes: bool) -> dict[str, Any]:
    node = name[len(PREFIX):]
    h = handle_of(ray, name)
    if h is None:
        return {"node_id": node, "url": None, "closed": []}
    info = ask(ray, h) or {}
    closed: list[str] = []
    try:
        closed = list(ray.get(h.stop.remote(close_sandboxes), timeout=ANSWER_TIMEOUT * 2))
    except Exception as e:  # noqa: BLE001 - the actor is killed either way
        log.warning("fleet server %s did not stop cleanly: %s: %s", name, type(e).__name__, e)
    ray.kill(h, no_restart=True)
    return {"node_id": node, "url": info.get("url"), "closed": closed}


