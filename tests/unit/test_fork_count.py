"""A fork's count has one bound, ``api.MAX_FORK``, checked by one function, ``api.fork_count``, wherever a fork is
asked for: the local sandbox, the remote one (a pool's spread fork included) and the server's service."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from agentenv import api
from agentenv.remote.client import RemoteSandbox
from agentenv.sandbox.core import Sandbox
from agentenv.server import schemas
from agentenv.server.e2b import control
from agentenv.server.service import Service

BAD = [0, -1, api.MAX_FORK + 1, True, False, 2.0, "2", None]


@pytest.mark.parametrize("count", [1, 2, api.MAX_FORK])
def test_a_count_in_the_bound_is_itself(count: int) -> None:
    assert api.fork_count(count) == count


@pytest.mark.parametrize("count", BAD, ids=repr)
def test_a_count_outside_it_is_bad_input(count: object) -> None:
    with pytest.raises(ValueError, match=rf"fork count must be an integer in 1\.\.{api.MAX_FORK}, got"):
        api.fork_count(count)


ENTRIES: dict[str, Callable[[object], Any]] = {
    # nothing of the sandbox (or server) is reached before the count is checked, so none is needed
    "Sandbox.fork": lambda count: Sandbox.fork(None, count),  # type: ignore[arg-type]
    "RemoteSandbox.fork": lambda count: RemoteSandbox.fork(None, count),  # type: ignore[arg-type]
    "Service.fork": lambda count: Service(4, 4 << 30, 60).fork("sb-none", count, True),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("count", [0, api.MAX_FORK + 1, True], ids=repr)
def test_every_fork_checks_its_count_first(entry: str, count: object) -> None:
    with pytest.raises(ValueError, match="fork count must be"):
        ENTRIES[entry](count)


def test_the_servers_schemas_declare_the_same_bound() -> None:
    for body in (schemas.ForkRequest, control.ForkBody):
        bounds = {type(m).__name__: m for m in body.model_fields["count"].metadata}
        assert bounds["Ge"].ge == 1 and bounds["Le"].le == api.MAX_FORK
