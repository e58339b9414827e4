"""What happens to a sandbox when its TTL runs out: paused (its state kept, the default of the native API) or
closed, as its ``agentenv.on_expiry`` label says (E2B's API kills on timeout unless the caller asked for
auto-pause, and records that choice here); ``agentenv.pause_memory`` "false" pauses it with its files only. ``Sandbox.reap_expired`` runs ``reap`` over every sandbox.
"""

from __future__ import annotations

import builtins
import logging
import time
from collections.abc import Iterable
from typing import Protocol

from agentenv.errors import AgentEnvError

ON_EXPIRY = "agentenv.on_expiry"  # label: "pause" (also when absent) or "kill"
PAUSE_MEMORY = "agentenv.pause_memory"  # label: "false": the expiry's pause keeps the files only (E2B's filesystem)
ACTIONS = ("pause", "kill")
log = logging.getLogger("agentenv")


class Expiring(Protocol):
    """What ``reap`` needs of a sandbox."""

    id: str

    @property
    def expires_at(self) -> float | None: ...

    @property
    def labels(self) -> dict[str, str]: ...

    @property
    def state(self) -> str: ...

    def pause(self, memory: bool = True) -> object: ...

    def close(self) -> None: ...


def action(labels: dict[str, str]) -> str:
    """What the sandbox with these labels asked for at expiry: 'pause' or 'kill'."""
    return "kill" if labels.get(ON_EXPIRY) == "kill" else "pause"


def reap(sandboxes: Iterable[Expiring]) -> builtins.list[str]:
    """Pause or close (``action``) every running sandbox past its TTL; returns their ids.

    One sandbox that cannot be paused (its agent stopped, say) is logged and skipped: it neither stalls the
    others (every step has a deadline) nor ends the round.
    """
    done = []
    for sb in sandboxes:
        exp = sb.expires_at
        try:
            if exp is not None and exp < time.time() and sb.state == "running":
                if action(sb.labels) == "kill":
                    sb.close()
                    log.info("closed sandbox %s: its TTL expired", sb.id)
                else:
                    sb.pause(memory=sb.labels.get(PAUSE_MEMORY) != "false")
                    log.info("paused sandbox %s: its TTL expired", sb.id)
                done.append(sb.id)
        except AgentEnvError as e:
            log.warning("could not reap sandbox %s past its TTL: %s", sb.id, e)
    return done
