"""agentenv: containerised environments that snapshot, fork and resume fast (Docker images, runc, CRIU).

The contract (value types and Protocols) is ``agentenv.api``; this module is its local implementation
(``agentenv.Sandbox``, ``agentenv.Snapshot``), ``connect`` and ``Pool`` its remote ones. Gymnasium
environments live in the ``envs`` package, so importing this one stays light.

The rooms: ``host/`` (what a sandbox stands on: runtime, namespaces, cgroups, the volume), ``snapshot/`` (CRIU's
dump and restore, lazy pages, post-copy, the store, export and import), ``sandbox/`` (the ``Sandbox`` and its
lifecycle: calls, fork, snapshots, recovery, the warm pool), ``inside/``
(the standard-library programs that run in a sandbox), ``remote/`` (client, pool) and ``server/``
(``agentenv serve``, E2B's API included); at the top, the contract (``api``, ``errors``, ``netpolicy``, and
``wire``: the HTTP bodies both ends read), the settings (``config``, ``phases``; ``config`` also holds the one atomic
file writer every package uses) and the command line (``cli``, ``tour``, ``terminal``).

Importing this module loads nothing: the contract's names (``Limits``, ``SandboxInfo``, ..., ``errors``) are
imported on first use, so the command line (``agentenv.cli``, under this package) starts without them; ``Sandbox``
and ``Snapshot`` (the host stack) too, like ``connect`` and ``Pool`` (httpx), so a client of a server never loads the
host's modules.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what __getattr__ gives, as type checkers see it (connect and Pool stay untyped there, as before)
    from agentenv import errors
    from agentenv.api import (
        Backend,
        ExecResult,
        ImageFetch,
        Limits,
        Process,
        SandboxInfo,
        SandboxLike,
        SnapshotInfo,
        SnapshotLike,
    )
    from agentenv.sandbox.core import Sandbox
    from agentenv.snapshot.store import Snapshot

__all__ = ["Backend", "ExecResult", "ImageFetch", "Limits", "Pool", "Process", "Sandbox", "SandboxInfo", "SandboxLike",
           "Snapshot", "SnapshotInfo", "SnapshotLike", "connect", "ensure_image", "errors"]
__version__ = "0.1.0"
_CONTRACT = frozenset({"Backend", "ExecResult", "ImageFetch", "Limits", "Process", "SandboxInfo", "SandboxLike",
                       "SnapshotInfo", "SnapshotLike"})  # agentenv.api's names, given by __getattr__


def ensure_image(image: str, *, deadline: float | None = None) -> "ImageFetch":
    """Make sure ``image`` is on this host: its local store, a ``docker load`` tarball, a mirror or a registry (the
    sources ``AGENTENV_IMAGE_*`` name; ``agentenv.host.image_store``); where it came from, or ImageUnavailable."""
    import dataclasses

    from agentenv.host import image_store

    sources = image_store.ImageSources.from_env()
    if deadline is not None:
        sources = dataclasses.replace(sources, deadline=deadline)
    return image_store.ensure(image, sources)


def __getattr__(name: str) -> Any:
    """``connect`` and ``Pool`` (the remote API) are imported on first use, so httpx is not needed locally; so are
    ``Sandbox`` and ``Snapshot`` (the local API), so a remote user never loads the host, and the contract's names."""
    if name in _CONTRACT or name == "errors":  # (by import_module: a from-import here would ask __getattr__ again)
        from importlib import import_module

        module = import_module(f"agentenv.{'errors' if name == 'errors' else 'api'}")
        return module if name == "errors" else getattr(module, name)
    if name == "connect":
        from agentenv.remote.client import connect

        return connect
    if name == "Pool":
        from agentenv.remote.pool import Pool

        return Pool
    if name == "Sandbox":
        from agentenv.sandbox.core import Sandbox

        return Sandbox
    if name == "Snapshot":
        from agentenv.snapshot.store import Snapshot

        return Snapshot
    raise AttributeError(f"module 'agentenv' has no attribute {name!r}")
