"""The environment server's request and response models: with the api value types, the OpenAPI contract.

Requests are validated strictly (no "1" for 1, no NUL bytes, bounded sizes and names), so bad input is
a 422 with the field and the reason before any sandbox is touched. Responses that are sandbox values
(``SandboxInfo``, ``SnapshotInfo``, ``ExecResult``, ``ProcessInfo``, ``JobInfo``, ``FileInfo``) are the
dataclasses of ``agentenv.api``; the models here are the server's own (capacity, deletions, errors).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from fastapi import Path as PathParam
from fastapi import Query
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    Tag,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from agentenv.api import DEFAULT_TTL, MAX_DEPTH, MAX_FORK, SnapshotInfo
from agentenv.netpolicy import MAX_ENTRIES

_NO_NUL = r"^[^\x00]*$"
_MIN_MEMORY = 32 << 20
_MEMORY = (r"^(?:(?:3[2-9]|[4-9][0-9]|[1-9][0-9]{2,6})[mM]|[1-9][0-9]{0,3}(?:\.[0-9]{1,3})?[gG])(?:[iI]?[bB])?$")
_MIN_DISK = 16 << 20
_DISK = (r"^(?:(?:1[6-9]|[2-9][0-9]|[1-9][0-9]{2,7})[mM]|[1-9][0-9]{0,5}(?:\.[0-9]{1,3})?[gG]|"
         r"[1-9][0-9]{0,2}(?:\.[0-9]{1,3})?[tT])(?:[iI]?[bB])?$")
_WORKDIR = r"^/(?:[A-Za-z0-9_][A-Za-z0-9._-]{0,63}(?:/[A-Za-z0-9_][A-Za-z0-9._-]{0,63}){0,15})?$"
_SPECIAL = r"^/(?:proc|sys|dev)(?:/|$)"
def _number(v: Any) -> Any:
    """Numbers are numbers: no "1" for 1 and no true for 1 (JSON Schema's integer does allow 3.0)."""
    if isinstance(v, str | bool | bytes):
        raise ValueError("expected a number")
    return v


Int = Annotated[int, BeforeValidator(_number)]
Float = Annotated[float, BeforeValidator(_number)]
# a sandbox's deadline in seconds from now (api.DEFAULT_TTL when left out); null: none, only when sent so
TTL = Annotated[float, Field(ge=1e-3, le=1e7, strict=True)] | None
Seconds = Annotated[float, Field(gt=0), BeforeValidator(_number)]  # the bound inside, so the schema says exclusiveMinimum
Text = Annotated[str, Field(pattern=_NO_NUL, max_length=1 << 20)]
Name = Annotated[str, Field(pattern=_NO_NUL, max_length=4096)]


def _map_schema(key_pattern: str, value_max: int) -> dict[str, Any]:
    """The OpenAPI schema of a str -> str mapping that constrains every key (pydantic says patternProperties)."""
    return {"type": "object", "maxProperties": 256,
            "propertyNames": {"type": "string", "pattern": key_pattern, "maxLength": 256},
            "additionalProperties": {"type": "string", "pattern": _NO_NUL, "maxLength": value_max}}


def _not_special(path: str | None) -> str | None:
    if path is not None and re.match(_SPECIAL, path):
        raise ValueError("workdir cannot be under /proc, /sys or /dev")
    return path


_LABEL_KEY = r"^[^\x00]+$"
_ENV_KEY = r"^[A-Za-z_][A-Za-z0-9_]*$"
Labels = Annotated[dict[Annotated[str, Field(pattern=_LABEL_KEY, max_length=256)],
                        Annotated[str, Field(pattern=_NO_NUL, max_length=4096)]],
                   Field(max_length=256), WithJsonSchema(_map_schema(_LABEL_KEY, 4096))]
Env = Annotated[dict[Annotated[str, Field(pattern=_ENV_KEY, max_length=256)],
                     Annotated[str, Field(pattern=_NO_NUL, max_length=1 << 16)]],
                Field(max_length=256), WithJsonSchema(_map_schema(_ENV_KEY, 1 << 16))]
Workdir = Annotated[Annotated[str, Field(pattern=_WORKDIR)] | None, AfterValidator(_not_special), WithJsonSchema({
    "anyOf": [{"type": "string", "pattern": _WORKDIR, "not": {"pattern": _SPECIAL}}, {"type": "null"}],
    "description": "absolute working directory (not under /proc, /sys or /dev)"})]
Memory = Annotated[str | Int, WithJsonSchema({
    "anyOf": [{"type": "string", "pattern": _MEMORY}, {"type": "integer", "minimum": _MIN_MEMORY, "maximum": 1 << 50}],
    "description": "'<n>m' (n >= 32), '<n>g', or bytes (>= 32 MiB)"})]
Disk = Annotated[str | Int | None, WithJsonSchema({
    "anyOf": [{"type": "string", "pattern": _DISK}, {"type": "integer", "minimum": _MIN_DISK, "maximum": 1 << 50},
              {"type": "null"}],
    "description": "what the sandbox's files may take: '<n>m' (n >= 16), '<n>g', '<n>t', or bytes (>= 16 MiB); "
                   "null for no limit, where the server allows it (--unlimited-disk)"})]
SandboxId = Annotated[str, PathParam(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$", description="sandbox id")]
SnapshotId = Annotated[str, PathParam(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$", description="snapshot id")]
Pid = Annotated[int, PathParam(ge=1, le=1 << 22, description="process id inside the sandbox")]
_PATH_TEXT = "absolute, or relative to the sandbox's working directory; resolved inside the sandbox"
FilePath = Annotated[str, Query(min_length=1, max_length=4096, pattern=r"^[^\x00]+$", description=_PATH_TEXT)]
BodyPath = Annotated[str, Field(min_length=1, max_length=4096, pattern=r"^[^\x00]+$", description=_PATH_TEXT)]
Depth = Annotated[int, Query(ge=1, le=MAX_DEPTH, description="levels listed (1: the folder's children)")]
_MAX_OFFSET = (1 << 53) - 1  # bytes: beyond any job's output, and every integer up to it is exact as a JSON float
Offsets = Annotated[list[Annotated[int, Field(ge=0, le=_MAX_OFFSET), BeforeValidator(_number)]], Field(
    min_length=2, max_length=2, description="absolute byte offsets [stdout, stderr] of the job's output")]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


Rule = Annotated[str, Field(min_length=1, max_length=256, pattern=_NO_NUL)]
_RULES_TEXT = ("IPv4 addresses, CIDR blocks and (allow_out only) host names; an allowed destination wins over a "
               "denied one, so deny_out ['0.0.0.0/0'] with an allow_out list is an allowlist (agentenv.netpolicy)")


class NetworkRules(_Body):
    """A sandbox's outbound rules, E2B's shape. Entries are checked by ``agentenv.netpolicy`` when the rules are
    set: one that cannot be enforced (IPv6, a wildcard name, a host name in deny_out, an address no sandbox may
    reach) is a 400 NetworkRuleError naming it. Any other key is refused (nothing is accepted and ignored)."""

    allow_out: list[Rule] = Field(default_factory=list, max_length=MAX_ENTRIES, description=_RULES_TEXT)
    deny_out: list[Rule] = Field(default_factory=list, max_length=MAX_ENTRIES, description=_RULES_TEXT)

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, v: Any) -> Any:
        if isinstance(v, dict) and (unknown := sorted(str(k) for k in set(v) - {"allow_out", "deny_out"})):
            raise ValueError(f"unknown network option(s) {unknown}: only allow_out and deny_out are enforced")
        return v


class NetworkRequest(NetworkRules):
    """``PUT /v1/sandboxes/{id}/network``: the rules that replace the sandbox's (both lists, whole)."""


def _network_kind(v: Any) -> str:
    return "bool" if isinstance(v, bool) else "rules"


NetworkField = Annotated[Annotated[StrictBool, Tag("bool")] | Annotated[NetworkRules, Tag("rules")],
                         Discriminator(_network_kind)]


class CreateRequest(_Body):
    image: str = Field("agentenv/base", pattern=r"^[A-Za-z0-9][A-Za-z0-9._/:@-]{0,254}$")
    cpus: Float = Field(1.0, ge=0.01, le=64)
    memory: Memory = "1g"
    pids: Int = Field(512, ge=8, le=1 << 22)
    disk: Disk = "10g"
    network: NetworkField = Field(False, description="false: loopback only; true: the outside (never the host, the "
                                                     "other sandboxes or link-local addresses); or outbound rules")
    env: Env = Field(default_factory=dict)
    workdir: Workdir = None
    ttl: TTL = DEFAULT_TTL
    labels: Labels = Field(default_factory=dict)
    share_memory: StrictBool | None = Field(False, description="its memory forks share the pages none of them wrote "
                                            "(KSM): true, false, or null: where this host can and no other agentenv "
                                            "home's sandboxes share (what the envs ask for); a timing side channel "
                                            "across sharing sandboxes (docs/security.md)")

    @field_validator("memory")
    @classmethod
    def _memory(cls, v: str | int) -> str | int:
        if isinstance(v, bool) or (isinstance(v, int) and not _MIN_MEMORY <= v <= 1 << 50) or \
                (isinstance(v, str) and not re.match(_MEMORY, v)):
            raise ValueError("memory must be '<n>m' (n >= 32), '<n>g', or a byte count >= 32 MiB")
        return v

    @field_validator("disk")
    @classmethod
    def _disk(cls, v: str | int | None) -> str | int | None:
        if v is None:
            return v
        if isinstance(v, bool) or (isinstance(v, int) and not _MIN_DISK <= v <= 1 << 50) or \
                (isinstance(v, str) and not re.match(_DISK, v)):
            raise ValueError("disk must be '<n>m' (n >= 16), '<n>g', '<n>t', a byte count >= 16 MiB, or null")
        return v


class ExecRequest(_Body):
    command: Text
    timeout: Annotated[float, Field(ge=1e-3, le=1e6, strict=True)] | None = 600.0
    cwd: Name | None = None
    env: Env = Field(default_factory=dict)


class SpawnRequest(_Body):
    command: Text
    cwd: Name | None = None
    env: Env = Field(default_factory=dict)


TermSize = Annotated[list[Annotated[int, Field(ge=1, le=4096), BeforeValidator(_number)]], Field(
    min_length=2, max_length=2, description="a terminal's [rows, cols]")]


class StartRequest(SpawnRequest):
    timeout: Annotated[float, Field(ge=1e-3, le=1e6, strict=True)] | None = None
    stdin: StrictBool = False
    tag: Name | None = None
    pty: TermSize | None = Field(None, description="start it on a new terminal of this size, its controlling one: "
                                                   "the output is one stream, 'pty', and stdin types at it")


class ResizeRequest(_Body):
    size: TermSize


class OutputRequest(_Body):
    offsets: Offsets | None = Field(None, description="where to start; null: the oldest byte the sandbox kept")
    follow: StrictBool = Field(True, description="wait for more output, and the end; false: what is there now")


class DiscardRequest(_Body):
    offsets: Offsets


class PathRequest(_Body):
    path: BodyPath


class MoveRequest(_Body):
    src: BodyPath
    dst: BodyPath


class SnapshotRequest(_Body):
    memory: StrictBool = False
    labels: Labels = Field(default_factory=dict)


class ForkRequest(_Body):
    count: Int = Field(1, ge=1, le=MAX_FORK)
    memory: StrictBool = True  # False: the children get the files only, with fresh processes
    ttl: TTL = DEFAULT_TTL


class TTLRequest(_Body):
    ttl: Float = Field(ge=1e-3, le=1e7)


class RestoreRequest(_Body):
    labels: Labels = Field(default_factory=dict)
    ttl: TTL = DEFAULT_TTL


_PORT = r"(?:6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[0-9]{1,4})"
_SOURCE = (r"^https?://[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"  # a host name or IPv4 address, a port
           r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*(?::" + _PORT + r")?$")


class ImportRequest(_Body):
    """Pull a snapshot from another server (``agentenv.server.pull``)."""

    id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$", description="the snapshot's id on the source")
    source: str = Field(pattern=_SOURCE, max_length=200,
                        description="the source server's base url, e.g. http://10.0.0.2:8700")
    token: str = Field(min_length=1, max_length=4096, pattern=r"^[\x21-\x7e]+$",
                       description="the source server's bearer token")
    chunk_size: Int = Field(8 << 20, ge=64 << 10, le=16 << 20, description="bytes per chunk (each has a sha256)")
    retries: Int = Field(3, ge=0, le=5, description="tries again per chunk after a dropped connection")
    keep_export: StrictBool = Field(False, description="leave the source's packed archive there once every chunk "
                                                       "is in (other servers pull it too: a spread fork)")
    resumable: StrictBool = Field(True, description="keep the checked chunks of a cut-off pull for the next try; "
                                                    "false: a one-shot pull (a spread fork's) leaves nothing")


class ImportResult(BaseModel):
    snapshot: dict[str, Any]
    chunks: int
    fetched: int  # chunks this call brought
    resumed_at: int  # chunks an earlier, cut-off import had already brought


class MigrateFinish(_Body):
    """The end of a post-copy migration, on its source (``agentenv.sandbox.migration``)."""

    snapshot: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$", description="the migration's snapshot")
    delivered: StrictBool = Field(description="the receiver has every page (its GET .../memory said all_in)")


class MigrationStarted(BaseModel):
    snapshot: SnapshotInfo
    page_server: str
    key: str = Field(description="the migration's key (hex), which its page server asks the receiver to prove: "
                                 "give it to the receiver's receive call alone")


class ReceiveRequest(_Body):
    """Restore a post-copy migration's snapshot on the receiver (``agentenv.sandbox.migration``)."""

    labels: Labels = Field(default_factory=dict)
    key: str = Field(pattern=r"^[0-9a-f]{64}$", description="the key the source's migrate call returned (hex)")
    ttl: TTL = DEFAULT_TTL  # what is left of the moved sandbox's deadline


class MigrationFinished(BaseModel):
    id: str
    moved: bool


class MemoryIn(BaseModel):
    id: str
    all_in: bool


class KillRequest(_Body):
    signal: Int = Field(9, ge=1, le=64)


class FileWritten(BaseModel):
    path: str
    size: int


class JobDone(BaseModel):
    pid: int
    size: int | None = Field(None, description="bytes written to its stdin (input)")


class DirMade(BaseModel):
    path: str
    made: bool = Field(description="false: it already was a folder")


class Removed(BaseModel):
    path: str


class Deleted(BaseModel):
    id: str
    state: Literal["closed", "deleted"]


class Capacity(BaseModel):
    max_sandboxes: int
    live_sandboxes: int
    free_sandboxes: int
    max_memory: int
    memory_used: int
    free_memory: int
    max_disk: int = Field(description="bytes of disk the live sandboxes may use together (their disk limits)")
    disk_used: int = Field(description="the disk limits of the live sandboxes, added up")
    free_disk: int


class ServerInfo(BaseModel):
    version: str
    capacity: Capacity
    recovered: dict[str, list[str]] = Field(description="what the server found on disk when it started: "
                                                        "running (reattached), paused, lost")


class ErrorBody(BaseModel):
    error: str = Field(description="the exception class, e.g. SandboxNotFound")
    message: str
    fix: str | None = None
    id: str | None = Field(None, description="the sandbox or snapshot id the error is about")
    retry_after: float | None = None


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI ``responses`` of a route that can fail with these statuses (each an ``ErrorBody``)."""
    text = {401: "missing or wrong bearer token", 404: "no such sandbox, snapshot, file or process",
            409: "the operation does not fit the sandbox's state", 422: "the request does not match the schema",
            429: "quota exceeded: see Retry-After",
            502: "the other server does not answer (ConnectionLost) or sent a damaged chunk (TransferError)", 507: "the snapshot store is full",
            403: "refused: by the server's policy (a sandbox without a disk limit: DiskLimitRequired), a path "
                 "the file API does not touch (PermissionError), or an imported snapshot not sealed with the servers' "
                 "key or holding what no server packs (UntrustedSnapshot)",
            501: "this host cannot enforce the disk limit (DiskLimitUnsupported) or give the network "
                 "(NetworkUnavailable) asked for",
            400: "bad input (e.g. a path with a NUL byte, an invalid size, a network rule that cannot be enforced: "
                 "NetworkRuleError)"}
    out: dict[int | str, dict[str, Any]] = {c: {"model": ErrorBody, "description": text[c]} for c in codes}
    out["default"] = {"model": ErrorBody, "description": "any other error, with its class, message and fix"}
    return out
