"""What a rollout run owns, and how it is cleaned up: every sandbox and snapshot a worker makes carries the labels
``agentenv.rollout.run`` and ``agentenv.rollout.worker`` (and sandboxes a TTL), so that what a worker, or the driver,
left behind can be found and closed after it is gone (``sweep``; ``sweep_run``, also ``agentenv rollout cleanup``,
after the driver itself was killed). Also where a worker's sandboxes live (``node_env_url``, ``connect``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from agentenv.errors import Unauthorized

log = logging.getLogger(__name__)

RUN_LABEL, WORKER_LABEL = "agentenv.rollout.run", "agentenv.rollout.worker"
RUN_FILE = "run.json"  # in a run's out folder: names its run id
LOCAL = "local"  # the env "server" that is this host's own sandboxes


# --- sandboxes labelled with their run and worker ---------------------------------------------------------


class _LabelledBox:
    """A sandbox whose snapshots and forks carry its owner's labels, and whose deadline is the run's (forks' too:
    an env moving its sandbox's deadline on moves it by the run's TTL, not its own)."""

    def __init__(self, sb: Any, owner: LabelledBackend) -> None:
        self._sb, self._owner = sb, owner
        self.id = sb.id

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sb, name)

    def __repr__(self) -> str:
        return f"Labelled({self._sb!r})"

    def snapshot(self, memory: bool = False, *, labels: dict[str, str] | None = None) -> Any:
        return self._sb.snapshot(memory, labels={**(labels or {}), **self._owner.labels})

    def fork(self, n: int = 1, **kw: Any) -> list[Any]:
        return [_LabelledBox(k, self._owner) for k in self._sb.fork(n, **{**kw, **self._owner.deadline(kw)})]

    def set_ttl(self, ttl: float) -> None:
        self._sb.set_ttl(self._owner.ttl if self._owner.ttl is not None else ttl)

    def __enter__(self) -> _LabelledBox:
        return self

    def __exit__(self, *exc: object) -> None:
        self._sb.close()


class _LabelledSandboxes:
    def __init__(self, owner: LabelledBackend) -> None:
        self._owner = owner
        self._inner = owner.inner.Sandbox

    def create(self, image: str = "agentenv/base", *, labels: dict[str, str] | None = None, **kw: Any) -> Any:
        return _LabelledBox(self._inner.create(image, labels={**(labels or {}), **self._owner.labels},
                                               **{**kw, **self._owner.deadline(kw)}), self._owner)

    def restore(self, snapshot: Any, *, labels: dict[str, str] | None = None, **kw: Any) -> Any:
        return _LabelledBox(self._inner.restore(snapshot, labels={**(labels or {}), **self._owner.labels},
                                                **{**kw, **self._owner.deadline(kw)}), self._owner)

    def get(self, sandbox_id: str) -> Any:
        return _LabelledBox(self._inner.get(sandbox_id), self._owner)

    def list(self) -> list[Any]:
        return list(self._inner.list())


class LabelledBackend:
    """A ``Backend`` whose every sandbox and snapshot carries ``labels`` and whose sandboxes get ``ttl`` (the run's
    deadline, whatever the env asks for; None: the env's), so what a worker made can be found (and closed) after
    the worker itself is gone."""

    def __init__(self, inner: Any, labels: Mapping[str, str], ttl: float | None = None) -> None:
        self.inner, self.labels, self.ttl = inner, dict(labels), ttl
        self.Sandbox = _LabelledSandboxes(self)
        self.Snapshot = inner.Snapshot

    def deadline(self, asked: Mapping[str, Any]) -> dict[str, Any]:
        """What replaces the keywords ``asked`` of a call that makes a sandbox: the run's ``ttl``, where it has one."""
        return {"ttl": self.ttl} if self.ttl is not None else {}


def sweep(api: Any, labels: Mapping[str, str], keep: Iterable[str] = (), snapshots: bool = True
          ) -> dict[str, list[str]]:
    """Close every sandbox and delete every snapshot of ``api`` that carries all of ``labels``, except the snapshots
    named in ``keep`` (a training checkpoint's paused episodes live in them) and, with ``snapshots=False``, every
    snapshot; returns their ids."""
    want = dict(labels)
    kept = set(keep)
    out: dict[str, list[str]] = {"sandboxes": [], "snapshots": []}

    def ours(obj: Any) -> bool:
        with contextlib.suppress(Exception):
            have = obj.labels
            return all(have.get(k) == v for k, v in want.items())
        return False

    for sb in _listed(api.Sandbox):
        if ours(sb):
            with contextlib.suppress(Exception):
                sb.close()
                out["sandboxes"].append(sb.id)
    for snap in _listed(api.Snapshot) if snapshots else []:
        if ours(snap) and snap.id not in kept:
            with contextlib.suppress(Exception):
                snap.delete()
                out["snapshots"].append(snap.id)
    return out


def _listed(factory: Any) -> list[Any]:
    """``factory.list()``, or nothing when the store cannot be listed (not made yet, a server down)."""
    try:
        return list(factory.list())
    except Exception as e:  # noqa: BLE001 - a sweep must not fail what it protects
        log.warning("cannot list %s: %s: %s", factory, type(e).__name__, e)
        return []


def connect(url: str | None, token: str | None) -> Any:
    """The sandboxes of the env server at ``url`` (an ``agentenv.connect`` client), or this host's (None, "local")."""
    import agentenv

    if url is None or url == LOCAL:
        return agentenv
    token = token or os.environ.get("AGENTENV_TOKEN")
    if not token:
        raise Unauthorized(f"the env server {url} needs a token",
                           fix="give env_token (--env-token-file) or set $AGENTENV_TOKEN")
    return agentenv.connect(url, token)


def node_env_url(env_urls: Mapping[str, str] | None, node_id: str | None, node_ip: str | None) -> str | None:
    """The env server of a node: ``env_urls`` by node id, node IP or ``"*"``; else ``$AGENTENV_URL``; None: local."""
    for key in (node_id, node_ip, "*"):
        if env_urls and key is not None and key in env_urls:
            return env_urls[key]
    return os.environ.get("AGENTENV_URL") or None


def sweep_run(run: str | os.PathLike[str], env_urls: Iterable[str] = (), env_token: str | None = None,
              keep: Iterable[str] = ()) -> dict[str, list[str]]:
    """Close what a run left (after its driver was killed): ``run`` is its run id or its out folder (whose
    ``run.json`` names the id); this host's sandboxes and those on the env servers ``env_urls``; the snapshots in
    ``keep`` stay."""
    keep = set(keep)
    run_id = str(run)
    path = Path(run)
    if (path / RUN_FILE).is_file():
        run_id = json.loads((path / RUN_FILE).read_text())["run_id"]
    total: dict[str, list[str]] = {"sandboxes": [], "snapshots": []}
    for url in [LOCAL, *[u for u in env_urls if u != LOCAL]]:
        api = connect(url, env_token)
        try:
            for k, v in sweep(api, {RUN_LABEL: run_id}, keep).items():
                total[k] += v
        finally:
            if url != LOCAL:
                api.close()
    return total
