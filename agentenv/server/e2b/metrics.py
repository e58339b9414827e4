"""``Sandbox.get_metrics`` (``GET /sandboxes/{id}/metrics``) and ``GET /sandboxes/metrics?sandbox_ids=``: CPU,
memory and disk of running sandboxes, read now from their cgroups and layers (``agentenv.sandbox.usage``).

E2B keeps a series sampled every few seconds; agentenv answers one point, read when asked (the CPU share over a
short window). A ``start``/``end`` range that does not hold that moment (with E2B's bucket of slack) gets no
point; a paused sandbox has none either.
"""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any

from fastapi import Query, Request, Response
from fastapi.responses import JSONResponse

from agentenv.sandbox import usage
from agentenv.sandbox.core import Sandbox
from agentenv.server.e2b.listing import refuse_unknown
from agentenv.server.e2b.plane import E2BError, ServiceDep, router_for

router = router_for()
BUCKET = 5  # seconds: E2B aligns its points to buckets this long, and its query times are whole seconds
MAX_IDS = 100


def _json(sb: Sandbox, u: usage.Usage, cpu_pct: float) -> dict[str, Any]:
    limits = sb.limits
    stamp = dt.datetime.fromtimestamp(u.at, dt.UTC).isoformat().replace("+00:00", "Z")
    return {"timestamp": stamp, "timestampUnix": int(u.at), "cpuCount": max(1, round(limits.cpus)),
            "cpuUsedPct": round(cpu_pct, 2), "memUsed": u.mem_used, "memTotal": limits.memory,
            "memCache": u.mem_cache, "diskUsed": u.disk_used, "diskTotal": limits.disk or 0}


@router.get("/sandboxes/metrics")
def many(request: Request, service: ServiceDep, sandbox_ids: str) -> Response:
    """The latest point of each sandbox named (comma-separated) that runs, by id."""
    refuse_unknown(request, frozenset({"sandbox_ids"}))
    ids = [i for i in dict.fromkeys(sandbox_ids.split(",")) if i]
    if not 1 <= len(ids) <= MAX_IDS:
        raise E2BError(400, f"sandbox_ids names {len(ids)} sandboxes: name 1 to {MAX_IDS}")
    found = {}
    for sid in ids:
        try:
            found[sid] = service.sandbox(sid)
        except (LookupError, ValueError):
            continue
    points = usage.sample(found.values())
    return JSONResponse({"sandboxes": {sid: _json(found[sid], u, pct) for sid, (u, pct) in points.items()}})


@router.get("/sandboxes/{sandbox_id}/metrics")
def one(request: Request, service: ServiceDep, sandbox_id: str,
        start: Annotated[int | None, Query(ge=0)] = None, end: Annotated[int | None, Query(ge=0)] = None) -> Response:
    """The sandbox's point now, if ``start``..``end`` (Unix seconds) holds it."""
    refuse_unknown(request, frozenset({"start", "end"}))
    sb = service.sandbox(sandbox_id)
    points = usage.sample([sb]) if sb.state == "running" else {}
    out = [_json(sb, u, pct) for u, pct in points.values()
           if (start is None or u.at >= start - BUCKET) and (end is None or u.at <= end + BUCKET)]
    return JSONResponse(out)
