"""The records of E2B templates built on this host: names, tags, builds, their logs and uploaded files.

Everything lives under ``$AGENTENV_HOME/e2b-templates``, so a restarted server knows every template::

    templates/<id>.json   a template: its names, its tags (tag -> build id) and its builds (status, image,
                          snapshot of its start command, user, limits); written whole and renamed into place
    logs/<build>.jsonl    a build's log entries, one JSON object a line, appended as the build goes
    files/<hash>.tar      an archive the SDK uploaded for a ``copy`` step, named by the SDK's files hash

A name is ``name`` or ``name:tag``; a bare name means the tag ``default``, as in E2B. A build's tags move to it
when it succeeds, so a failed rebuild leaves the template as it was. Writers hold one lock (a thread lock and
``flock`` on ``.lock``), because a change reads a record and writes it back.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentenv.config import paths, write_json
from agentenv.snapshot.store import pid_alive

DEFAULT_TAG = "default"
BUILTIN = ("base", "code-interpreter-v1", "code-interpreter")  # templates every server has (control.TEMPLATES)
TEMPLATE_KIND = "e2b-template"  # the agentenv.kind label of a template's start snapshot
USER_LABEL = "e2b.user"  # a sandbox of a template that names its user: who its calls run as when they name none
NAME = re.compile(r"^(?:[a-z0-9][a-z0-9_-]{0,63}/)?[a-z0-9][a-z0-9._-]{0,127}$")
TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
HASH = re.compile(r"^[0-9a-f]{16,128}$")
ID = re.compile(r"^[a-z0-9]{20}$")
FINAL = ("ready", "error")
_lock = threading.Lock()


class TemplateNotFound(FileNotFoundError):
    """No template, build or tag of that name: a FileNotFoundError, so that every route answers it with 404."""


class TemplateRefused(ValueError):
    """A template call that cannot be served as asked; the message says why and what to do (HTTP 400)."""


def root() -> Path:
    return paths().templates


def _dirs() -> tuple[Path, Path, Path]:
    r = root()
    out = (r / "templates", r / "logs", r / "files")
    for d in out:
        d.mkdir(parents=True, exist_ok=True)
    return out


@contextlib.contextmanager
def locked() -> Iterator[None]:
    """Hold the store's lock (threads of this process, and other processes on this home)."""
    _dirs()
    with _lock, open(root() / ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def split_name(name: str) -> tuple[str, str]:
    """``name[:tag]`` as (name, tag); TemplateRefused for a name or tag E2B would not take."""
    base, _, tag = name.partition(":")
    tag = tag or DEFAULT_TAG
    if not NAME.match(base):
        raise TemplateRefused(f"invalid template name {base!r}: use lowercase letters, digits, '.', '_' and '-' "
                              "(optionally one 'team/' prefix)")
    if not TAG.match(tag):
        raise TemplateRefused(f"invalid tag {tag!r}: use letters, digits, '.', '_' and '-', without ':'")
    return base, tag


def check_tags(tags: list[str]) -> None:
    for t in tags:
        if not TAG.match(t):
            raise TemplateRefused(f"invalid tag {t!r}: a tag is letters, digits, '.', '_' and '-' (no ':', no "
                                  "name part), e.g. 'production'")


def _path(template_id: str) -> Path:
    if not ID.match(template_id):
        raise TemplateNotFound(f"template '{template_id}' not found")
    return _dirs()[0] / f"{template_id}.json"


def load(template_id: str) -> dict[str, Any]:
    try:
        return dict(json.loads(_path(template_id).read_text()))
    except FileNotFoundError:
        raise TemplateNotFound(f"template '{template_id}' not found") from None


def save(rec: dict[str, Any]) -> None:
    write_json(_path(rec["id"]), rec, indent=1, sort_keys=True)


def all_records() -> list[dict[str, Any]]:
    out = []
    for f in sorted(_dirs()[0].glob("*.json")):
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
            out.append(json.loads(f.read_text()))
    return out


def find(id_or_name: str) -> dict[str, Any] | None:
    """The template of an id or a name (without its tag), or None."""
    if ID.match(id_or_name) and _path(id_or_name).exists():
        with contextlib.suppress(TemplateNotFound):
            return load(id_or_name)
    return next((r for r in all_records() if id_or_name in r["names"]), None)


def get(id_or_name: str) -> dict[str, Any]:
    rec = find(id_or_name)
    if rec is None:
        raise TemplateNotFound(f"template '{id_or_name}' not found")
    return rec


def request(name: str, tags: list[str], cpus: float, memory: int) -> tuple[dict[str, Any], str, list[str]]:
    """A new build of the template named ``name[:tag]`` (made when new); returns (record, build id, its tags)."""
    base, tag = split_name(name)
    check_tags(tags)
    if base in BUILTIN or base.startswith("snap-"):
        raise TemplateRefused(f"the name {base!r} is one of this server's own templates or snapshots: pick another")
    build_id = str(uuid.uuid4())
    wanted = list(dict.fromkeys([tag, *tags]))
    with locked():
        rec = find(base) or {"id": secrets.token_hex(10), "names": [base], "created_at": time.time(), "tags": {},
                             "builds": {}}
        rec["builds"][build_id] = {"status": "waiting", "tags": wanted, "created_at": time.time(),
                                   "cpus": cpus, "memory": memory, "pid": os.getpid()}
        save(rec)
    return rec, build_id, wanted


def build_of(rec: dict[str, Any], build_id: str) -> dict[str, Any]:
    build = rec["builds"].get(build_id)
    if build is None:
        raise TemplateNotFound(f"build '{build_id}' of template '{rec['id']}' not found")
    pid = build.get("pid")
    if build["status"] not in FINAL and pid != os.getpid() and not (pid and pid_alive(pid)):
        build = {**build, "status": "error", "reason": {"message": "the server that ran this build stopped "
                                                        "before it ended: build it again", "step": "finalize"}}
    return dict(build)


def update(template_id: str, build_id: str, **changes: Any) -> dict[str, Any] | None:
    """Change a build's fields; a build that became ``ready`` takes its tags. None when the template is gone."""
    with locked():
        try:
            rec = load(template_id)
        except TemplateNotFound:
            return None
        build = rec["builds"].get(build_id)
        if build is None:
            return None
        build.update(changes)
        if changes.get("status") == "ready":
            now = time.time()
            for t in build["tags"]:
                rec["tags"][t] = {"build": build_id, "at": now}
        save(rec)
        return rec


def assign(target: str, tags: list[str]) -> tuple[str, list[str]]:
    """Point ``tags`` at the build that ``target`` (``name:tag``) names; returns (build id, tags)."""
    base, tag = split_name(target)
    check_tags(tags)
    with locked():
        rec = get(base)
        if tag not in rec["tags"]:
            raise TemplateNotFound(f"tag '{tag}' of template '{base}' not found")
        build_id = rec["tags"][tag]["build"]
        for t in tags:
            rec["tags"][t] = {"build": build_id, "at": time.time()}
        save(rec)
    return build_id, tags


def unassign(name: str, tags: list[str]) -> None:
    with locked():
        rec = get(split_name(name)[0])
        missing = [t for t in tags if t not in rec["tags"]]
        if missing:
            raise TemplateNotFound(f"tag(s) {missing} of template '{name}' not found")
        for t in tags:
            del rec["tags"][t]
        save(rec)


def remove(template_id: str) -> dict[str, Any]:
    """Drop a template's record, its logs and the uploads no other template's build copies (its images and
    snapshots are the caller's to remove); returns the record."""
    with locked():
        rec = get(template_id)
        _path(rec["id"]).unlink()
        kept = {h for other in all_records() for b in other["builds"].values() for h in b.get("files", [])}
        for h in {h for b in rec["builds"].values() for h in b.get("files", [])} - kept:
            with contextlib.suppress(FileNotFoundError):
                file_path(h).unlink()
    for build_id in rec["builds"]:
        with contextlib.suppress(FileNotFoundError):
            log_path(build_id).unlink()
    return rec


@dataclass(frozen=True)
class Target:
    """What a sandbox of a built template starts from: its image, or the snapshot of its started command."""

    image: str
    snapshot: str | None
    cpus: float
    memory: int
    user: str | None = None  # its last set_user: the account its sandboxes' calls run as when they name none


def for_sandbox(template: str) -> Target | None:
    """The ready build that ``Sandbox.create(template)`` names (an id or name, ``:tag`` optional), None when no
    template here has that name; TemplateRefused for one that is not ready or asks for what is not served."""
    base, _, tag = template.partition(":")
    if base in BUILTIN or base.startswith("snap-") or not (ID.match(base) or NAME.match(base)):
        return None
    rec = find(base)
    if rec is None:
        return None
    entry = rec["tags"].get(tag or DEFAULT_TAG)
    if entry is None:
        raise TemplateRefused(f"template '{base}' has no ready build tagged '{tag or DEFAULT_TAG}' (tags: "
                              f"{sorted(rec['tags']) or 'none'}); wait for its build, or build it")
    build = build_of(rec, entry["build"])
    return Target(image=build["image"], snapshot=build.get("snapshot"), cpus=build["cpus"], memory=build["memory"],
                  user=build.get("user"))


# logs
def log_path(build_id: str) -> Path:
    return _dirs()[1] / f"{uuid.UUID(build_id)}.jsonl"


def log(build_id: str, message: str, level: str = "info", step: str | None = None) -> None:
    entry = {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + f".{int(time.time() % 1 * 1e6):06d}Z",
             "level": level, "message": message}
    if step is not None:
        entry["step"] = step
    with open(log_path(build_id), "a") as f:
        f.write(json.dumps(entry) + "\n")


def logs(build_id: str, offset: int = 0, limit: int = 100, level: str | None = None) -> list[dict[str, Any]]:
    """Log entries from ``offset`` (their index), at most ``limit``, of ``level`` and above when given."""
    order = ("debug", "info", "warn", "error")
    try:
        lines = log_path(build_id).read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines[offset:]:
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            break  # a line being written
        if level is None or order.index(entry["level"]) >= order.index(level):
            out.append(entry)
        if len(out) >= limit:
            break
    return out


# uploaded files
def file_path(files_hash: str) -> Path:
    if not HASH.match(files_hash):
        raise TemplateRefused(f"invalid files hash {files_hash[:80]!r}: the SDK sends a hex digest")
    return _dirs()[2] / f"{files_hash}.tar"
