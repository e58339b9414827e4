"""Finding the env-server fleet through Ray (``servers``, ``urls``, ``agentenv.Pool.from_ray``) instead of
hand-kept URL lists: one ``agentenv serve`` per alive Ray node, each a detached named actor pinned to its node,
started and stopped by ``agentenv.server.fleet`` (``agentenv cluster up/down``).

Each server publishes its URL, its node, its capacity and a fingerprint of its token (never the token: a client
brings its own and checks it against the fingerprint). Ray is imported only when one of these is called.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Iterator
from typing import Any

from agentenv.errors import AgentEnvError, Unauthorized

log = logging.getLogger(__name__)

NAMESPACE = "agentenv"          # the Ray namespace of the fleet's actors
PREFIX = "env-server-"          # actor name: PREFIX + node id
NODE = "node"                   # host= value: bind the node's own address
DEFAULT_PORT = 8700
ANSWER_TIMEOUT = 30.0           # seconds a server actor has to answer info() / stop()


class FleetError(AgentEnvError):
    """The fleet cannot do what was asked (no Ray cluster, no server answers, a server up with other settings)."""


def fingerprint(token: str) -> str:
    """What the fleet publishes of its token: enough to tell a wrong token, useless to call a server with."""
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()[:16]


# --- finding the fleet through Ray ---------------------------------------------------------------------


@contextlib.contextmanager
def joined(address: str | None) -> Iterator[Any]:
    """The ``ray`` module joined to the cluster at ``address`` ("auto": the one on this machine); a process that
    was not a Ray driver before leaves the cluster again after."""
    try:
        import ray
    except ImportError as e:
        raise FleetError(f"the fleet needs Ray ({e})", fix="pip install -e '.[rl]' in the checkout") from None
    if ray.is_initialized():
        yield ray
        return
    try:
        ray.init(address=address or "auto", log_to_driver=False, logging_level=logging.WARNING,
                 configure_logging=False)
    except ConnectionError as e:
        raise FleetError(f"no Ray cluster at {address or 'auto'}: {e}",
                         fix="start one (ray start --head) or pass --ray-address") from None
    try:
        yield ray
    finally:
        ray.shutdown()


def actors(ray: Any) -> list[str]:
    """Names of the fleet's actors (one per node: ``PREFIX`` + node id)."""
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a.get("namespace") == NAMESPACE and str(a.get("name", "")).startswith(PREFIX))


def handle_of(ray: Any, name: str) -> Any | None:
    """The actor named ``name`` of the fleet, or None when it is gone."""
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:  # gone meanwhile
        return None


def ask(ray: Any, handle: Any, timeout: float = ANSWER_TIMEOUT) -> dict[str, Any] | None:
    """A server's ``info()``, or None when it does not answer in ``timeout`` seconds."""
    try:
        return dict(ray.get(handle.info.remote(), timeout=timeout))
    except Exception as e:  # noqa: BLE001 - a server that does not answer is reported as such
        log.warning("a fleet server did not answer: %s: %s", type(e).__name__, e)
        return None


def servers(*, address: str | None = None) -> list[dict[str, Any]]:
    """``info()`` of every fleet server that answers (URL, node, capacity, token fingerprint), by node id."""
    with joined(address) as ray:
        found = [ask(ray, h) for name in actors(ray) if (h := handle_of(ray, name)) is not None]
    return sorted((i for i in found if i is not None and i["serving"]), key=lambda i: i["node_id"])


def urls(*, address: str | None = None) -> dict[str, str]:
    """Node id -> URL of its fleet server (what ``RolloutConfig.env_urls`` takes)."""
    return {i["node_id"]: i["url"] for i in servers(address=address)}


def check_token(infos: list[dict[str, Any]], token: str) -> None:
    """Unauthorized when ``token`` is not the one the fleet's servers were started with."""
    wrong = [i["url"] for i in infos if i["token"] != fingerprint(token)]
    if wrong:
        raise Unauthorized(f"the token is not the one of the fleet servers at {', '.join(wrong)}",
                           fix="use the token `agentenv cluster up` was given (--token-file / $AGENTENV_TOKEN)")
