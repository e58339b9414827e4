"""``Sandbox.list`` (``GET /v2/sandboxes``) as the ``e2b`` SDK's paginator sends it: ``state``, ``metadata``,
``startedAfter``, ``template``, ``order`` (by start time, newest first unless ``asc``, over the whole result
before paging), ``limit`` and ``nextToken``. The next page's token comes in the ``x-next-token`` header; it
names the last sandbox's place in the order, so a page still follows when that sandbox is gone meanwhile. A
query parameter agentenv does not know is a 400 that names it, never ignored.
"""

from __future__ import annotations

import datetime as dt
import urllib.parse
from typing import Annotated

from fastapi import Query, Request, Response
from fastapi.responses import JSONResponse

from agentenv.sandbox import warm
from agentenv.sandbox.core import Sandbox
from agentenv.server.e2b.control import META_PREFIX, TEMPLATE_LABEL, sandbox_json
from agentenv.server.e2b.plane import E2BError, router_for

router = router_for()
PARAMS = frozenset({"state", "metadata", "startedAfter", "template", "order", "limit", "nextToken"})
STATES = ("running", "paused")


def refuse_unknown(request: Request, known: frozenset[str]) -> None:
    """A 400 naming the query parameters not in ``known`` (never ignored)."""
    if unknown := sorted(set(request.query_params) - known):
        raise E2BError(400, f"unknown query parameter(s) {unknown}: this route takes {sorted(known)}")


def _metadata(raw: str | None) -> dict[str, str]:
    """The SDK's ``metadata``: ``k=v&...`` with each key and value URL-quoted once more."""
    pairs = urllib.parse.parse_qsl(raw or "", keep_blank_values=True, strict_parsing=bool(raw))
    return {urllib.parse.unquote(k): urllib.parse.unquote(v) for k, v in pairs}


def _after(raw: str | None) -> dt.datetime | None:
    if raw is None:
        return None
    try:
        stamp = dt.datetime.fromisoformat(raw.replace(" ", "+"))  # a '+' of the offset may arrive as a space
    except ValueError:
        raise E2BError(400, f"startedAfter {raw[:64]!r} is not an ISO 8601 time") from None
    return stamp if stamp.tzinfo else stamp.replace(tzinfo=dt.UTC)


def _started(sb: Sandbox) -> dt.datetime:
    """The start as ``startedAt`` says it (to the microsecond), so that a time read from it compares equal."""
    return dt.datetime.fromtimestamp(sb.created_at, dt.UTC)


def _key(sb: Sandbox) -> tuple[float, str]:
    return sb.created_at, sb.id


def _token(key: tuple[float, str]) -> str:
    return f"{key[0]!r}_{key[1]}"


def _from_token(raw: str) -> tuple[float, str]:
    stamp, _, sid = raw.partition("_")
    try:
        return float(stamp), sid
    except ValueError:
        raise E2BError(400, f"nextToken {raw[:64]!r} is not one this server gave") from None


@router.get("/v2/sandboxes")
@router.get("/sandboxes")
def list_sandboxes(request: Request, state: str | None = None, metadata: str | None = None,
                   started_after: Annotated[str | None, Query(alias="startedAfter")] = None,
                   template: str | None = None, order: str | None = None,
                   limit: Annotated[int, Query(ge=1, le=1000)] = 100,
                   next_token: Annotated[str | None, Query(alias="nextToken")] = None) -> Response:
    """Running and paused sandboxes (or the states asked for) that match every filter, a page of them."""
    refuse_unknown(request, PARAMS)
    states = set(state.split(",")) if state else set(STATES)
    if bad := sorted(states - set(STATES)):
        raise E2BError(400, f"state {bad} is not one of {list(STATES)}")
    if order not in (None, "asc", "desc"):
        raise E2BError(400, f"order {order[:16]!r} is not 'asc' or 'desc'")
    want, after = _metadata(metadata), _after(started_after)
    rows = [sb for sb in Sandbox.list()
            if sb.state in states and sb.labels.get("agentenv.kind") != warm.KIND
            and all(sb.labels.get(META_PREFIX + k) == v for k, v in want.items())
            and (after is None or _started(sb) >= after)
            and (template is None or sb.labels.get(TEMPLATE_LABEL, sb.image) == template)]
    newest_first = order != "asc"
    rows.sort(key=_key, reverse=newest_first)
    if next_token:
        last = _from_token(next_token)
        rows = [sb for sb in rows if (_key(sb) < last if newest_first else _key(sb) > last)]
    page = rows[:limit]
    headers = {"x-next-token": _token(_key(page[-1]))} if len(rows) > limit else {}
    return JSONResponse([sandbox_json(request, sb, detail=True) for sb in page], headers=headers)
