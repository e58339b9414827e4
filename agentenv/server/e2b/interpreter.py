"""The code interpreter's port (49999): ``/execute`` streaming NDJSON, and ``/contexts``, over kernels that
live inside the sandbox. ``/execute`` runs code, so it takes the sandbox's envd token alone (``X-Access-Token``,
which the SDK sends it beside the traffic token); the contexts take either (the SDK sends them the traffic token).

A context is a persistent Python process (``agentenv.inside.kernel``; of ``language`` python, bash, or
javascript where the image has node: the kernel's request kinds) run as a job of the sandbox's keeper (as
E2B's ``user`` where the image has that account, else root: ``bridge.acting``), with its
stdin fed requests and its stdout read for events; it is found again by its job tag, so the server keeps no
state of its own. Because the kernel is an ordinary process of the sandbox, a memory snapshot, a pause or a
fork carries its variables: every child of a fork starts with the interpreter state of the moment it forked.
Executions in one context run one at a time; a client that leaves mid-execution (the SDK's timeout)
interrupts the kernel (SIGINT), and what the interrupted execution still prints is skipped by the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import uuid
import weakref
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route, Router

from agentenv.api import JobEnd, JobOutput
from agentenv.inside import kernel
from agentenv.sandbox.calls import AsUser
from agentenv.sandbox.core import Sandbox
from agentenv.server.e2b.bridge import acting, iterate, run, user_named
from agentenv.server.e2b.files import http_error
from agentenv.server.e2b.ports import CREDENTIAL
from agentenv.server.service import Service

TAG = "e2b-context:"  # a kernel job's tag: TAG + context id, then "/bash" or "/javascript" for those contexts,
# then "@" and the account it runs as
DEFAULT = "default"  # the default context of Python; of bash, "default-bash", of javascript "default-javascript"
# the names E2B's SDKs send for a language, and the kernel's language (kernel.LANGUAGES) they run as
LANGUAGES = {"": "python", "python": "python", "py": "python", "python3": "python", "bash": "bash", "sh": "bash"}
NODE = ("javascript", "js")  # run by node (agentenv.inside.nodejs), where the image has it


def _language(sb: Sandbox | None, name: Any) -> str:
    """The kernel language of a request's ``language``; a clear refusal (400) of any other. JavaScript is
    looked for in the sandbox (``node``), so that the refusal says what is missing."""
    if name is None or (isinstance(name, str) and name.lower() in LANGUAGES):
        return LANGUAGES[(name or "").lower()]
    if isinstance(name, str) and name.lower() in NODE and sb is not None:
        if sb.exec("command -v node", timeout=30).exit_code != 0:
            raise ValueError(f"language {name!r} needs node, which is not in this sandbox's image")
        return "javascript"
    raise ValueError(f"language {name!r} is not supported here: only python, bash and javascript (with node)")


def _split(tag: str) -> tuple[str, str, str | None]:
    """A kernel tag's context id, language and account (None in a tag of an older server)."""
    rest, _, account = tag.removeprefix(TAG).partition("@")
    cid, _, language = rest.partition("/")
    return cid, language or "python", account or None


def _find(sb: Sandbox, context_id: str) -> tuple[int, str, str | None] | None:
    """The pid, language and account of a context's running kernel."""
    for job in sb.jobs():
        if job.tag and job.tag.startswith(TAG) and job.exit_code is None:
            cid, language, account = _split(job.tag)
            if cid == context_id:
                return job.pid, language, account
    return None


def _contexts(sb: Sandbox) -> list[dict[str, Any]]:
    return [{"id": _split(j.tag)[0], "language": _split(j.tag)[1], "cwd": j.cwd or "/"}
            for j in sb.jobs() if j.tag and j.tag.startswith(TAG) and j.exit_code is None]


def _start(sb: Sandbox, context_id: str, cwd: str | None, user: str | None, language: str = "python") -> str:
    """Start a context's kernel as the account ``user`` names (``bridge.acting``: E2B's ``user`` by default,
    where the image has it); the folder it starts in (that account's home unless ``cwd``)."""
    calls = acting(sb, user)
    cwd = cwd or (calls.home if isinstance(calls, AsUser) else None)
    command, env = kernel.launch()
    account = calls.user if isinstance(calls, AsUser) else "root"
    calls.start(command, cwd=cwd, env=env, stdin=True,
                tag=TAG + context_id + ("" if language == "python" else "/" + language) + "@" + account)
    return cwd or "/"


def _default(language: str | None) -> str:
    return DEFAULT if language in (None, "python") else f"{DEFAULT}-{language}"


def _kernel(sb: Sandbox, cid: str, language: str | None, user: str | None, start: bool = True) -> tuple[int, str]:
    """The pid and language of context ``cid``'s kernel (a language's default context is started on first use,
    where ``start``; else its pid is 0). A ``language`` asked for besides a context must be the context's."""
    found = _find(sb, cid)
    if found is None:
        if cid != _default(language):
            raise FileNotFoundError(2, f"no context {cid!r}: create it with create_code_context()")
        if not start:
            return 0, language or "python"
        _start(sb, cid, None, user, language or "python")
        found = _find(sb, cid)
        assert found is not None
    if language is not None and found[1] != language:
        raise ValueError(f"context {cid!r} runs {found[1]}, not {language}: give a context or a language")
    if user is not None and found[2] is not None and found[2] != user:  # never run as another account than asked
        raise ValueError(f"context {cid!r} runs as {found[2]}, not {user}: create a context as {user} "
                         "(create_code_context) to run code as that account")
    return found[0], found[1]


class Interpreter:
    """The routes of port 49999 for every sandbox (the sandbox comes from the request's headers)."""

    def __init__(self, service: Service) -> None:
        self.service = service
        # a context's lock lives while an execution holds it: ids a client made up leave nothing behind
        self.locks: weakref.WeakValueDictionary[tuple[str, str], asyncio.Lock] = weakref.WeakValueDictionary()

    def _sandbox(self, request: Request) -> Sandbox:
        return self.service.sandbox(request.headers.get("e2b-sandbox-id", ""))

    async def execute(self, request: Request) -> Response:
        if request.scope.get(CREDENTIAL) != "envd":  # running code is envd's: the traffic token opens contexts only
            return JSONResponse({"code": 401, "message": "running code needs the sandbox's envd access token "
                                                         "(X-Access-Token, the envdAccessToken of create/connect): "
                                                         "its traffic token opens the interpreter's contexts only"},
                                401)
        try:
            body = _object(await request.json())
            code = body.get("code")
            if not isinstance(code, str):
                raise ValueError("code must be a string")
            env_vars, context_id = body.get("env_vars") or {}, body.get("context_id") or None
            if not isinstance(env_vars, dict) or not isinstance(context_id, str | None):
                raise ValueError("env_vars must be an object and context_id a string")
            env = {str(k): str(v) for k, v in env_vars.items()}
            sb = await run(self._sandbox, request)
            asked = await run(_language, sb, body.get("language")) if body.get("language") else None
            user = user_named(request.headers)
            cid = context_id or _default(asked)
            _, language = await run(_kernel, sb, cid, asked, user, False)  # a missing context is a 404 ...
            lock = self.locks.setdefault((sb.id, cid), asyncio.Lock())
        except Exception as e:  # noqa: BLE001 - an error body the SDK maps
            return http_error(e)
        return StreamingResponse(self._run(sb, cid, language, code, env, lock, user),
                                 media_type="application/x-ndjson")

    async def _run(self, sb: Sandbox, cid: str, language: str, code: str, env: dict[str, str],
                   lock: asyncio.Lock, user: str | None) -> AsyncIterator[bytes]:
        """The execution's events as NDJSON lines; a failure of the sandbox is the last line, as an error."""
        try:
            async for line in self._execute(sb, cid, language, code, env, lock, user):
                yield line
        except Exception as e:  # noqa: BLE001 - the stream has started: the failure is told in it
            yield _line({"type": "error", "name": type(e).__name__, "value": str(e), "traceback": ""})

    async def _execute(self, sb: Sandbox, cid: str, language: str, code: str, env: dict[str, str],
                       lock: asyncio.Lock, user: str | None) -> AsyncIterator[bytes]:
        async with lock:
            pid, language = await run(_kernel, sb, cid, language, user)  # ... and here, where it may have died since
            rid = uuid.uuid4().hex
            await run(sb.send_input, pid, kernel.request(rid, code, env, language))
            done = False
            buf, base, err_end = bytearray(), None, 0
            try:
                async for item in iterate(lambda: sb.output(pid)):
                    if isinstance(item, JobEnd):
                        yield _line({"type": "error", "name": "KernelDied", "value": f"the interpreter exited with "
                                     f"{item.exit_code}; the next execution starts a new one", "traceback": ""})
                        done = True
                        return
                    if not isinstance(item, JobOutput):
                        continue
                    if item.stream == "stderr":
                        err_end = item.offset + len(item.data)
                        continue
                    if base is None:
                        base = item.offset
                    buf += item.data
                    if len(buf) > kernel.MAX_LINE:
                        raise ValueError(f"the interpreter wrote a line over {kernel.MAX_LINE} bytes")
                    events, used = kernel.split_events(bytes(buf))
                    del buf[:used]
                    base += used
                    for event in events:
                        if event.pop("id", None) != rid:
                            continue  # left over from an execution whose client went away
                        if event.get("type") == "end":
                            done = True
                            with contextlib.suppress(ProcessLookupError):  # its end was read ahead: forgotten
                                await run(sb.discard, pid, (base, err_end))
                            return
                        yield _line(event)
            finally:
                if not done:  # the client left (its timeout): interrupt what still runs
                    await asyncio.shield(run(_interrupt, sb, pid))

    async def create(self, request: Request) -> Response:
        try:
            body = _object(await request.json() if await request.body() else {})
            cwd = body.get("cwd") or None
            if not isinstance(cwd, str | None):
                raise ValueError("cwd must be a string")
            sb = await run(self._sandbox, request)
            language = await run(_language, sb, body.get("language"))
            context_id = uuid.uuid4().hex[:16]
            cwd = await run(_start, sb, context_id, cwd, user_named(request.headers), language)
        except Exception as e:  # noqa: BLE001 - an error body the SDK maps
            return http_error(e)
        return JSONResponse({"id": context_id, "language": language, "cwd": cwd})

    async def list(self, request: Request) -> Response:
        try:
            sb = await run(self._sandbox, request)
            return JSONResponse(await run(_contexts, sb))
        except Exception as e:  # noqa: BLE001 - an error body the SDK maps
            return http_error(e)

    async def remove(self, request: Request) -> Response:
        try:
            sb = await run(self._sandbox, request)
            pid = await run(_kernel_or_404, sb, request.path_params["context_id"])
            await run(sb.signal, pid, signal.SIGKILL)
        except Exception as e:  # noqa: BLE001 - an error body the SDK maps
            return http_error(e)
        return Response(status_code=204)

    async def restart(self, request: Request) -> Response:
        try:
            sb = await run(self._sandbox, request)
            cid = request.path_params["context_id"]
            pid = await run(_kernel_or_404, sb, cid)
            ctx = next((c for c in await run(_contexts, sb) if c["id"] == cid), {})
            await run(sb.signal, pid, signal.SIGKILL)
            await run(_drain, sb, pid)
            await run(_start, sb, cid, ctx.get("cwd"), user_named(request.headers), ctx.get("language", "python"))
        except Exception as e:  # noqa: BLE001 - an error body the SDK maps
            return http_error(e)
        return Response(status_code=204)


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    return body


def _kernel_or_404(sb: Sandbox, context_id: str) -> int:
    found = _find(sb, context_id)
    if found is None:
        raise FileNotFoundError(2, f"no context {context_id!r}")
    return found[0]


def _interrupt(sb: Sandbox, pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, OSError):
        sb.signal(pid, signal.SIGINT)


def _drain(sb: Sandbox, pid: int) -> None:
    """Read a killed kernel's job to its end, so that the keeper forgets it (a stream that followed the job
    may have read its end first: then it is forgotten already)."""
    with contextlib.suppress(ProcessLookupError):
        for item in sb.output(pid):
            if isinstance(item, JobEnd):
                return


def _line(event: dict[str, Any]) -> bytes:
    return json.dumps(event).encode() + b"\n"


def routes(service: Service) -> Router:
    api = Interpreter(service)

    async def health(request: Request) -> Response:
        return Response(status_code=204)

    return Router(routes=[
        Route("/health", health, methods=["GET"]), Route("/execute", api.execute, methods=["POST"]),
        Route("/contexts", api.create, methods=["POST"]), Route("/contexts", api.list, methods=["GET"]),
        Route("/contexts/{context_id}", api.remove, methods=["DELETE"]),
        Route("/contexts/{context_id}/restart", api.restart, methods=["POST"])])
