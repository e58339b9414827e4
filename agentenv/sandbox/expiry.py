"""What happens to a sandbox when its TTL runs out: closed (the default: a sandbox its maker forgot is not kept
for ever as a snapshot) or, where its ``agentenv.on_expiry`` label asks for it ("pause"), paused with its state
kept (E2B's API kills on timeout unless the caller asked for auto-pause, and records that choice here);
``agentenv.pause_memory`` "false" pauses it with its files only. ``Sandbox.reap_expired`` runs ``reap`` over every
sandbox; who calls it: ``agentenv serve``, ``agentenv gc`` and the home's reaper (``agentenv.sandbox.watchdog``).
"""

from __future__ import annotations

import builtins
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from agentenv.errors import AgentEnvError, SandboxNotFound, SandboxStateError
from agentenv.sandbox import migration, snapshotting

if TYPE_CHECKING:
    from agentenv.sandbox.parts import Parts

ON_EXPIRY = "agentenv.on_expiry"  # label: "kill" (also when absent) or "pause"
PAUSE_MEMORY = "agentenv.pause_memory"  # label: "false": the expiry's pause keeps the files only (E2B's filesystem)
ACTIONS = ("pause", "kill")
log = logging.getLogger("agentenv")


class Expiring(Protocol):
    """What ``reap`` needs of a sandbox."""

    id: str

    @property
    def expires_at(self) -> float | None: ...

    @property
    def state(self) -> str: ...

    def expire(self) -> str | None: ...


def action(labels: dict[str, str]) -> str:
    """What the sandbox with these labels asked for at expiry: 'kill' unless it asked for 'pause'."""
    return "pause" if labels.get(ON_EXPIRY) == "pause" else "kill"


def due(expires_at: float | None, state: str, now: float | None = None) -> bool:
    """Whether a sandbox in ``state`` whose TTL ends at ``expires_at`` is to be reaped now."""
    return state == "running" and expires_at is not None and expires_at < (time.time() if now is None else now)


def expire(sb: Parts) -> str | None:
    """Pause or close ``sb`` (``action``) if, checked again under its lock, it runs past its TTL: a connect may
    have just extended it. Returns what was done ('pause', 'kill'), or None. SandboxStateError while a post-copy
    migration holds it frozen: the move decides where it goes (a later round reaps it if it stays here), and a
    pause would wait out the quiesce deadline on a keeper CRIU holds, with the sandbox's lock (and its calls)."""
    with sb.locked():
        if not due(sb.expires_at, sb.recorded_state):
            return None
        if (snap := migration.moving(sb.id)) is not None:
            raise SandboxStateError(f"sandbox {sb.id} is being migrated post-copy (snapshot {snap})",
                                    fix="the move decides where it goes; it is reaped here later if it stays")
        done = action(sb.labels)
        if done == "kill":
            sb.lifecycle.destroy()
        else:
            snapshotting.pause(sb, memory=sb.labels.get(PAUSE_MEMORY) != "false")
        return done


def reap(sandboxes: Iterable[Expiring]) -> builtins.list[str]:
    """Close (or pause: ``action``) every running sandbox past its TTL; returns their ids.

    Each is checked again under its lock (``expire``), so one whose TTL a connect has just extended stays. One
    that cannot be paused (its keeper stopped, say) is logged and skipped: it neither stalls the others (every
    step has a deadline) nor ends the round.
    """
    done = []
    for sb in sandboxes:
        try:
            if not due(sb.expires_at, sb.state):  # the cheap look first: most sandboxes are not due
                continue
            what = sb.expire()
        except (SandboxNotFound, SandboxStateError):  # closed by its user since it was listed
            continue
        except AgentEnvError as e:
            log.warning("could not reap sandbox %s past its TTL: %s", sb.id, e)
            continue
        except Exception:  # noqa: BLE001 - a bug met on one sandbox must not end the round for the others
            log.exception("could not reap sandbox %s past its TTL", sb.id)
            continue
        if what is not None:
            log.info("%s sandbox %s: its TTL expired", "closed" if what == "kill" else "paused", sb.id)
            done.append(sb.id)
    return done
