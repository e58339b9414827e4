"""The server's figures for the console's server page: the admission queue, the warm pool, the snapshot store and
the quotas, read once a console reading is taken, and the last HISTORY of them kept so that a page opened now
draws its charts from the last minutes at once (kept only while a console page is open: nothing reads them
otherwise)."""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

from agentenv.host import admission
from agentenv.sandbox import warm
from agentenv.server.service import Service
from agentenv.snapshot.store import Snapshot

HISTORY = 300  # readings kept (five minutes at one a second)


def sample(service: Service) -> dict[str, Any]:
    """One reading of the server's figures (no call into any sandbox: files and counters only)."""
    starting, waiting = admission.queue()
    snaps = Snapshot.list()
    return {"now": time.time(),
            "admission": {"starting": starting, "waiting": waiting, "limit": admission.limit()},
            "warm": {"ready": warm.ready(), "size": warm.size()},
            "store": {"bytes": sum(s.size_bytes for s in snaps), "snapshots": len(snaps)},
            "capacity": service.capacity().model_dump()}


class History:
    """The last HISTORY readings, oldest first."""

    def __init__(self) -> None:
        self._items: collections.deque[dict[str, Any]] = collections.deque(maxlen=HISTORY)
        self._lock = threading.Lock()

    def add(self, item: dict[str, Any]) -> None:
        with self._lock:
            self._items.append(item)

    def items(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._items)
