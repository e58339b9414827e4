"""Docker images as sandbox roots: resolve a name to its overlay2 layers through the Docker SDK; and the few
engine calls that make and drop images (``build``, ``load``, ``pull``, ``remove``).

A lookup is a round trip to dockerd (milliseconds, more under load); a burst of creates of one image asks
once: a name resolved less than ``FRESH`` seconds ago is not asked again, and concurrent lookups of one
name wait for the first (as if they had all asked at that instant).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

from agentenv.errors import AgentEnvError, ImageNotFound

if TYPE_CHECKING:
    import docker


@dataclass(frozen=True)
class ImageInfo:
    """What a sandbox needs of an image: its id, overlay layers (top first), env and workdir."""

    id: str
    layers: list[str]
    env: list[str]
    workdir: str


@functools.cache
def docker_client() -> docker.DockerClient:
    """One Docker SDK client per process; a clear error when the engine is down."""
    import docker  # imported on first use: it costs a fifth of a second, and restores do not need it

    try:
        client = docker.from_env(timeout=60)
        client.ping()
    except docker.errors.DockerException as e:
        raise AgentEnvError(f"the Docker engine does not answer ({e})",
                            fix="start it with scripts/bootstrap.sh (or 'dockerd &')") from e
    return client


def _inspect(name: str) -> dict[str, Any]:
    """``docker image inspect``, reconnecting once if the engine restarted under a cached client."""
    import requests

    try:
        return dict(docker_client().api.inspect_image(name))
    except requests.exceptions.ConnectionError:
        docker_client.cache_clear()
        return dict(docker_client().api.inspect_image(name))


FRESH = 1.0  # seconds a resolved name is reused without asking dockerd again
_recent: dict[str, tuple[float, ImageInfo]] = {}
_lookups: dict[str, threading.Lock] = {}
_lookups_lock = threading.Lock()


def resolve(name: str) -> ImageInfo:
    """Look an image up by name or id (at most once every ``FRESH`` seconds per name); ImageNotFound lists
    the images that exist."""
    with _lookups_lock:
        lookup = _lookups.setdefault(name, threading.Lock())
    with lookup:
        hit = _recent.get(name)
        if hit is not None and time.monotonic() - hit[0] < FRESH:
            return hit[1]
        info = _resolve(name)
        _recent[name] = (time.monotonic(), info)
        return info


def _resolve(name: str) -> ImageInfo:
    import docker.errors

    try:
        attrs = _inspect(name)
    except docker.errors.ImageNotFound:
        raise ImageNotFound(name, available()) from None
    except docker.errors.APIError as e:
        if e.status_code == 404 or e.status_code == 400:
            raise ImageNotFound(name, available()) from None
        raise
    driver = attrs.get("GraphDriver", {})
    if driver.get("Name") != "overlay2":
        raise AgentEnvError(f"image {name!r} uses the {driver.get('Name')} storage driver",
                            fix="run dockerd with the overlay2 storage driver (scripts/bootstrap.sh does)")
    data = driver["Data"]
    layers = [data["UpperDir"]] + [d for d in data.get("LowerDir", "").split(":") if d]
    config = attrs.get("Config") or {}
    return ImageInfo(id=attrs["Id"], layers=layers, env=list(config.get("Env") or []),
                     workdir=config.get("WorkingDir") or "/")


def layers_present(layers: list[str]) -> bool:
    """True when every overlay layer folder still exists (then Docker need not be asked again)."""
    return bool(layers) and all(os.path.isdir(d) for d in layers)


def available() -> list[str]:
    """Tags of every local image, sorted."""
    return sorted(tag for img in docker_client().images.list() for tag in img.tags)


class BuildFailed(AgentEnvError):
    """``docker build`` stopped on an error; ``error`` is Docker's message, ``output`` the lines before it."""

    def __init__(self, error: str, output: list[str]) -> None:
        self.error, self.output = error, output
        super().__init__(f"docker build failed: {error}")


def build(context: str, tag: str, *, on_output: Callable[[str], None] | None = None, nocache: bool = False,
          labels: dict[str, str] | None = None, network: str = "none") -> str:
    """``docker build`` of the folder ``context`` (its ``Dockerfile``) as ``tag``, never pulling, its output line by
    line to ``on_output``; returns the image id, or raises BuildFailed."""
    import docker.errors

    lines: list[str] = []
    image_id = ""
    try:
        for chunk in docker_client().api.build(path=context, tag=tag, rm=True, forcerm=True, decode=True, pull=False,
                                               nocache=nocache, network_mode=network, labels=labels or {}):
            if "error" in chunk:
                raise BuildFailed(str(chunk["error"]).strip(), lines)
            if "aux" in chunk and "ID" in chunk["aux"]:
                image_id = chunk["aux"]["ID"]
            for line in str(chunk.get("stream", "")).splitlines():
                if line.strip():
                    lines.append(line)
                    if on_output is not None:
                        on_output(line)
    except docker.errors.APIError as e:
        raise BuildFailed(str(e.explanation or e), lines) from e
    return image_id or str(_inspect(tag)["Id"])


def inspect(name: str) -> dict[str, Any]:
    """``docker image inspect`` of ``name`` (its config, ``RootFS.Layers``...); ImageNotFound lists those there are."""
    import docker.errors

    try:
        return _inspect(name)
    except docker.errors.ImageNotFound:
        raise ImageNotFound(name, available()) from None


def load(archive: IO[bytes], tag: str) -> str:
    """``docker load`` of ``archive`` (a ``docker save`` tar, ``manifest.json`` naming ``tag``); the image id of
    ``tag``. AgentEnvError with the engine's message when it refuses the archive."""
    import docker.errors

    try:
        docker_client().images.load(archive)
    except docker.errors.DockerException as e:
        raise AgentEnvError(f"docker load refused the image {tag}: {e}",
                            fix="check the engine's log (journalctl -u docker, or dockerd's output)") from e
    _recent.pop(tag, None)
    return str(_inspect(tag)["Id"])


def present(name: str) -> bool:
    """True when the engine has an image of that name or id."""
    import docker.errors

    try:
        _inspect(name)
    except docker.errors.ImageNotFound:
        return False
    except docker.errors.APIError as e:
        if e.status_code in (400, 404):
            return False
        raise
    return True


PULL_DEADLINE = 600.0  # seconds a pull may take by default


def pull(name: str, *, deadline: float = PULL_DEADLINE, on_progress: Callable[[str], None] | None = None) -> str | None:
    """``docker pull`` of ``name``, its progress lines to ``on_progress`` (from a reader thread); None when it
    worked, else why not: the engine's reason (no registry reachable, say), or the ``deadline`` (seconds) passed,
    when the pull is stopped (the client goes, and the engine cancels a pull whose client left).

    The ``docker`` command line runs it: a process can be stopped at a deadline, where a pull streamed through
    the SDK holds a socket no other thread may close."""
    import shutil
    import subprocess

    cli = shutil.which("docker")
    if cli is None:
        return "the docker command line is not installed (scripts/bootstrap.sh installs it)"
    proc = subprocess.Popen([cli, "pull", name], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip()
            lines.append(line)
            del lines[:-20]
            if on_progress is not None and line:
                on_progress(line)

    reader = threading.Thread(target=read, name="agentenv-pull", daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=deadline)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        reader.join(5)
        return f"the pull did not finish within {deadline:g} s (a registry that does not answer, or one too slow)"
    reader.join(5)
    _recent.pop(name, None)
    if code == 0 and present(name):
        return None
    said = [ln for ln in lines if ln.strip()]
    return (said[-1] if said else f"docker pull exited with {code}").removeprefix("Error response from daemon: ")


def remove(name: str) -> None:
    """Untag ``name`` (removing the image when no other tag holds it); nothing when it is already gone."""
    import docker.errors

    with contextlib.suppress(docker.errors.NotFound):  # ImageNotFound, or a reference another call just removed
        docker_client().images.remove(name)
    _recent.pop(name, None)


def tag(image: str, name: str, *, unless_present: bool = False) -> None:
    """``docker tag image name``; with ``unless_present``, nothing when ``name`` is there already (also when another
    process tagged it and removed ``image`` meanwhile)."""
    import docker.errors
    from docker.utils import parse_repository_tag

    repo, version = parse_repository_tag(name)
    try:
        if not (unless_present and present(name)):
            docker_client().api.tag(image, repo, version or "latest")
    except docker.errors.NotFound:
        if not (unless_present and present(name)):
            raise ImageNotFound(image, available()) from None
    _recent.pop(name, None)


def load_file(path: str) -> list[str]:
    """``docker load`` of the tar (or gzipped tar) at ``path``; the tags it brought. AgentEnvError with the
    engine's message when it refuses it."""
    import docker.errors

    try:
        with open(path, "rb") as f:
            loaded = docker_client().images.load(f)
    except (OSError, docker.errors.DockerException) as e:
        raise AgentEnvError(f"docker load refused {path}: {e}",
                            fix="give a file `docker save IMAGE -o FILE` wrote (gzip is fine)") from e
    return [t for image in loaded for t in image.tags]


def disk_usage() -> dict[str, Any]:
    """``docker system df``'s view of the images: ``LayersSize`` (bytes of every layer, shared ones once) and
    ``Images`` (``Id``, ``RepoTags``, ``Size``, ``SharedSize``, ``Containers``, ``Created``)."""
    return dict(docker_client().df())
