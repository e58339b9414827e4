"""The TTL reaper's round (``agentenv.sandbox.expiry.reap``) over stand-ins: which sandboxes it takes, and that
no one sandbox's failure ends the round for the others."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest

from agentenv.errors import ConnectionLost, SandboxNotFound
from agentenv.sandbox import expiry


@dataclass
class Stub:
    id: str
    expires_at: float | None
    state: str = "running"
    fails: BaseException | None = None
    expired: int = 0

    def expire(self) -> str | None:
        self.expired += 1
        if self.fails is not None:
            raise self.fails
        return "pause"


def test_a_round_reaps_only_the_due_and_outlives_any_one_failure(caplog):
    due, later, forever, paused = Stub("due", 1.0), Stub("later", 4e9), Stub("forever", None), Stub("p", 1.0, "paused")
    gone, stuck, buggy = (Stub("gone", 1.0, fails=SandboxNotFound("closed")),
                          Stub("stuck", 1.0, fails=ConnectionLost("the agent did not answer")),
                          Stub("buggy", 1.0, fails=KeyError("expires_at")))
    with caplog.at_level(logging.WARNING, logger="agentenv"):
        done = expiry.reap([gone, stuck, buggy, later, forever, paused, due])
    assert done == ["due"]
    assert [s.expired for s in (later, forever, paused)] == [0, 0, 0]
    assert "could not reap sandbox stuck" in caplog.text and "could not reap sandbox buggy" in caplog.text
    assert "gone" not in caplog.text  # closed by its user since it was listed: nothing to say


@pytest.mark.parametrize(("labels", "want"), [({}, "kill"), ({expiry.ON_EXPIRY: "kill"}, "kill"),
                                              ({expiry.ON_EXPIRY: "pause"}, "pause")])
def test_the_label_chooses_what_expiry_does(labels, want):
    assert expiry.action(labels) == want
