"""An E2B template build on this host: the SDK's steps as a Dockerfile, ``docker build``, and, for a template with a
start command, a sandbox started from the image, made ready and snapshotted with its memory.

Each step becomes Dockerfile instructions (``plan``): ``RUN`` (bash where the image has it, else sh; ``user``
wraps it in ``USER``), ``COPY`` of the archive the SDK uploaded for it (``--chown`` for its user; its mode set on
the files before the copy), ``ENV``, ``WORKDIR`` and ``USER`` (checked at once: a user the image lacks fails that
step). Build steps have no network (``BUILD_NETWORK``): this host reaches no registry, and a build container is a
plain Docker container, kept off the host's services. ``from_image`` takes local images and tries one pull; the
SDK's default ``e2bdev/base`` is ``agentenv/base`` here, as the ``base`` template is. A failure names its step
as E2B does (``base``, the step's number, or ``finalize`` for the start and ready commands).

With ``set_start_cmd`` / ``set_ready_cmd`` the build starts a sandbox of the image, runs the start command in the
background, runs the ready command until it succeeds, and takes a memory snapshot: a sandbox of the template is
restored from it, its process already running, instead of booting and starting it again.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import tarfile
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentenv.api import DEFAULT_IMAGE
from agentenv.config import paths
from agentenv.host import archives, images
from agentenv.sandbox.core import Sandbox
from agentenv.server.e2b import template_store as store
from agentenv.server.e2b.control import DISK

if TYPE_CHECKING:
    from agentenv.server.service import Service

BUILD_NETWORK = "none"
E2B_BASE = ("e2bdev/base", "e2bdev/base:latest")  # the SDK's from_base_image() and Template()'s default
READY_TIMEOUT = 300.0  # seconds the ready command has to succeed after the start command starts
READY_POLL = 0.2
_SHELL = 'command -v bash >/dev/null 2>&1 && exec bash -c "$1" || exec sh -c "$1"'  # bash where there is one
_NO_USER = re.compile(r"unable to find user ([^:\s]+)")
_EXIT = re.compile(r"returned a non-zero code: (\d+)")
_STEP = re.compile(r"^Step (\d+)/\d+ :")
GLOB = "-glob"  # the folder of the build context a glob copy's matches are moved to
_OFFLINE = ("apt-get", "apt ", "pip ", "pip3 ", "npm ", "bun ", "git clone", "curl ", "wget ")


class StepFailed(Exception):
    """A build step failed; ``step`` is E2B's name of it (``base``, ``1``..., ``finalize``)."""

    def __init__(self, message: str, step: str) -> None:
        super().__init__(message)
        self.message, self.step = message, step


@dataclass
class Plan:
    """A Dockerfile and, per instruction, the E2B step it comes from and what that step does (for its errors)."""

    lines: list[str] = field(default_factory=list)
    origins: list[str] = field(default_factory=list)
    what: list[str] = field(default_factory=list)
    copies: list[tuple[str, str, str, int | None]] = field(default_factory=list)  # (folder, hash, src, mode)
    user: str | None = None  # the template's user (its last set_user): what its sandboxes' commands run as

    def add(self, line: str, origin: str, what: str) -> None:
        self.lines.append(line)
        self.origins.append(origin)
        self.what.append(what)

    @property
    def dockerfile(self) -> str:
        return "".join(f"{line}\n" for line in self.lines)


def _one_line(value: str, what: str, step: str) -> str:
    if "\n" in value or "\r" in value or "\0" in value:
        raise store.TemplateRefused(f"step {step}: {what} {value[:60]!r} holds a line break, which a Dockerfile "
                                    "cannot carry")
    return value


def _relative(src: str, step: str) -> str:
    parts = Path(src).parts
    if not src or src.startswith("/") or ".." in parts:
        raise store.TemplateRefused(f"step {step}: copy source {src!r} must be a path inside the file context "
                                    "(relative, without '..')")
    return src


def _is_glob(src: str) -> bool:
    return any(c in src for c in "*?[")


def plan(base: str, steps: list[dict[str, Any]], is_dir: Any = None) -> Plan:
    """The Dockerfile of ``steps`` (the SDK's ``TemplateStep`` dicts) on ``base``; ``is_dir(folder, src)`` tells
    whether a copy's source is a folder in its upload (then its destination is one too)."""
    p = Plan()
    p.add(f"FROM {_one_line(base, 'image', 'base')}", "base", f"base image {base}")
    user, last = "root", None  # the build steps' user (Docker's root until a USER step); the last one asked for
    for i, step in enumerate(steps, 1):
        n, kind, args = str(i), step["type"], [str(a) for a in step.get("args") or []]
        if kind == "RUN":
            cmd, as_user = args[0], (args[1] if len(args) > 1 and args[1] else None)
            if as_user:
                p.add(f"USER {_one_line(as_user, 'user', n)}", n, f"run '{cmd}' as {as_user}")
            p.add("RUN " + json.dumps(["/bin/sh", "-c", _SHELL, "e2b-step", cmd]), n, f"RUN {cmd}")
            if as_user:
                p.add(f"USER {user}", n, f"back to user {user}")
        elif kind == "COPY":
            src, dest = _relative(args[0], n), _one_line(args[1], "destination", n)
            chown = _one_line(args[2], "user", n) if len(args) > 2 and args[2] else ""
            mode = int(args[3], 8) if len(args) > 3 and args[3] else None
            files_hash = step.get("filesHash")
            if not files_hash:
                raise store.TemplateRefused(f"step {n}: a COPY step needs its filesHash (the SDK sends it)")
            folder = f"step-{n}"
            if not dest.endswith("/") and (_is_glob(src) or src.endswith("/")
                                           or (is_dir is not None and is_dir(folder, src))):
                dest += "/"
            flag = f"--chown={chown} " if chown else ""
            source = f"{folder}{GLOB}/" if _is_glob(src) else f"{folder}/{src}"  # a glob is expanded by prepare()
            p.add(f"COPY {flag}" + json.dumps([source, dest]), n, f"copy '{src}' to '{dest}'")
            p.copies.append((folder, str(files_hash), src, mode))
        elif kind == "ENV":
            pairs = list(zip(args[::2], args[1::2], strict=False))
            if not pairs or len(args) % 2:
                raise store.TemplateRefused(f"step {n}: ENV takes name/value pairs, got {args!r}")
            words = []
            for k, v in pairs:
                if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
                    raise store.TemplateRefused(f"step {n}: {k!r} is not an environment variable name")
                words.append(f'{k}="' + _one_line(v, "value", n).replace("\\", "\\\\").replace('"', '\\"') + '"')
            p.add("ENV " + " ".join(words), n, "set envs " + ", ".join(k for k, _ in pairs))
        elif kind == "WORKDIR":
            p.add(f"WORKDIR {_one_line(args[0], 'workdir', n)}", n, f"set workdir {args[0]}")
        elif kind == "USER":
            user = last = _one_line(args[0], "user", n)
            p.add(f"USER {user}", n, f"set user {user}")
            p.add('RUN ["/bin/sh", "-c", ":"]', n, f"set user {user}")  # fails here when the image lacks the user
        else:
            raise store.TemplateRefused(f"step {n}: unknown step type {kind!r} (COPY, ENV, RUN, WORKDIR, USER are)")
    p.user = last
    return p


def failure(p: Plan, index: int, error: str) -> StepFailed:
    """E2B's error for Dockerfile instruction ``index`` of ``p`` failing with Docker's ``error``."""
    step, what = p.origins[index], p.what[index]
    cmd = what.removeprefix("RUN ")
    if m := _NO_USER.search(error):
        if what.startswith("set user"):
            return StepFailed(f"failed to set user '{m.group(1)}': invalid username: '{m.group(1)}' (the image has "
                              "no such account: add it with run_cmd('useradd -m NAME', user='root'))", step)
        cmd = what.split("'")[1] if "'" in what else cmd
        return StepFailed(f"failed to run command '{cmd}': command failed: unauthenticated: invalid username: "
                          f"'{m.group(1)}'", step)
    if what.startswith("RUN ") and (m := _EXIT.search(error)):
        hint = ""
        if any(word in cmd for word in _OFFLINE):
            hint = (" (template builds on this server have no network, and no package registry is reachable from "
                    "this host: bring the packages in a local image, or copy them in and install from files)")
        return StepFailed(f"failed to run command '{cmd}': exit status {m.group(1)}{hint}", step)
    return StepFailed(f"step {step} ({what}) failed: {error}", step)


def base_image(spec: dict[str, Any], say: Any) -> str:
    """The image the build starts from, or StepFailed('base') naming the fix."""
    if spec.get("fromImageRegistry"):
        raise StepFailed("registry credentials (from_image with username and password, from_aws_registry, "
                         "from_gcp_registry) are not used by this server, which reaches no registry: build or "
                         "'docker import' the image on this host and use from_image(name) without them", "base")
    if template := spec.get("fromTemplate"):
        if template in store.BUILTIN:
            return DEFAULT_IMAGE
        target = store.for_sandbox(template)
        if target is None:
            raise StepFailed(f"template '{template}' not found (from_template)", "base")
        return target.image
    name = str(spec.get("fromImage") or E2B_BASE[0])
    if images.present(name):
        return name
    if name in E2B_BASE:
        say(f"{name} is {DEFAULT_IMAGE} on this server")
        return DEFAULT_IMAGE
    reason = images.pull(name)
    if reason is None:
        return name
    raise StepFailed(f"image '{name}' is not on this host and could not be pulled ({reason}): no registry is "
                     f"reachable from this server, so build it here (docker build -t {name} .) or load it (docker "
                     "import / docker load), then build the template again", "base")


def prepare(context: Path, p: Plan) -> None:
    """Unpack each copy's upload into its folder of the build context and give its files their mode."""
    for folder, files_hash, src, mode in p.copies:
        archive = store.file_path(files_hash)
        if not archive.is_file():
            raise store.TemplateRefused(f"the files of '{src}' (hash {files_hash}) were never uploaded")
        dest = context / folder
        try:
            with tarfile.open(archive) as tar:
                archives.extract(tar, dest, outward_symlinks=True)  # a link is copied as a link, as E2B does
        except archives.UnsafeArchive as e:
            raise StepFailed(f"failed to copy '{src}': {e}", folder.removeprefix("step-")) from None
        if mode is not None:
            _set_mode(dest, src, mode)
        if _is_glob(src):
            _expand(dest, src, context / f"{folder}{GLOB}")


def _expand(dest: Path, src: str, staged: Path) -> None:
    """Move what the glob ``src`` matches in ``dest`` into ``staged``, as Docker's COPY lays it out (a file by its
    name, a folder's contents), so that COPY meets no glob: Docker's fails on a match that is a dangling link."""
    staged.mkdir()
    inside = os.path.realpath(dest) + os.sep
    matches = [m for m in glob.glob(str(dest / src)) if os.path.realpath(os.path.dirname(m)).startswith(inside[:-1])]
    if not matches:
        raise StepFailed(f"failed to copy '{src}': no files match it", dest.name.removeprefix("step-"))
    for m in sorted(matches):
        if os.path.isdir(m) and not os.path.islink(m):
            for child in os.listdir(m):
                os.replace(os.path.join(m, child), staged / child)
        else:
            os.replace(m, staged / os.path.basename(m))


def check_upload(archive: Path) -> None:
    """Refuse an uploaded archive now, naming the member (``archives.checked``), rather than at its build."""
    with tarfile.open(archive) as tar:
        archives.checked(tar, outward_symlinks=True)


def _set_mode(dest: Path, src: str, mode: int) -> None:
    inside = os.path.realpath(dest) + os.sep
    for match in glob.glob(str(dest / src)):
        paths_ = [match] if not os.path.isdir(match) else [os.path.join(r, f) for r, _, fs in os.walk(match)
                                                         for f in fs]
        for f in paths_:
            if not os.path.islink(f) and os.path.realpath(f).startswith(inside):
                os.chmod(f, mode)


def run(service: Service, template_id: str, build_id: str, spec: dict[str, Any]) -> None:
    """Build ``spec`` (the SDK's ``TemplateBuildStartV2``) as build ``build_id``; its end is in the store."""
    def say(message: str, level: str = "info", step: str | None = None) -> None:
        store.log(build_id, message, level, step)

    tag = f"agentenv-e2b/{template_id}:{build_id}"
    image_made = snapshot = None
    try:
        build = store.build_of(store.load(template_id), build_id)
        base = base_image(spec, say)
        with tempfile.TemporaryDirectory(prefix="e2b-build-", dir=paths().tmp) as tmp:
            context = Path(tmp)
            p = plan(base, spec.get("steps") or [], lambda folder, src: _upload_is_dir(folder, src, spec))
            prepare(context, p)
            (context / "Dockerfile").write_text(p.dockerfile)
            current = [0]

            def output(line: str) -> None:
                if m := _STEP.match(line):
                    current[0] = int(m.group(1)) - 1
                say(line, step=p.origins[min(current[0], len(p.origins) - 1)])

            force = bool(spec.get("force")) or any(s.get("force") for s in spec.get("steps") or [])
            try:
                images.build(str(context), tag, on_output=output, nocache=force, network=BUILD_NETWORK,
                             labels={"agentenv.e2b.template": template_id, "agentenv.e2b.build": build_id})
            except images.BuildFailed as e:
                e.discard()
                raise failure(p, current[0], e.error) from None
        image_made = tag
        if spec.get("startCmd") or spec.get("readyCmd"):
            snapshot = start_snapshot(service, tag, spec, build, p.user, template_id, build_id, say)
        if store.update(template_id, build_id, status="ready", image=tag, snapshot=snapshot,
                        user=p.user) is None:
            raise StepFailed("the template was deleted during its build", "finalize")
        say("Build finished")
    except BaseException as e:  # noqa: BLE001 - every failure ends the build as E2B's error
        if not isinstance(e, StepFailed):
            e = StepFailed(f"{type(e).__name__}: {e}", "finalize" if image_made else "base")
            say("".join(traceback.format_exception_only(e)).strip(), "debug")
        say(e.message, "error", e.step)
        store.update(template_id, build_id, status="error", reason={"message": e.message, "step": e.step})
        _discard(image_made, snapshot)


def _upload_is_dir(folder: str, src: str, spec: dict[str, Any]) -> bool:
    """Whether the copy of step ``folder`` names a folder of its upload (read from the archive's members)."""
    step = (spec.get("steps") or [])[int(folder.removeprefix("step-")) - 1]
    archive, name = store.file_path(str(step.get("filesHash"))), src.rstrip("/")
    if not archive.is_file():
        return False  # prepare() says it was never uploaded
    with tarfile.open(archive) as tar:
        return any((m.name == name and m.isdir()) or m.name.startswith(name + "/") for m in tar.getmembers())


def start_snapshot(service: Service, image: str, spec: dict[str, Any], build: dict[str, Any], user: str | None,
                   template_id: str, build_id: str, say: Any) -> str:
    """Start a sandbox of ``image``, its start command (as the template's ``user``, when it names one), wait for
    its ready command (as that user too); its memory snapshot's id."""
    start, ready = spec.get("startCmd"), spec.get("readyCmd")
    with service.reserve(1, build["memory"], DISK):
        sb = Sandbox.create(image, cpus=build["cpus"], memory=build["memory"], disk=DISK, network=True,
                            labels={"agentenv.e2b.build": build_id})
    try:
        calls = sb.as_user(user) if user else sb
        workdir = images.resolve(image).workdir  # the template's set_workdir, not the user's home
        proc = calls.spawn(start, cwd=workdir) if start else None
        if start:
            say(f"Running start command: {start}", step="finalize")
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            if proc is not None and proc.exit_code not in (None, 0):
                tail = proc.output()[-2000:]
                raise StepFailed(f"start command '{start}' failed: exit status {proc.exit_code}: {tail}", "finalize")
            if not ready:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                raise StepFailed(f"ready command '{ready}' did not succeed within {READY_TIMEOUT:g} s", "finalize")
            r = calls.exec(ready, timeout=max(1.0, left), cwd=workdir)
            if r.exit_code == 0:
                break
            time.sleep(READY_POLL)
        say("Sandbox is ready: taking its snapshot", step="finalize")
        snap = sb.snapshot(memory=True, labels={"agentenv.kind": store.TEMPLATE_KIND, "e2b.template": template_id,
                                                "e2b.build": build_id})
        return snap.id
    finally:
        sb.close()


def _discard(image: str | None, snapshot: str | None) -> None:
    from agentenv.sandbox.store import Snapshot

    if snapshot is not None:
        with contextlib.suppress(LookupError):
            Snapshot.get(snapshot).delete(background=True)
    if image is not None:
        images.remove(image)


def discard_template(rec: dict[str, Any]) -> None:
    """Remove the outputs of a deleted template's builds: snapshots, and images no sandbox or snapshot stands on."""
    from agentenv.sandbox.store import Snapshot

    for build in rec["builds"].values():
        _discard(None, build.get("snapshot"))
        image = build.get("image")
        if image and not any(s.image == image for s in Sandbox.list()) \
                and not any(s.labels.get("image") == image for s in Snapshot.list()):
            images.remove(image)
