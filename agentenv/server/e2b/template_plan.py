"""An E2B template's steps (the SDK's ``TemplateStep`` dicts) as typed steps, checked before a build starts, and
the errors E2B gives when one fails.

The steps are those of a Dockerfile, run with Docker's meaning by ``template_build`` in a sandbox: ``RUN`` (bash
where the image has it, else sh; as ``user`` when the step names one, else the current user), ``COPY`` (its
upload's files, owned by its ``user`` or root, its ``mode`` on the files), ``ENV`` (values expanded from the
variables before it: ``$NAME``, ``${NAME}``, ``${NAME:-default}``, ``${NAME:+alt}``), ``WORKDIR`` (relative to
the one before, expanded, made when missing) and ``USER`` (the image must have the account). A failure names its
step as E2B does (``base``, the step's number, or ``finalize`` for the start and ready commands).
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field
from typing import Any

from agentenv.server.e2b import template_store as store

_OFFLINE = ("apt-get", "apt ", "pip ", "pip3 ", "npm ", "bun ", "git clone", "curl ", "wget ")
_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?:(:[-+])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class StepFailed(Exception):
    """A build step failed; ``step`` is E2B's name of it (``base``, ``1``..., ``finalize``)."""

    def __init__(self, message: str, step: str) -> None:
        super().__init__(message)
        self.message, self.step = message, step


@dataclass(frozen=True)
class Run:
    cmd: str
    user: str | None  # None: the current user (root, or the last set_user)

    def __str__(self) -> str:
        return f"RUN {self.cmd}" + (f" (as {self.user})" if self.user else "")


@dataclass(frozen=True)
class Copy:
    src: str
    dest: str
    owner: str  # "" for root, else user[:group] of the image
    mode: int | None
    files_hash: str

    def __str__(self) -> str:
        return f"COPY {self.src} {self.dest}"


@dataclass(frozen=True)
class SetEnv:
    pairs: tuple[tuple[str, str], ...]

    def __str__(self) -> str:
        return "ENV " + " ".join(k for k, _ in self.pairs)


@dataclass(frozen=True)
class Workdir:
    path: str

    def __str__(self) -> str:
        return f"WORKDIR {self.path}"


@dataclass(frozen=True)
class SetUser:
    name: str

    def __str__(self) -> str:
        return f"USER {self.name}"


Action = Run | Copy | SetEnv | Workdir | SetUser


@dataclass
class Plan:
    """The steps of a template (each with E2B's name of it) and its user (its last ``set_user``, what its
    sandboxes' commands run as)."""

    steps: list[tuple[str, Action]] = field(default_factory=list)
    user: str | None = None


def _clean(value: str, what: str, step: str) -> str:
    if "\n" in value or "\r" in value or "\0" in value:
        raise store.TemplateRefused(f"step {step}: {what} {value[:60]!r} holds a line break or NUL, which an "
                                    "image's config cannot carry")
    return value


def _relative(src: str, step: str) -> str:
    if not src or src.startswith("/") or ".." in src.split("/"):
        raise store.TemplateRefused(f"step {step}: copy source {src!r} must be a path inside the file context "
                                    "(relative, without '..')")
    return src


def plan(steps: list[dict[str, Any]]) -> Plan:
    """The typed steps of ``steps`` (the SDK's ``TemplateStep`` dicts); TemplateRefused for one that cannot be
    built, naming it."""
    p = Plan()
    for i, step in enumerate(steps, 1):
        n, kind, args = str(i), step["type"], [str(a) for a in step.get("args") or []]
        action: Action
        if kind == "RUN" and args:
            action = Run(args[0], _clean(args[1], "user", n) if len(args) > 1 and args[1] else None)
        elif kind == "COPY" and len(args) >= 2:
            if not step.get("filesHash"):
                raise store.TemplateRefused(f"step {n}: a COPY step needs its filesHash (the SDK sends it)")
            mode = args[3] if len(args) > 3 and args[3] else None
            if mode is not None and not re.fullmatch(r"[0-7]{1,4}", mode):
                raise store.TemplateRefused(f"step {n}: mode {mode!r} is not an octal file mode (e.g. 0755)")
            action = Copy(_relative(args[0], n), _clean(args[1], "destination", n),
                          _clean(args[2], "user", n) if len(args) > 2 else "", int(mode, 8) if mode else None,
                          str(step["filesHash"]))
        elif kind == "ENV":
            pairs = tuple(zip(args[::2], args[1::2], strict=False))
            if not pairs or len(args) % 2:
                raise store.TemplateRefused(f"step {n}: ENV takes name/value pairs, got {args!r}")
            for k, v in pairs:
                if not _ENV_NAME.fullmatch(k):
                    raise store.TemplateRefused(f"step {n}: {k!r} is not an environment variable name")
                _clean(v, "value", n)
            action = SetEnv(pairs)
        elif kind == "WORKDIR" and args:
            action = Workdir(_clean(args[0], "workdir", n))
        elif kind == "USER" and args:
            action = SetUser(_clean(args[0], "user", n))
            p.user = action.name
        elif kind in ("RUN", "COPY", "WORKDIR", "USER"):
            raise store.TemplateRefused(f"step {n}: {kind} is missing its arguments, got {args!r}")
        else:
            raise store.TemplateRefused(f"step {n}: unknown step type {kind!r} (COPY, ENV, RUN, WORKDIR, USER are)")
        p.steps.append((n, action))
    return p


def expand(value: str, env: dict[str, str]) -> str:
    """``value`` with ``$NAME``, ``${NAME}``, ``${NAME:-default}`` and ``${NAME:+alt}`` taken from ``env`` (an unset
    name is empty), as Docker expands ENV, WORKDIR and COPY destinations."""
    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(4)
        have = env.get(name, "")
        if m.group(2) == ":-":
            return have or m.group(3)
        if m.group(2) == ":+":
            return m.group(3) if have else ""
        return have
    return _VAR.sub(one, value)


def within(folder: str, path: str) -> str:
    """``path`` (absolute, or relative to ``folder``) normalised, a trailing '/' kept."""
    joined = posixpath.normpath(posixpath.join(folder, path))
    return joined + "/" if path.endswith("/") and joined != "/" else joined


def run_failed(cmd: str, code: int, timed_out: bool, limit: float, memory: int) -> str:
    """E2B's message for a RUN step that failed, with what to do where the command wanted the network or was
    killed (``memory``: the build's limit, bytes)."""
    if timed_out:
        return f"failed to run command '{cmd}': it did not finish within {limit:g} s"
    hint = ""
    if code == 137:
        hint = (f" (killed: most often by the build's memory limit of {memory >> 20} MiB; Template.build(..., "
                "memory_mb=...) raises it)")
    elif any(word in cmd for word in _OFFLINE):
        hint = (" (template builds on this server have no network, and no package registry is reachable from "
                "this host: bring the packages in a local image, or copy them in and install from files)")
    return f"failed to run command '{cmd}': exit status {code}{hint}"


def no_such_user(name: str, cmd: str | None) -> str:
    """E2B's message for a step naming an account the image lacks (``cmd``: of a RUN step, else a set_user)."""
    if cmd is None:
        return (f"failed to set user '{name}': invalid username: '{name}' (the image has no such account: add it "
                "with run_cmd('useradd -m NAME', user='root'))")
    return f"failed to run command '{cmd}': command failed: unauthenticated: invalid username: '{name}'"
