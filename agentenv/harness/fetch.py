"""The image a harness's task names (a dataset record's, by its dataset's rule: ``envs.datasets``), fetched when the
sandbox host lacks it: a sandbox is created as asked, and on ``ImageNotFound`` the backend's ``ensure_image`` (this
host's: ``agentenv.ensure_image``; a server's: ``Client.ensure_image``) takes it from a tarball, a mirror or a
registry (``agentenv.host.image_store``) before one more try. A backend that cannot fetch (a ``Pool``: prewarm
its servers, ``agentenv.remote.prewarm``) gives the ``ImageNotFound`` back.

A harness's sandboxes (and their forks) live ``HARNESS_TTL`` unless it asks otherwise: an agent harness waits on
its model for minutes at a time, far past the library's short default (``agentenv.api.DEFAULT_TTL``), and its
own stop or cleanup closes them sooner."""

from __future__ import annotations

from typing import Any

from agentenv.api import Backend, SandboxLike
from agentenv.errors import ImageNotFound

HARNESS_TTL = 4 * 3600.0  # seconds: a harness's sandbox deadline (see the module doc)


def create_sandbox(api: Backend, image: str, **kwargs: Any) -> SandboxLike:
    """``api.Sandbox.create(image, **kwargs)`` (``ttl`` ``HARNESS_TTL`` unless given), the image fetched first
    when the host lacks it."""
    kwargs.setdefault("ttl", HARNESS_TTL)
    try:
        return api.Sandbox.create(image, **kwargs)
    except ImageNotFound:
        ensure = getattr(api, "ensure_image", None)
        if not callable(ensure):
            raise
        ensure(image)
        return api.Sandbox.create(image, **kwargs)
