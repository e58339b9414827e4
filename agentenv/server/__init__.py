"""The environment server: every operation of the sandbox API over HTTP (FastAPI), msgpack or JSON bodies.

``agentenv serve`` runs one per host. Every route but ``/health`` and ``/metrics`` needs
``Authorization: Bearer <token>`` (compared in constant time); the server refuses to start without a
token and binds 127.0.0.1 unless told otherwise. Errors are typed: each ``AgentEnvError`` maps to an
HTTP status and a body ``{error, message, fix, id}`` that the client turns back into the same class.

All state lives on disk (sandbox records and the snapshot store), so a server killed with ``kill -9``
and started again lists every paused sandbox and snapshot, reattaches to the running sandboxes and
reports the ones whose processes died as ``lost``; what the kill cut short is mended first (a sandbox
left frozen is thawed, half-made fork children are removed, a pause is finished or rolled back), in
the background past a few seconds. A background thread pauses (or closes, where they asked) sandboxes
past their TTL (``Sandbox.reap_expired``); quotas on live sandboxes, memory and disk answer 429 with Retry-After.

Its rooms: ``schemas`` (request and response models), ``service`` (sandbox cache, quotas, TTL reaper,
metrics), ``routing`` (token, msgpack/JSON, typed errors), ``streaming`` (a job's output in a thread of its
own), ``limits`` (bounded bodies, connection deadlines), ``routes/`` (one router per resource) and ``app``
(``create_app``, ``serve``).
"""

from agentenv.server.app import DEFAULT_PORT, TOKEN_ENV, create_app, load_token, serve, uvicorn_config
from agentenv.server.routing import OPEN_PATHS

__all__ = ["DEFAULT_PORT", "OPEN_PATHS", "TOKEN_ENV", "create_app", "load_token", "serve", "uvicorn_config"]
