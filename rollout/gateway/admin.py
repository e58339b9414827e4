"""The gateway's own routes for whoever runs it (``agentenv rollout gateway``): open, read and close sessions, and
hold new calls during a weight push. They need the gateway's admin token (``Authorization: Bearer``), which no
harness is given; a session's key opens none of them.

``POST /admin/sessions`` takes the run's settings for the episode (every field optional, none unknown) and answers
the session's capability: its id, its key, and the base URLs an OpenAI or an Anthropic client is given.
``DELETE /admin/sessions/{id}`` closes it (its capability stops working) and answers its summary and its records
(``rollout.trajectory`` dicts, reward unset: the caller's grader decides it).
"""

from __future__ import annotations

import hmac
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field

from rollout.gateway import export
from rollout.gateway.sessions import Budget, Session, SessionConfig
from rollout.gateway.turns import Gateway
from rollout.gateway.upstream import Sampling


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BudgetBody(Strict):
    turns: Annotated[int, Field(ge=1)] = 100
    tokens: Annotated[int, Field(ge=1)] = 65536
    wall_s: Annotated[float, Field(gt=0)] = 3600.0


class SamplingBody(Strict):
    temperature: Annotated[float, Field(ge=0)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    max_tokens: Annotated[int, Field(ge=1)] = 1024
    extra: dict[str, Any] = Field(default_factory=dict)


class OpenBody(Strict):
    budget: BudgetBody = BudgetBody()
    sampling: SamplingBody = SamplingBody()
    thinking: Literal["keep", "follow"] = "keep"
    call_timeout: Annotated[float, Field(gt=0)] = 900.0
    labels: dict[str, str] = Field(default_factory=dict)


def router(gateway: Gateway, admin_token: str) -> APIRouter:
    def admin(request: Request) -> None:
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, f"Bearer {admin_token}".encode()):
            raise HTTPException(401, "missing or wrong admin token")

    r = APIRouter(prefix="/admin", dependencies=[Depends(admin)])

    def find(sid: str) -> Session:
        for s in gateway.sessions.open_sessions():
            if hmac.compare_digest(s.id.encode(), sid.encode()):
                return s
        raise HTTPException(404, "no open session with this id")

    @r.post("/sessions")
    def open_session(body: OpenBody, request: Request) -> dict[str, Any]:
        s = body.sampling
        cfg = SessionConfig(Sampling(s.temperature, s.top_p, s.max_tokens, dict(s.extra)),
                            Budget(**body.budget.model_dump()), body.thinking, body.call_timeout)
        session = gateway.open(cfg, body.labels)
        base = str(request.base_url).rstrip("/")
        return {"id": session.id, "key": session.key, "openai_base_url": f"{base}/s/{session.id}/v1",
                "anthropic_base_url": f"{base}/s/{session.id}"}

    @r.get("/sessions/{sid}")
    def read_session(sid: str) -> dict[str, Any]:
        return export.session_summary(find(sid))

    @r.delete("/sessions/{sid}")
    def close_session(sid: str) -> dict[str, Any]:
        session = gateway.close(find(sid))
        return {"summary": export.session_summary(session),
                "records": [t.to_dict() for t in export.trajectories(session)]}

    @r.post("/hold")
    def hold() -> dict[str, bool]:
        gateway.hold_calls()
        return {"held": True}

    @r.post("/release")
    def release() -> dict[str, bool]:
        gateway.release_calls()
        return {"held": False}

    return r
