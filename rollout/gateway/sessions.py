"""Sessions: one episode of a harness, reached by an unguessable capability, with the run's settings and budgets.

A session is opened by the run (``Gateway.open``) and handed to the harness as a base URL that holds the session's
id (``http://127.0.0.1:PORT/s/<id>``, the API's own path under it) and an API key. Both are 256-bit random; a
request needs both (the key as ``Authorization: Bearer`` or Anthropic's ``x-api-key``), compared in constant time,
or it is answered 401, whatever it asks. A harness asking for any model gets the run's policy (the name it asked
for is echoed back and recorded); the run's sampling settings are imposed on every call.

Budgets are the run's, per episode: engine calls (``turns``), generated tokens and wall time. A call past a budget
is answered in the API's own terms, a final assistant message saying so with the API's "length" stop reason,
never a broken connection, and the session's ``stopped`` says which budget ended it.

Tool-call ids: each API sees ids of its own shape that are unique in the session (``call_3_0`` for OpenAI,
``toolu_3_0`` for Anthropic: call 3's first tool call); ``k3_id`` maps them back to the ids the model generated, so
a history renders as the model saw it.
"""

from __future__ import annotations

import asyncio
import hmac
import re
import secrets
import time
from dataclasses import dataclass, field

from rollout.gateway.messages import Answer
from rollout.gateway.tape import Tape
from rollout.gateway.upstream import Sampling

_API_ID = re.compile(r"(?:call|toolu|fc)_(\d+)_(\d+)")


class Unauthorized(Exception):
    """No session has this capability and key."""


@dataclass(frozen=True)
class Budget:
    """An episode's limits: engine calls, generated tokens, seconds since the session opened."""

    turns: int = 100
    tokens: int = 65536
    wall_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.turns < 1 or self.tokens < 1 or self.wall_s <= 0:
            raise ValueError("a budget's turns, tokens and wall_s must be positive")


@dataclass(frozen=True)
class SessionConfig:
    """The run's settings for every call of a session. ``thinking``: ``keep`` (an answer's reasoning stays in the
    prompt even when the harness drops it from its history: the model sees what it generated) or ``follow``
    (the prompt is what the harness sends; dropped reasoning starts a ``thinking_stripped`` branch)."""

    sampling: Sampling = field(default_factory=Sampling)
    budget: Budget = field(default_factory=Budget)
    thinking: str = "keep"
    call_timeout: float = 900.0     # one call, waits for a weight push included


@dataclass
class Session:
    """One episode's capability, settings, tape and counters."""

    id: str
    key: str
    config: SessionConfig
    tape: Tape
    labels: dict[str, str] = field(default_factory=dict)
    opened: float = field(default_factory=time.monotonic)
    stopped: str | None = None      # the budget that ended it: "turns", "tokens" or "wall_s"
    errors: int = 0                 # calls the engine failed (an infrastructure failure, never the policy's)
    retries: int = 0                # calls answered from the tape (a retry, never resampled)
    lost_retries: int = 0           # retries of calls that never got an answer (sampled: nothing was recorded)
    asked_models: set[str] = field(default_factory=set)
    inflight: dict[str, asyncio.Future[Answer]] = field(default_factory=dict)
    stored: dict[str, list[dict[str, object]]] = field(default_factory=dict)   # Responses API: id → history

    @property
    def generated(self) -> int:
        return sum(len(n.output_ids) for n in self.tape.nodes)

    @property
    def calls(self) -> int:
        return sum(1 for n in self.tape.nodes if n.done)

    def spent(self) -> str | None:
        """The budget a new call would exceed, or None."""
        b = self.config.budget
        if self.calls >= b.turns:
            return "turns"
        if self.generated >= b.tokens:
            return "tokens"
        if time.monotonic() - self.opened >= b.wall_s:
            return "wall_s"
        return None

    def api_id(self, prefix: str, node: int, i: int) -> str:
        return f"{prefix}_{node}_{i}"

    def k3_id(self, api_id: str) -> str:
        """The id the model generated for a call the harness names ``api_id`` (unknown ids are kept as given)."""
        m = _API_ID.fullmatch(api_id)
        if m is None:
            return api_id
        node, i = int(m.group(1)), int(m.group(2))
        if node < len(self.tape.nodes):
            calls = self.tape.nodes[node].answer.get("tool_calls") or []
            if i < len(calls):
                return str(calls[i]["id"])
        return api_id


class Sessions:
    """The open sessions of one gateway."""

    def __init__(self) -> None:
        self._open: dict[str, Session] = {}

    def add(self, config: SessionConfig, tape: Tape, labels: dict[str, str] | None = None) -> Session:
        s = Session(secrets.token_urlsafe(32), "sk-agentenv-" + secrets.token_urlsafe(32), config, tape,
                    dict(labels or {}))
        self._open[s.id] = s
        return s

    def get(self, session_id: str, key: str) -> Session:
        """The session with this id and key; Unauthorized otherwise (the same answer for either being wrong)."""
        s = self._open.get(session_id)
        right = s.key if s is not None else "sk-agentenv-" + "x" * 43
        if not hmac.compare_digest(key.encode(), right.encode()) or s is None:
            raise Unauthorized("unknown session or wrong API key")
        return s

    def pop(self, session_id: str) -> Session:
        return self._open.pop(session_id)

    def open_sessions(self) -> list[Session]:
        return list(self._open.values())

    def __len__(self) -> int:
        return len(self._open)
