"""Prewarm a task set's images on every env server of a fleet before a run: each server makes sure it has each
image (``/v1/images/ensure``: its local store, a tarball, a mirror or a registry, with a deadline), servers in
parallel, each server's images one after another (a host pulls one image at a time best), with progress.

The servers are the Ray fleet of ``agentenv cluster up`` (``agentenv.remote.fleet.urls``) or a list of URLs. What
comes back says, per server and image, where the image came from or why it could not be had; nothing stops at the
first failure, so one report lists every image a run would miss.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from agentenv.errors import AgentEnvError
from agentenv.remote.client import Client


@dataclass(frozen=True)
class Warmed:
    """One image on one server: ``source`` ("local", "tarball", "mirror", "registry"), or ``error`` (why not)."""

    url: str
    image: str
    source: str = ""
    seconds: float = 0.0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


Progress = Callable[[Warmed, int, int], None]  # (the image just done, done so far, total)


def prewarm(urls: Sequence[str], token: str, images: Sequence[str], *, deadline: float | None = None,
            on_progress: Progress | None = None) -> list[Warmed]:
    """Every image of ``images`` on every server of ``urls`` (see the module doc); one ``Warmed`` per pair."""
    wanted = list(dict.fromkeys(images))
    total, done = len(urls) * len(wanted), 0
    lock = threading.Lock()
    out: list[Warmed] = []

    def one_server(url: str) -> None:
        nonlocal done
        with Client(url, token) as client:
            for image in wanted:
                t0 = time.monotonic()
                try:
                    got = client.ensure_image(image, deadline=deadline)
                    w = Warmed(url, image, got.source, got.seconds)
                except AgentEnvError as e:
                    w = Warmed(url, image, seconds=round(time.monotonic() - t0, 3), error=str(e))
                with lock:
                    out.append(w)
                    done += 1
                    if on_progress is not None:
                        on_progress(w, done, total)

    if wanted and urls:
        with ThreadPoolExecutor(max_workers=min(16, len(urls)), thread_name_prefix="agentenv-prewarm") as ex:
            list(ex.map(one_server, urls))
    return sorted(out, key=lambda w: (w.url, wanted.index(w.image)))


def prewarm_fleet(token: str, images: Sequence[str], *, address: str | None = None, deadline: float | None = None,
                  on_progress: Progress | None = None) -> list[Warmed]:
    """``prewarm`` on every server of the Ray fleet at ``address`` (``agentenv cluster up``)."""
    from agentenv.remote import fleet

    infos = fleet.servers(address=address)
    fleet.check_token(infos, token)
    if not infos:
        raise fleet.FleetError("no fleet server answers", fix="start them with `agentenv cluster up`")
    return prewarm([i["url"] for i in infos], token, images, deadline=deadline, on_progress=on_progress)
