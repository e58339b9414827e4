"""The reaper of one agentenv home (``python -m agentenv.sandbox.reaper``, started by ``watchdog.ensure``): it closes
each sandbox at its deadline (or pauses it, where it asked to be: ``agentenv.sandbox.expiry``) and exits once
no sandbox of the home is left with a deadline to keep, so that nothing of it stays behind.

It reads the records only (no ``runc`` per sandbox per look), wakes at the next deadline or every ``POLL``
seconds (to see sandboxes closed, or deadlines moved, by others), and checks each due one again under its lock
(``Sandbox.expire``), as ``agentenv serve``'s reaper and ``agentenv gc`` do: the three may run at once. It is the
backstop: it reaps a sandbox ``GRACE`` seconds after its deadline, so that a server's reaper in the same home (or a
program calling ``Sandbox.reap_expired`` itself) goes first and logs what it did.
"""

from __future__ import annotations

import contextlib
import logging
import time

from agentenv.config import where
from agentenv.errors import AgentEnvError
from agentenv.sandbox import expiry, record, watchdog
from agentenv.sandbox.core import Sandbox

POLL = 2.0  # seconds between looks at most
GRACE = 15.0  # seconds past its deadline a sandbox is left to the other reapers
WATCHED = ("running",)  # whose deadline the reaper keeps (a paused one waits; one being made calls ensure once it runs)
log = logging.getLogger("agentenv")


def pending(skip: set[str] | frozenset[str] = frozenset()) -> list[record.SandboxRecord]:
    """The home's sandboxes that have a deadline still to keep (but those in ``skip``)."""
    folder = where().sandboxes  # never made again here: a home removed under the reaper stays removed
    if not folder.is_dir():
        return []
    return [r for r in record.listed(folder) if r.expires_at is not None and r.state in WATCHED and r.id not in skip]


class _Recorded:
    """A sandbox as ``expiry.reap`` sees it, its state the record's: one whose processes died (``lost``) is due too,
    and closed like any other (its deadline was its maker's word that nobody needs it after)."""

    def __init__(self, sb: Sandbox) -> None:
        self.sb, self.id = sb, sb.id

    @property
    def expires_at(self) -> float | None:
        return self.sb.expires_at

    @property
    def state(self) -> str:
        return self.sb.recorded_state

    def expire(self) -> str | None:
        return self.sb.expire()


def look(given_up: set[str]) -> float | None:
    """Reap the sandboxes past their deadline (and ``GRACE``); the seconds until the next is due, or None when none
    is left. One that could not be reaped (logged) goes into ``given_up`` and is not waited for again."""
    now = time.time() - GRACE
    soonest = None
    for rec in pending(given_up):
        assert rec.expires_at is not None  # pending() keeps those with one
        if expiry.due(rec.expires_at, rec.state, now):
            sb = Sandbox(rec)
            expiry.reap([_Recorded(sb)])  # checked again under its lock; a failure logged
            with contextlib.suppress(AgentEnvError, OSError):  # gone: closed
                sb.reload()
                if expiry.due(sb.expires_at, sb.recorded_state, now):  # could not be reaped: left to gc
                    given_up.add(rec.id)
        else:
            soonest = min(soonest or rec.expires_at - now, rec.expires_at - now)
    return soonest


def watch() -> None:
    """Reap until no deadline is left, holding the watchdog lock; then let it go, looking once more."""
    given_up: set[str] = set()
    while True:
        with watchdog.held() as mine:
            if not mine:
                return  # another reaper watches this home
            while (wait := look(given_up)) is not None:
                time.sleep(min(POLL, max(wait, 0.05)))
        if not pending(given_up):  # one made while the lock was let go has its maker's ensure(), or this look
            return


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s reaper %(process)d: %(message)s")
    try:
        watch()
    except FileNotFoundError:  # the home was removed: nothing is left to watch
        pass
    except AgentEnvError as e:
        log.warning("the reaper of %s stopped: %s", where().home, e)


if __name__ == "__main__":
    main()
