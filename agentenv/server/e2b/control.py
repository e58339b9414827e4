"""E2B's control plane over the same ``Service`` as the native routes: create, connect, pause, kill, list,
fork and snapshot sandboxes with the JSON bodies and status codes the ``e2b`` SDK (2.x) expects.

What maps to what: a template is an image (``base`` is ``agentenv/base``; ``code-interpreter-v1``, the code
interpreter SDK's default, is ``agentenv/code-interpreter``: the same with the data stack people chart with,
numpy, pandas and matplotlib, built offline by the bootstrap from pinned wheels),
or a snapshot id (a sandbox restored from it, as E2B starts sandboxes from snapshots), or a template built here
(``templates``: its image, or the snapshot taken once its start command was ready); ``timeout`` is the
sandbox's TTL; ``metadata`` its labels; ``envVars`` its environment. A sandbox whose TTL runs out is killed, as
in E2B, unless it was made with ``autoPause`` (``lifecycle={"on_timeout": "pause"}``): then it is paused, and
``Sandbox.connect`` brings it back (the choice is its ``agentenv.on_expiry`` label). ``connect`` and ``refresh``
never shorten a longer timeout; ``set_timeout`` sets it. A paused sandbox forks too (E2B answers 409): its
children are restored from its pause snapshot. A key of a body that agentenv does not know is a 400 naming it
(the bodies: ``bodies``). Errors are ``{code, message}``; a full quota is a 429 with ``Retry-After``, which the SDK
retries (``plane``: the errors, the API key and the router that every E2B control route shares).

The network: ``allow_internet_access`` absent or true is a sandbox with network (E2B's default), false one with
loopback only; ``network.allowOut`` / ``denyOut`` are the sandbox's outbound rules (``agentenv.netpolicy``: an
allowed destination wins, as in E2B), as ``bodies`` reads them. ``PUT /sandboxes/{id}/network`` (``Sandbox.update_network``)
replaces the rules; a sandbox made with loopback only has none to replace (409). ``allowPublicTraffic`` and
``maskRequestHost`` become labels that ``ports`` enforces; ``lifecycle.autoResume`` one that ``ports`` wakes the
paused sandbox on. What agentenv does not enforce (``dnsServers``, ``egressProxy``, per-host ``rules``,
``httpsPorts``, any other key) is refused with a 400 that names it, never accepted and ignored.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import Body, Query, Request, Response
from fastapi.responses import JSONResponse

from agentenv import errors, netpolicy
from agentenv.api import DEFAULT_DISK, DEFAULT_IMAGE
from agentenv.config import parse_size
from agentenv.sandbox import expiry
from agentenv.sandbox.core import Sandbox
from agentenv.server.e2b import ports, template_store
from agentenv.server.e2b.bodies import (
    DEFAULT_TIMEOUT,
    ConnectBody,
    ForkBody,
    NetworkConfig,
    NetworkUpdate,
    NewSandbox,
    PauseBody,
    Refresh,
    SnapshotBody,
    Timeout,
)
from agentenv.server.e2b.plane import E2BError, ServiceDep, e2b_time, router_for
from agentenv.server.e2b.tokens import CLIENT_ID, ENVD_VERSION, envd_token, traffic_token
from agentenv.server.service import Service
from agentenv.snapshot.store import Snapshot

CODE_INTERPRETER_IMAGE = "agentenv/code-interpreter"  # the base image and numpy, pandas, matplotlib (bootstrap builds it)
TEMPLATES = {"base": DEFAULT_IMAGE, "code-interpreter-v1": CODE_INTERPRETER_IMAGE,
             "code-interpreter": CODE_INTERPRETER_IMAGE}
MEMORY, DISK, CPUS = 1 << 30, parse_size(DEFAULT_DISK), 1.0  # what every E2B sandbox gets: Sandbox.create's
# defaults (E2B takes them from the template), so that `agentenv serve --warm-pool N` has them started
TEMPLATE_LABEL = "e2b.template"
META_PREFIX = "e2b.meta."


router = router_for()


def sandbox_json(request: Request, sb: Sandbox, state: str | None = None, *, detail: bool = False) -> dict[str, Any]:
    """A sandbox as E2B describes it: ``Sandbox`` (``detail=False``, the reply of create/connect/fork) or
    ``SandboxDetail``/``ListedSandbox``."""
    labels = sb.labels
    token = request.app.state.token
    body: dict[str, Any] = {"templateID": labels.get(TEMPLATE_LABEL, sb.image), "sandboxID": sb.id,
                            "clientID": CLIENT_ID, "envdVersion": ENVD_VERSION,
                            "envdAccessToken": envd_token(token, sb.id),
                            "trafficAccessToken": traffic_token(token, sb.id)}
    if getattr(request.app.state, "e2b_domain", None):
        body["domain"] = request.app.state.e2b_domain  # the SDK's sandbox_domain: what get_host names
    if detail:
        limits, network = sb.limits, sb.network
        body.update(startedAt=e2b_time(sb.created_at), endAt=e2b_time(sb.expires_at), cpuCount=max(1, round(limits.cpus)),
                    memoryMB=limits.memory >> 20, diskSizeMB=(limits.disk or 0) >> 20, state=state or sb.state,
                    metadata={k[len(META_PREFIX):]: v for k, v in labels.items() if k.startswith(META_PREFIX)},
                    allowInternetAccess=network is not None,
                    lifecycle={"onTimeout": expiry.action(labels),
                               "autoResume": labels.get(ports.AUTO_RESUME_LABEL) == "true"})
        if network is not None:
            body["network"] = {"allowOut": list(network.allow_out), "denyOut": list(network.deny_out)}
        if labels.get(ports.PUBLIC_LABEL) == "true":
            body.setdefault("network", {})["allowPublicTraffic"] = True
        if ports.MASK_LABEL in labels:
            body.setdefault("network", {})["maskRequestHost"] = labels[ports.MASK_LABEL]
    return body


def _labels(template: str, metadata: dict[str, str] | None, on_expiry: str) -> dict[str, str]:
    return {TEMPLATE_LABEL: template, expiry.ON_EXPIRY: on_expiry,
            **{META_PREFIX + k: v for k, v in (metadata or {}).items()}}


def _keep_alive(sb: Sandbox, ttl: float) -> None:
    """Let the sandbox live ``ttl`` seconds from now, unless it already may live longer (E2B's connect and
    refresh never shorten a timeout)."""
    end = sb.expires_at
    if end is not None and end < time.time() + ttl:
        sb.set_ttl(ttl)


def _create(request: Request, service: Service, body: NewSandbox) -> JSONResponse:
    template = body.template_id
    ttl = float(body.timeout or DEFAULT_TIMEOUT)
    built = template_store.for_sandbox(template)  # a template built here: its image, or its start snapshot
    labels = {**_labels(template, body.metadata, body.on_expiry()), **(body.network or NetworkConfig.model_validate({})).labels()}
    if body.auto_resume is not None and body.auto_resume.enabled:  # ports wakes it on a request, with this timeout
        labels.update({ports.AUTO_RESUME_LABEL: "true", ports.TIMEOUT_LABEL: str(int(ttl))})
    if body.auto_pause and body.auto_pause_memory is False:  # the reaper's pause keeps the files only
        labels[expiry.PAUSE_MEMORY] = "false"
    if built and built.user:
        labels[template_store.USER_LABEL] = built.user
    image = built.image if built else TEMPLATES.get(template, template)
    snap = Snapshot.get(built.snapshot) if built and built.snapshot else _snapshot_or_none(template)
    cpus, memory = (built.cpus, built.memory) if built else (CPUS, MEMORY)
    if built and built.snapshot and body.env_vars:
        raise E2BError(400, f"template {template!r} starts restored, its start command already running: envs cannot "
                            "reach it; set them in the template (set_envs), or pass them to commands.run")
    network = body.network_asked()
    if snap is not None:
        sb = _restore(service, snap, labels, body, network)
        sb.set_ttl(ttl)
    else:
        with service.reserve(1, memory, DISK):
            sb = service.remember(Sandbox.create(image, cpus=cpus, memory=memory, disk=DISK, env=body.env_vars or {},
                                                 network=network, ttl=ttl, labels=labels))
    return JSONResponse(sandbox_json(request, sb, "running"), 201)


def _restore(service: Service, snap: Snapshot, labels: dict[str, str], body: NewSandbox,
             network: bool | dict[str, list[str]]) -> Sandbox:
    """A sandbox from a snapshot: its network is the snapshot's, and rules asked for replace its rules (a sandbox
    that had none keeps loopback only, so asking it for more is refused)."""
    asked = body.network is not None or body.allow_internet_access is not None
    if not asked:
        return service.restore(snap, labels=labels)
    has_network = bool(snap.spec.get("network"))
    if network is not False and not has_network:
        raise E2BError(400, f"snapshot {snap.id} is of a sandbox with loopback only: its sandboxes have no network "
                            "to give rules to (create one from an image with the network asked for)")
    sb = service.restore(snap, labels=labels)
    if has_network:
        rules = network if isinstance(network, dict) else {"allow_out": [],
                                                           "deny_out": [] if network else [netpolicy.ALL_TRAFFIC]}
        try:
            sb.update_network(rules["allow_out"], rules["deny_out"])
        except BaseException:
            sb.close()
            service.forget(sb.id)
            raise
    return sb


def _snapshot_or_none(template: str) -> Snapshot | None:
    if not template.startswith("snap-"):
        return None
    try:
        return Snapshot.get(template)
    except (errors.SnapshotNotFound, ValueError):
        return None


@router.post("/v2/sandboxes")
@router.post("/sandboxes")
def create(request: Request, service: ServiceDep, body: Annotated[NewSandbox, Body()]) -> Response:
    return _create(request, service, body)


@router.post("/v2/sandboxes/{sandbox_id}/connect")
@router.post("/sandboxes/{sandbox_id}/connect")
@router.post("/sandboxes/{sandbox_id}/resume")
def connect(request: Request, service: ServiceDep, sandbox_id: str,
            body: Annotated[ConnectBody | None, Body()] = None) -> Response:
    """A running sandbox as it is (200), its timeout extended but never shortened; a paused one resumed (201)
    with the timeout asked for."""
    sb = service.sandbox(sandbox_id)
    ttl = float(body.timeout if body and body.timeout else DEFAULT_TIMEOUT)
    if sb.settled_state() == "paused":  # after a pause under way (the timeout's, say); on_resume="reboot" (memory
        # false): booted from its files, as a files-only pause is
        service.resume(sandbox_id, memory=not (body is not None and body.memory is False)).set_ttl(ttl)
        return JSONResponse(sandbox_json(request, sb, "running"), 201)
    _keep_alive(sb, ttl)
    return JSONResponse(sandbox_json(request, sb, "running"), 200)


@router.post("/sandboxes/{sandbox_id}/pause")
def pause(service: ServiceDep, sandbox_id: str, body: Annotated[PauseBody | None, Body()] = None) -> Response:
    memory = not (body is not None and body.memory is False)  # false: the files only, a boot afresh on resume
    sb = service.sandbox(sandbox_id)
    if sb.state == "paused":
        raise E2BError(409, f"sandbox {sandbox_id} is already paused")
    service.call(sandbox_id, lambda s: s.pause(memory=memory))
    return Response(status_code=204)


@router.delete("/sandboxes/{sandbox_id}")
def kill(service: ServiceDep, sandbox_id: str) -> Response:
    service.sandbox(sandbox_id).close()
    service.forget(sandbox_id)
    return Response(status_code=204)


@router.get("/sandboxes/{sandbox_id}")
def get(request: Request, service: ServiceDep, sandbox_id: str) -> Response:
    return JSONResponse(sandbox_json(request, service.sandbox(sandbox_id), detail=True))


@router.put("/sandboxes/{sandbox_id}/network")
def update_network(service: ServiceDep, sandbox_id: str, body: Annotated[NetworkUpdate, Body()]) -> Response:
    """``Sandbox.update_network``: the rules replaced whole (omitted lists are cleared, as in E2B); 409 for a
    sandbox made with loopback only."""
    allow, deny = body.rules(body.allow_internet_access)
    service.call(sandbox_id, lambda s: s.update_network(allow, deny))
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/timeout")
def set_timeout(service: ServiceDep, sandbox_id: str, body: Annotated[Timeout, Body()]) -> Response:
    service.sandbox(sandbox_id).set_ttl(float(body.timeout or 0))
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/refreshes")
def refresh(service: ServiceDep, sandbox_id: str, body: Annotated[Refresh | None, Body()] = None) -> Response:
    """``duration`` seconds more to live (a longer timeout is kept)."""
    _keep_alive(service.sandbox(sandbox_id), float(body.duration if body and body.duration else DEFAULT_TIMEOUT))
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/fork")
def fork(request: Request, service: ServiceDep, sandbox_id: str, body: Annotated[ForkBody, Body()]) -> Response:
    """``count`` children of a sandbox, memory and all (processes, the interpreter's variables); those of a paused
    one come from its pause snapshot (E2B answers 409 there)."""
    ttl = float(body.timeout or DEFAULT_TIMEOUT)
    out = []
    for kid in service.fork(sandbox_id, body.count, memory=True, ttl=ttl):
        out.append({"sandbox": sandbox_json(request, kid, "running")})
    return JSONResponse(out, 201)


@router.post("/sandboxes/{sandbox_id}/snapshots")
def snapshot(service: ServiceDep, sandbox_id: str, body: Annotated[SnapshotBody | None, Body()] = None) -> Response:
    """A snapshot (memory too, unless ``memory: false``) that ``Sandbox.create(template=<its id>)`` starts from."""
    memory = True if body is None or body.memory is None else body.memory
    labels = {"e2b.name": body.name} if body and body.name else {}
    snap = service.call(sandbox_id, lambda s: s.snapshot(memory=memory, labels=labels))
    return JSONResponse(_snapshot_json(snap), 201)


def _snapshot_json(snap: Snapshot) -> dict[str, Any]:
    name = snap.labels.get("e2b.name")
    return {"snapshotID": snap.id, "names": [name] if name else []}


@router.get("/snapshots")
def list_snapshots(sandbox_id: Annotated[str | None, Query(alias="sandboxID")] = None, name: str | None = None,
                   limit: Annotated[int, Query(ge=1, le=1000)] = 100,
                   next_token: Annotated[str | None, Query(alias="nextToken")] = None) -> Response:
    snaps = [s for s in sorted(Snapshot.list(), key=lambda s: (s.created_at, s.id))
             if s.labels.get("agentenv.kind") not in ("pause", template_store.TEMPLATE_KIND)
             and (sandbox_id is None or s.sandbox_id == sandbox_id)
             and (name is None or s.labels.get("e2b.name") == name)]
    if next_token:
        ids = [s.id for s in snaps]
        snaps = snaps[ids.index(next_token) + 1:] if next_token in ids else []
    page = snaps[:limit]
    headers = {"x-next-token": page[-1].id} if len(snaps) > limit else {}
    return JSONResponse([_snapshot_json(s) for s in page], headers=headers)
