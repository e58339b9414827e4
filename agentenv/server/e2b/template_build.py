"""An E2B template build on this host, in agentenv's own sandboxes: the steps run in a build sandbox made from the
base image, its files become one image layer on top of the base (``agentenv.host.layers``), and a template with a
start command gets a sandbox started from that image, made ready and snapshotted with its memory.

Why not ``docker build``: Docker's legacy builder (the one Debian 12's docker.io has; rootless BuildKit is not
packaged there) runs every step as the host's real root, with no user namespace, no pids limit and no memory or
CPU limit of the build's own. A build sandbox is a sandbox like any other: a user namespace of its own uid range
(its root is an unprivileged host uid), no network, the CPU and memory the template asks for (``cpuCount``,
``memoryMB``, else E2B's defaults), the pids limit and disk limit of every sandbox, seccomp and few capabilities.

The steps (``template_plan``) run with Docker's meaning. ``RUN``: the command in the sandbox as the step's user
(else the current one), in the working folder, with the image's variables and the ENV steps' before it; what it
left running is killed when it ends, as a ``docker build`` step's container ends. ``COPY``: the upload, checked on
the host (``agentenv.host.archives``), is never unpacked there: the files the step takes are sent as a tar to a
process inside the sandbox (``template_copy``, ``agentenv.inside.unpack``), so every path and link resolves in the
sandbox's own root. ``ENV``, ``WORKDIR``, ``USER`` change what later steps run with and the image's config.
Builds are not cached: each one runs its steps (``force`` and ``skip_cache`` hold by construction). The SDK's
default ``e2bdev/base`` is ``agentenv/base`` here, as the ``base`` template is; ``from_image`` takes local images
and tries one pull. Every log line of a step is the build's log, under the step's name.

With ``set_start_cmd`` / ``set_ready_cmd`` the build starts a sandbox of the image, runs the start command in the
background, runs the ready command until it succeeds, and takes a memory snapshot: a sandbox of the template is
restored from it, its process already running, instead of booting and starting it again.
"""

from __future__ import annotations

import contextlib
import shlex
import tarfile
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentenv.api import DEFAULT_IMAGE, JobEnd, JobOutput
from agentenv.config import paths
from agentenv.errors import AgentEnvError, UnknownUser
from agentenv.host import archives, images, layers, userns
from agentenv.inside import unpack
from agentenv.sandbox.calls import Calls
from agentenv.sandbox.core import Sandbox
from agentenv.server.e2b import template_copy
from agentenv.server.e2b import template_store as store
from agentenv.server.e2b.control import DISK
from agentenv.server.e2b.template_plan import (
    Copy,
    Plan,
    Run,
    SetEnv,
    SetUser,
    StepFailed,
    Workdir,
    expand,
    no_such_user,
    plan,
    run_failed,
    within,
)

if TYPE_CHECKING:
    from agentenv.server.service import Service

__all__ = ["StepFailed", "check_upload", "discard_template", "run"]

E2B_BASE = ("e2bdev/base", "e2bdev/base:latest")  # the SDK's from_base_image() and Template()'s default
READY_TIMEOUT = 300.0  # seconds the ready command has to succeed after the start command starts
READY_POLL = 0.2
STEP_TIMEOUT = 3600.0  # seconds one RUN step may take
_SHELL = 'command -v bash >/dev/null 2>&1 && exec bash -c "$1" || exec sh -c "$1"'  # bash where there is one
_UNPACK_ENV = "AGENTENV_UNPACK"
_UNPACK = f'exec python3 -I -S -c \'import os;exec(os.environ.pop("{_UNPACK_ENV}"))\''
_STRAYS = "kill -9 -1 2>/dev/null; true"  # every process but the keeper (PID 1) and this shell
Say = Callable[..., None]


def check_upload(archive: Path) -> None:
    """Refuse an uploaded archive now, naming the member (``archives.checked``), rather than at its build."""
    with tarfile.open(archive) as tar:
        archives.checked(tar, outward_symlinks=True)


def base_image(spec: dict[str, Any], say: Say) -> str:
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


class _Lines:
    """Output bytes, cut into lines for the log (a partial last line waits for the rest)."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.say, self.rest = say, {"stdout": b"", "stderr": b""}

    def feed(self, stream: str, data: bytes) -> None:
        *lines, self.rest[stream] = (self.rest.get(stream, b"") + data).split(b"\n")
        for line in lines:
            self.say(line.decode(errors="replace"))

    def flush(self) -> None:
        for stream, rest in self.rest.items():
            if rest:
                self.say(rest.decode(errors="replace"))
            self.rest[stream] = b""


class Builder:
    """The steps of a plan run in one build sandbox, and what they set: variables, working folder, user."""

    def __init__(self, sb: Sandbox, base: str, say: Say) -> None:
        info = images.inspect(base)
        config = info.get("Config") or {}
        self.sb, self.say = sb, say
        self.env = dict(e.split("=", 1) for e in config.get("Env") or [] if "=" in e)
        self.workdir = config.get("WorkingDir") or "/"
        self.user = (config.get("User") or "root").split(":")[0]
        self.image_user: str | None = None  # set by USER steps

    def step(self, n: str, action: Run | Copy | SetEnv | Workdir | SetUser) -> None:
        if isinstance(action, Run):
            self.run(n, action)
        elif isinstance(action, Copy):
            self.copy(n, action)
        elif isinstance(action, SetEnv):
            values = {k: expand(v, self.env) for k, v in action.pairs}  # each from the variables before the step
            self.env.update(values)
        elif isinstance(action, Workdir):
            self.workdir = within(self.workdir, expand(action.path, self.env)).rstrip("/") or "/"
            try:
                self.sb.make_dir(self.workdir)
            except OSError as e:
                raise StepFailed(f"failed to set workdir '{self.workdir}': {e}", n) from None
        else:
            self._account(action.name, None, n)
            self.user = self.image_user = action.name

    def _account(self, name: str, cmd: str | None, n: str) -> Calls:
        try:
            return self.sb.as_user(name)
        except UnknownUser:
            if name == "root":  # an image without /etc/passwd: its root is still uid 0, as Docker runs it
                return self.sb
            raise StepFailed(no_such_user(name, cmd), n) from None

    def run(self, n: str, action: Run) -> None:
        calls = self._account(action.user or self.user, action.cmd, n)
        lines = _Lines(lambda line: self.say(line, step=n))
        command = f"exec /bin/sh -c {shlex.quote(_SHELL)} e2b-step {shlex.quote(action.cmd)}"
        r = calls.exec(command, timeout=STEP_TIMEOUT, cwd=self.workdir, env=self.env, on_output=lines.feed)
        lines.flush()
        self.sb.exec(_STRAYS, timeout=60)
        if r.exit_code != 0 or r.timed_out:
            raise StepFailed(run_failed(action.cmd, r.exit_code, r.timed_out, STEP_TIMEOUT,
                                        self.sb.limits.memory), n)

    def copy(self, n: str, action: Copy) -> None:
        dest = within(self.workdir, expand(action.dest, self.env))
        upload = store.file_path(action.files_hash)
        if not upload.is_file():
            raise StepFailed(f"failed to copy '{action.src}': its files (hash {action.files_hash}) were never "
                             "uploaded", n)
        with tempfile.TemporaryFile(dir=paths().tmp) as placed:
            try:
                single = template_copy.write(upload, action.src, action.mode, placed, self.sb.limits.disk or DISK)
            except (archives.UnsafeArchive, template_copy.NothingToCopy, template_copy.TooLarge,
                    tarfile.TarError) as e:
                raise StepFailed(f"failed to copy '{action.src}': {e}", n) from None
            placed.seek(0)
            job = self.sb.start(f"{_UNPACK} {shlex.quote(dest)} {'as' if single else 'into'} "
                                f"{shlex.quote(action.owner)}", env={_UNPACK_ENV: _unpack_source()}, stdin=True,
                                timeout=STEP_TIMEOUT)
            with contextlib.suppress(BrokenPipeError):  # it stopped reading: its end says why
                while chunk := placed.read(1 << 20):
                    self.sb.send_input(job.pid, chunk)
            self.sb.close_input(job.pid)
        said, end = b"", None
        for item in self.sb.output(job.pid):
            if isinstance(item, JobOutput):
                said += item.data
            elif isinstance(item, JobEnd):
                end = item
        text = said.decode(errors="replace").strip()
        if end is None or end.exit_code != 0:
            if text.startswith("unable to find user "):
                raise StepFailed(no_such_user(text.split()[-1], f"copy '{action.src}'"), n)
            raise StepFailed(f"failed to copy '{action.src}' to '{dest}': {text or 'the copy did not end'}", n)


def _unpack_source() -> str:
    assert unpack.__file__ is not None
    return Path(unpack.__file__).read_text()


def build(service: Service, p: Plan, base: str, build: dict[str, Any], tag: str, template_id: str, build_id: str,
          say: Say) -> None:
    """Run ``p``'s steps on ``base`` in a build sandbox (``build``'s CPUs and memory) and load the result as the
    image ``tag``."""
    labels = {"agentenv.e2b.template": template_id, "agentenv.e2b.build": build_id}
    with service.reserve(1, build["memory"], DISK):
        sb = Sandbox.create(base, cpus=build["cpus"], memory=build["memory"], disk=DISK, network=False,
                            ttl=STEP_TIMEOUT * (len(p.steps) + 1),  # reaped should its server die mid-build
                            labels={"agentenv.e2b.build": build_id})
    snap = None
    try:
        builder = Builder(sb, base, say)
        for i, (n, action) in enumerate(p.steps, 1):
            say(f"Step {i}/{len(p.steps)} : {action}", step=n)
            builder.step(n, action)
        say("Saving the build's files as an image layer", step="finalize")
        try:
            snap = sb.snapshot(memory=False, labels={"agentenv.kind": "e2b-build", **labels})
            sb.close()
            with tempfile.TemporaryDirectory(prefix="e2b-layer-", dir=paths().tmp) as tmp:
                layer = layers.write_layer(snap.fs_dir, int(snap.spec["uids"]), userns.SIZE, Path(tmp) / "layer.tar",
                                           DISK)
                snap.delete()
                snap = None
                layers.load(base, layer if layer.entries else None, tag,
                            env=[f"{k}={v}" for k, v in builder.env.items()], workdir=builder.workdir,
                            user=builder.image_user, labels=labels, history=f"agentenv e2b template build {build_id}")
        except (AgentEnvError, OSError) as e:
            raise StepFailed(f"the build's files could not be made an image: {e}", "finalize") from None
    finally:
        sb.close()
        if snap is not None:
            snap.delete()


def run(service: Service, template_id: str, build_id: str, spec: dict[str, Any]) -> None:
    """Build ``spec`` (the SDK's ``TemplateBuildStartV2``) as build ``build_id``; its end is in the store."""
    def say(message: str, level: str = "info", step: str | None = None) -> None:
        store.log(build_id, message, level, step)

    tag = f"agentenv-e2b/{template_id}:{build_id}"
    image_made = snapshot = None
    try:
        build_rec = store.build_of(store.load(template_id), build_id)
        base = base_image(spec, say)
        p = plan(spec.get("steps") or [])
        build(service, p, base, build_rec, tag, template_id, build_id, say)
        image_made = tag
        if spec.get("startCmd") or spec.get("readyCmd"):
            snapshot = start_snapshot(service, tag, spec, build_rec, p.user, template_id, build_id, say)
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


def start_snapshot(service: Service, image: str, spec: dict[str, Any], build: dict[str, Any], user: str | None,
                   template_id: str, build_id: str, say: Say) -> str:
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
    from agentenv.snapshot.store import Snapshot

    if snapshot is not None:
        with contextlib.suppress(LookupError):
            Snapshot.get(snapshot).delete(background=True)
    if image is not None:
        images.remove(image)


def discard_template(rec: dict[str, Any]) -> None:
    """Remove the outputs of a deleted template's builds: snapshots, and images no sandbox or snapshot stands on."""
    from agentenv.snapshot.store import Snapshot

    for build in rec["builds"].values():
        _discard(None, build.get("snapshot"))
        image = build.get("image")
        if image and not any(s.image == image for s in Sandbox.list()) \
                and not any(s.labels.get("image") == image for s in Snapshot.list()):
            images.remove(image)
