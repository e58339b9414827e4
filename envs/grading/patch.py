"""What counts as the agent's patch: extracted from its sandbox as data, filtered by one documented rule.

Extraction (``extract_patch``). The agent's change is every difference of ``/testbed`` from the task's
base commit, tracked and untracked files alike (files git ignores are not part of it), as a binary-safe
``git diff`` (``git add -A`` into a throw-away index, then ``git diff --cached --binary <base>``,
no renames, fixed ``a/`` ``b/`` prefixes), base64-encoded on its way out so any bytes survive, within
``MAX_PATCH_BYTES`` (10 MiB; a larger change scores 0 with that reason). The agent was root in that
sandbox, so nothing it runs there is trusted — not ``git`` (run by absolute path with hooks, fsmonitor,
external diff drivers and textconv turned off, but it may have been replaced), not the shell, not the
repository's ``.git``. What comes out is *data*: the worst a tampered sandbox can do is hand over a
wrong patch, which is then filtered and applied like any other; it never runs anything where the
tests run, and no file outside ``/testbed`` carries over.

The rule (``filter_patch``; ``drop_reason`` for a path, ``content_reason`` for what a change adds). A
change to a file is dropped — left out of what is graded, and reported — when its path (old or new) is:

- ``test``: one of the task's test files (the files of FAIL_TO_PASS and PASS_TO_PASS), a file the
  task's test patch touches, or a file of the runner's test suite (``test_patterns``: Django's ``tests/``):
  the tests are the task's, as in SWE-bench;
- ``test-config``: a file that changes how tests are collected or run rather than what they test:
  ``conftest.py`` anywhere, ``pytest.ini``, ``.pytest.ini``, ``pytest.toml``, ``.pytest.toml``,
  ``tox.ini``, ``setup.cfg`` or ``pyproject.toml`` anywhere (the whole file: their other sections do
  not matter to a test run in the image, which is never reinstalled); and a runner's own program, settings
  and test machinery (``runner_files``: Django's ``tests/runtests.py`` and ``django/test/``, SymPy's
  ``bin/test`` and ``sympy/testing/``; ``envs.grading.channels``);
- ``startup-hook``: code the interpreter runs at startup: ``sitecustomize.py``, ``usercustomize.py``,
  ``*.pth``;
- ``bytecode`` or ``native-code``: ``__pycache__/``, ``*.pyc``, ``*.pyo``; ``*.so``, ``*.pyd``,
  ``*.dll``, ``*.dylib`` (an extension module beside a ``.py`` file is imported instead of it, and
  neither can be read for what it does);
- ``package-metadata``: ``*.dist-info/``, ``*.egg-info/``, ``*.egg-link``, ``*.egg`` (entry points
  register pytest plugins);
- ``git``: ``.git`` or any ``.git*`` file (``.gitattributes`` can change how the patch applies);
- ``unsafe-path``: an absolute path, a ``..`` or empty component, a control character;
- ``shadows-module``: a new module at an import root — the repository root, ``src/``, a folder that
  holds the task's tests or one above it (pytest puts the first of them without ``__init__.py`` first
  on ``sys.path``) — named like a module of
  the test runner (``pytest``, ``_pytest``, ``pluggy``, ``py``, ``iniconfig``, ``packaging``, a
  plugin the task declares) or of the standard library (``<name>.py``, ``<name>/__init__.py``, ...);

or when what it adds is:

- ``runner-reference``: text that names the test runner or the usual means to reach it from inside
  the process (``pytest``, ``pluggy``, ``junit`` in any case; ``sys._getframe``, ``f_back``,
  ``f_locals``, ``f_globals``, ``gc.get_objects``/``get_referrers``/``get_referents``, ``settrace``,
  ``setprofile``, ``atexit``, ``sys.argv``, ``meta_path``, ``path_hooks``, ``os._exit``) — in the
  added lines of any file, since a library module that imports ``_pytest`` or registers hooks changes
  how the tests run from outside the test files;
- ``binary-source``: a binary change to a ``.py`` file (it cannot be read for the above);
- ``symlink-escape``: a symbolic link whose target is absolute or leaves the repository;
- ``submodule``: a gitlink (a nested repository);
- ``unparseable``: a section that does not parse as one file's git diff (text before the first
  ``diff --git`` line too).

The files the task's gold patch itself changes are exempt from the path rules, and the kinds of text
it adds from the content rules (``gold_exemptions``): a repository whose real fix edits ``setup.cfg``
or is the test runner itself stays gradable. The task's test files are never exempt.

Every dropped change is reported (``Dropped``: path, reason, detail) in ``info["grading"]["dropped"]``;
a drop for any reason but ``test`` sets ``info["grading"]["tampering"]``.

What the rule cannot do, and what does instead. The code under test runs in the same process as pytest, so a
fix to the library can still reach the runner at run time in ways no reading of the text finds (``exec`` of
a string built at run time, ``importlib`` or ``sys.modules`` with a computed name, ``gc`` or frames under
other names). That is not this rule's job; the grader closes it by construction
(``envs.grading.grader``): the tests run under a guard whose PEP 578 audit hook, installed before any
repository code, refuses and reports the means of reaching the runner from the patch's added lines
(frames, ``gc`` walks, ``ctypes``, tracing hooks, code compiled from strings, new processes, the grading
folder; ``envs.grading.audit``); the FAIL_TO_PASS tests are called again in a second interpreter where no
pytest report decides anything (``envs.grading.isolation``); and canaries derived from the task's own
tests must fail (``envs.grading.canary``). The rule stays as the first, cheap filter and the reason a
drop is reported. See ``envs/grading/__init__.py`` for what remains.
"""

from __future__ import annotations

import base64
import binascii
import fnmatch
import posixpath
import re
import secrets
import shlex
import sys
from collections.abc import Iterable
from dataclasses import dataclass

from agentenv.api import SandboxLike
from envs.grading.diff import FileChange, NumstatEntry, parse_section, split_sections

WORKDIR = "/testbed"
MAX_PATCH_BYTES = 10 << 20

TEST_CONFIG = frozenset({"conftest.py", "pytest.ini", ".pytest.ini", "pytest.toml", ".pytest.toml", "tox.ini",
                         "setup.cfg", "pyproject.toml"})
STARTUP_HOOKS = frozenset({"sitecustomize.py", "usercustomize.py"})
RUNNER_MODULES = frozenset({"pytest", "_pytest", "pluggy", "py", "iniconfig", "packaging", "xdist"})
MODULE_SUFFIXES = (".py", ".pyw", ".pyc", ".pyo", ".so", ".pyd")
NATIVE = re.compile(r"\.(so|pyd|dll|dylib)(\.[0-9.]+)?$")
_RUNNER_TEXT = re.compile(r"pytest|pluggy|junit", re.IGNORECASE)
_REACH_TEXT = re.compile(r"\b_getframe\b|\bf_back\b|\bf_locals\b|\bf_globals\b|\bget_referrers\b|\bget_referents\b"
                         r"|\bgc\s*\.\s*get_objects\b|\bsettrace\b|\bsetprofile\b|\batexit\b|\bsys\s*\.\s*argv\b"
                         r"|\bmeta_path\b|\bpath_hooks\b|\b_exit\b")
GIT_FILES = frozenset({".gitattributes", ".gitmodules"})

REASONS = {
    "test": "a test file of the task (the tests are the task's)",
    "test-config": "changes how the tests are collected or run (test-runner configuration)",
    "startup-hook": "code the interpreter runs at startup",
    "bytecode": "compiled bytecode",
    "native-code": "a compiled extension module",
    "package-metadata": "package metadata (entry points can register test-runner plugins)",
    "git": "git metadata",
    "unsafe-path": "a path outside the repository",
    "shadows-module": "a new module named like one of the test runner or the standard library",
    "runner-reference": "adds text that reaches into the test runner",
    "binary-source": "a binary change to Python source",
    "symlink-escape": "a symbolic link that points outside the repository",
    "submodule": "a nested repository (gitlink)",
    "unparseable": "does not parse as a git diff of one file",
}


class PatchError(RuntimeError):
    """The agent's patch could not be taken out of its sandbox (or is too large)."""


@dataclass(frozen=True)
class Dropped:
    """A file the grader left out of the patch, and why (``reason``: a key of ``REASONS``)."""

    path: str
    reason: str
    detail: str = ""

    @property
    def tampering(self) -> bool:
        return self.reason != "test"

    def to_info(self) -> dict[str, str]:
        return {"path": self.path, "reason": self.reason, "detail": self.detail or REASONS.get(self.reason, "")}


@dataclass(frozen=True)
class FilteredPatch:
    """``kept``: the sections that are graded, as one patch; ``dropped``: what was left out and why."""

    kept: bytes
    changes: tuple[FileChange, ...]      # the kept sections, in order
    dropped: tuple[Dropped, ...] = ()

    @property
    def tampering(self) -> bool:
        return any(d.tampering for d in self.dropped)

    @property
    def paths(self) -> set[str]:
        return {p for c in self.changes for p in c.paths}


# --- extraction ------------------------------------------------------------------------------------

# git options that make the diff's format fixed and keep the repository's config from running anything
SAFE_GIT = ("-c core.hooksPath=/dev/null -c core.fsmonitor=false -c core.untrackedCache=false "
            "-c core.quotePath=true -c diff.external= -c diff.noprefix=false -c diff.mnemonicPrefix=false "
            "-c diff.relative=false -c diff.renames=false -c core.attributesFile=/dev/null "
            "-c core.autocrlf=false -c core.safecrlf=false -c core.symlinks=true -c core.fileMode=true "
            "-c core.splitIndex=false -c core.sparseCheckout=false -c advice.addIgnoredFile=false "
            "-c safe.directory=*")
DIFF_OPTIONS = ("--cached --binary --full-index --no-color --no-ext-diff --no-textconv --no-renames "
                "--src-prefix=a/ --dst-prefix=b/")
_TOO_LARGE = "agentenv-patch-too-large"


def extract_script(base_commit: str, limit: int = MAX_PATCH_BYTES) -> str:
    """The POSIX sh script that prints the patch of /testbed against ``base_commit``, base64-encoded."""
    tmp = f"/tmp/.agentenv-index-{secrets.token_hex(6)}"
    return "\n".join([
        "set -e", f"cd {WORKDIR}", f"idx={tmp}", "trap 'rm -f \"$idx\" \"$idx.out\"' EXIT",
        "g=/usr/bin/git; [ -x \"$g\" ] || g=git",
        "if [ -f .git/index ]; then cp .git/index \"$idx\"; else rm -f \"$idx\"; fi",
        "export GIT_INDEX_FILE=\"$idx\" GIT_OPTIONAL_LOCKS=0 GIT_TERMINAL_PROMPT=0 GIT_PAGER=cat GIT_EXTERNAL_DIFF=",
        f"\"$g\" {SAFE_GIT} add -A",
        f"\"$g\" {SAFE_GIT} diff {DIFF_OPTIONS} {shlex.quote(base_commit)} -- > \"$idx.out\"",
        "n=$(wc -c < \"$idx.out\")",
        f"if [ \"$n\" -gt {limit} ]; then echo \"{_TOO_LARGE} $n\"; exit 0; fi",
        "base64 -w0 \"$idx.out\"",
    ])


def extract_patch(sandbox: SandboxLike, base_commit: str, *, limit: int = MAX_PATCH_BYTES,
                  timeout: float = 120.0) -> bytes:
    """The agent's change to /testbed against ``base_commit`` (see the module doc); PatchError when it
    cannot be had or is over ``limit`` bytes."""
    r = sandbox.exec(extract_script(base_commit, limit), timeout=timeout, cwd=WORKDIR)
    out = r.stdout.strip()
    if r.timed_out:
        raise PatchError(f"taking the patch out of the sandbox timed out after {timeout:g} s")
    if out.startswith(_TOO_LARGE):
        raise PatchError(f"the patch is {out.split()[-1]} bytes, over the {limit} byte limit")
    if r.exit_code != 0:
        raise PatchError(f"could not take the patch out of the sandbox (git exit code {r.exit_code}): "
                         f"{(r.stderr or r.stdout).strip()[-400:]}")
    if len(out) > (limit // 3 + 1) * 4:
        raise PatchError(f"the patch is over the {limit} byte limit")
    try:
        data = base64.b64decode(out, validate=True)
    except (binascii.Error, ValueError):
        raise PatchError("the sandbox returned something that is not a patch") from None
    if len(data) > limit:
        raise PatchError(f"the patch is {len(data)} bytes, over the {limit} byte limit")
    return data


# --- the rule --------------------------------------------------------------------------------------


def _stdlib() -> frozenset[str]:
    return frozenset(getattr(sys, "stdlib_module_names", ())) | frozenset(sys.builtin_module_names)


SHADOWED = RUNNER_MODULES | _stdlib()


def import_roots(test_files: Iterable[str]) -> set[str]:
    """Folders whose new top-level modules could shadow others: the root, ``src``, the tests' folders and
    their parents (pytest's default import mode puts the first folder without ``__init__.py`` first)."""
    roots = {"", "src"}
    for f in test_files:
        d = posixpath.dirname(f)
        while d:
            roots.add(d)
            d = posixpath.dirname(d)
    return roots


def _module_name(rel: str) -> str | None:
    """The module a path at an import root defines: ``x.py``, ``x.cpython-311.so``, ``x/__init__.py``."""
    parts = rel.split("/")
    if len(parts) == 1 and parts[0].endswith(MODULE_SUFFIXES):
        return parts[0].split(".", 1)[0]
    if len(parts) == 2 and parts[1].split(".", 1)[0] == "__init__":
        return parts[0]
    return None


def drop_reason(path: str, *, tests: Iterable[str] = (), new_file: bool = False,
                roots: Iterable[str] = ("", "src"), runner_modules: Iterable[str] = (),
                runner_files: Iterable[str] = (), test_patterns: Iterable[str] = ()) -> str | None:
    """The reason a change to ``path`` (relative to /testbed) is not graded, or None (see the module doc)."""
    if (not path or path.startswith("/") or "\0" in path or any(ord(c) < 32 or ord(c) == 127 for c in path)
            or any(p in ("", ".", "..") for p in path.split("/"))):
        return "unsafe-path"
    if any(fnmatch.fnmatchcase(path, pattern) for pattern in runner_files):
        return "test-config"
    if path in set(tests):
        return "test"
    parts = path.split("/")
    base = parts[-1]
    if ".git" in parts or base in GIT_FILES:
        return "git"
    if base in TEST_CONFIG:
        return "test-config"
    if base in STARTUP_HOOKS or base.endswith(".pth"):
        return "startup-hook"
    if "__pycache__" in parts or base.endswith((".pyc", ".pyo")):
        return "bytecode"
    if NATIVE.search(base):
        return "native-code"
    if any(p.endswith((".dist-info", ".egg-info", ".egg-link", ".egg")) for p in parts):
        return "package-metadata"
    if any(fnmatch.fnmatchcase(path, pattern) for pattern in test_patterns):
        return "test"
    if new_file:
        shadowed = SHADOWED | set(runner_modules)
        for root in roots:
            if root and not path.startswith(root + "/"):
                continue
            name = _module_name(path[len(root) + 1:] if root else path)
            if name is not None and name in shadowed:
                return "shadows-module"
    return None


def content_reason(change: FileChange) -> tuple[str, str] | None:
    """(reason, detail) when what a change adds is not graded (see the module doc), else None."""
    if change.new_mode == "160000":
        return "submodule", ""
    if change.binary and any(p.endswith((".py", ".pyw")) for p in change.paths):
        return "binary-source", ""
    if change.new_mode == "120000":
        if change.binary or len(change.added) != 1:
            return "symlink-escape", "the link's target cannot be read"
        target = change.added[0]
        if not link_stays_inside(change.path, target):
            return "symlink-escape", f"points to {target!r}"
    for line in change.added:
        m = _RUNNER_TEXT.search(line) or _REACH_TEXT.search(line)
        if m:
            return "runner-reference", f"adds {m.group(0)!r}: {line.strip()[:120]}"
    return None


def link_stays_inside(path: str, target: str) -> bool:
    """A link at ``path`` (relative to /testbed) to the relative ``target`` stays in /testbed, out of .git."""
    if not target or target.startswith("/") or "\0" in target:
        return False
    full = posixpath.normpath(posixpath.join(posixpath.dirname(path), target))
    return not (full == ".." or full.startswith("../")) and ".git" not in full.split("/")


def gold_exemptions(gold_patch: str) -> tuple[set[str], set[str]]:
    """(paths, content reasons) the task's own gold patch needs: files it changes, and the kinds of text it adds.

    A repository whose fix legitimately edits, say, ``setup.cfg`` or adds ``sys.argv`` (or that *is* the
    test runner, like pytest's own) would otherwise have its gold patch dropped; those exact paths and
    those kinds of content are exempt for that task. Test files and unsafe paths are never exempt.
    """
    paths: set[str] = set()
    reasons: set[str] = set()
    _, sections = split_sections(gold_patch.encode("utf-8", "surrogateescape"))
    for raw in sections:
        change = parse_section(raw)
        paths.update(change.paths)
        why = content_reason(change)
        if why is not None:
            reasons.add(why[0])
    return paths, reasons


def filter_patch(patch: bytes, *, tests: Iterable[str] = (), roots: Iterable[str] | None = None,
                 runner_modules: Iterable[str] = (), exempt_paths: Iterable[str] = (),
                 exempt_reasons: Iterable[str] = (), runner_files: Iterable[str] = (),
                 test_patterns: Iterable[str] = ()) -> FilteredPatch:
    """The rule of the module doc, applied to each section of ``patch``: what is kept and what is dropped.

    ``tests``: the task's test files and the files its test patch touches; ``roots``: the import roots
    (default: ``import_roots(tests)``); ``runner_modules``: the task's declared pytest plugins;
    ``exempt_paths`` / ``exempt_reasons``: what the task's gold patch needs (``gold_exemptions``);
    ``runner_files`` / ``test_patterns``: a runner's own files and test suite, as ``fnmatch`` patterns
    (``envs.grading.channels.protected``: Django's ``tests/runtests.py``, ``django/test/*``, ``tests/*``).
    """
    tests = list(tests)
    roots = list(import_roots(tests) if roots is None else roots)
    plugins, exempt, allowed = list(runner_modules), set(exempt_paths), set(exempt_reasons)
    preamble, sections = split_sections(patch)
    dropped: list[Dropped] = []
    kept: list[FileChange] = []
    if preamble.strip():
        dropped.append(Dropped("(before the first diff --git line)", "unparseable",
                               "text before the first file's header"))
    for raw in sections:
        change = parse_section(raw)
        if change.problem or not change.paths:
            dropped.append(Dropped(change.path or "(unnamed)", "unparseable", change.problem))
            continue
        why: tuple[str, str] | None = None
        for p in change.paths:
            r = drop_reason(p, tests=tests, new_file=change.new_file, roots=roots, runner_modules=plugins,
                            runner_files=runner_files, test_patterns=test_patterns)
            if r is not None and (p not in exempt or r in ("test", "unsafe-path")):
                why = (r, "" if p == change.path else f"names {p!r}")
                break
        if why is None:
            why = content_reason(change)
            if why is not None and why[0] in allowed:
                why = None
        if why is not None:
            dropped.append(Dropped(change.path, *why))
        else:
            kept.append(change)
    body = b"".join(c.text if c.text.endswith(b"\n") else c.text + b"\n" for c in kept)
    return FilteredPatch(kept=body, changes=tuple(kept), dropped=tuple(dropped))


def check_numstat(filtered: FilteredPatch, entries: list[NumstatEntry] | None) -> str:
    """"" when git will touch exactly the files of the kept sections, in order; else what differs."""
    if entries is None:
        return "git's list of the files the patch touches does not parse"
    if len(entries) != len(filtered.changes):
        return (f"git reads {len(entries)} file change(s) in the patch where the grader reads "
                f"{len(filtered.changes)}: {[e.paths for e in entries][:5]}")
    for entry, change in zip(entries, filtered.changes, strict=True):
        extra = [p for p in entry.paths if p not in change.paths]
        if extra:
            return f"git applies a change to {extra[0]!r} that the section of {change.path!r} does not name"
    return ""
