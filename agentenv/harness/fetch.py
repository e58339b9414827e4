"""The image a harness's task names (a dataset record's, by its dataset's rule: ``envs.datasets``), fetched when the
sandbox host lacks it: a sandbox is created as asked, and on ``ImageNotFound`` the backend's ``ensure_image`` (this
host's: ``agentenv.ensure_image``; a server's: ``Client.ensure_image``) takes it from a tarball, a mirror or a
registry (``agentenv.host.image_store``) before one more try. A backend that cannot fetch (a ``Pool``: prewarm
its servers, ``agentenv.remote.prewarm``) gives the ``ImageNotFound`` back."""

from __future__ import annotations

from typing import Any

from agentenv.api import Backend, SandboxLike
from agentenv.errors import ImageNotFound


def create_sandbox(api: Backend, image: str, **kwargs: Any) -> SandboxLike:
    """``api.Sandbox.create(image, **kwargs)``, the image fetched first when the host lacks it."""
    try:
        return api.Sandbox.create(image, **kwargs)
    except ImageNotFound:
        ensure = getattr(api, "ensure_image", None)
        if not callable(ensure):
            raise
        ensure(image)
        return api.Sandbox.create(image, **kwargs)
