"""The task-set builder: real libraries, injected bugs, kept only when the library's own tests catch them.

Pipeline (``agentenv tasks ...``):

1. ``images``   build one image per pinned library (``libraries.json``; see ``envs.images``).
2. ``search``   for each library, try mutation sites (``envs.tasks.mutate``) in a seeded order, run the
                library's own tests in a sandbox with each, and pin the ones where at least one test
                that passes on the pristine code fails (and at most ``MAX_FAILING`` do, so a bug is
                specific) into ``mutations.json``.
3. ``build``    from the pinned specs only: apply each, take the gold patch (``git diff`` back to the
                pristine code), run the tests with the bug, and write task records with the real
                FAIL_TO_PASS / PASS_TO_PASS ids (PASS_TO_PASS: the other passing tests of the same test
                files) and a problem statement made from the failing tests, to ``swe_tasks.jsonl``.
4. ``validate`` every (or a sample of) task, from this set or any task file (``envs.tasks.validate``):
                the unchanged repository, a wrong patch (a no-op edit of every file the gold patch
                touches) and a patch that deletes the failing tests grade as not resolved; the gold
                patch grades as resolved. A task that cannot be set up (a missing image, a base commit
                the image lacks) is a FAIL with its reason; the others still run.

``search`` and ``build`` need a library's ``tests``, ``mutate`` and ``license``; ``images`` and
``validate`` need only what an image needs (see ``envs.tasks.libraries``), so they work for any
libraries file and task file (``--libraries``, ``--tasks``).

At reset a task's setup commands turn the pristine image into its base commit: reverse-apply the
gold patch, then start a fresh one-commit history (fixed author and dates, so the commit hash is
the same everywhere), so the pristine code is not in the repository's history for an agent to find.
"""

from __future__ import annotations

import json
import random
import shlex
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import agentenv
from agentenv.api import SandboxLike
from agentenv.errors import AgentEnvError
from envs.grading import PASSING, parse_pytest
from envs.images import build_hint
from envs.task import SHIPPED, Task, load_tasks, write_tasks
from envs.tasks.libraries import TEST_COMMAND, Library, load_libraries
from envs.tasks.mutate import KINDS, MutationError, MutationSpec, apply, candidates

MUTATIONS_FILE = Path(__file__).with_name("mutations.json")
MAX_FAILING = 25
PATCH_EOF = "AGENTENV_PATCH_EOF"
REINIT = "rm -rf .git && git init -q && git add -A && git commit -q -m base"
BUILD_TTL = 6 * 3600.0  # a building sandbox's deadline: its with-block closes it; this only if the builder is killed

Log = Callable[[str], None]


def setup_commands(gold_patch: str) -> list[str]:
    """Shell commands (run in /testbed of the pristine image) that make the task's base commit."""
    body = gold_patch if gold_patch.endswith("\n") else gold_patch + "\n"
    return [f"git apply -R --whitespace=nowarn <<'{PATCH_EOF}'\n{body}{PATCH_EOF}", REINIT]


def _run_tests(sb: SandboxLike, lib: Library, timeout: float) -> tuple[dict[str, str], str, bool]:
    r = sb.exec(TEST_COMMAND.format(tests=" ".join(shlex.quote(t) for t in lib.tests)), timeout=timeout,
                cwd="/testbed")
    log = r.stdout + r.stderr
    return parse_pytest(log), log, r.timed_out


@dataclass
class _Baseline:
    statuses: dict[str, str]
    seconds: float
    commit: str

    @property
    def passing(self) -> set[str]:
        return {t for t, s in self.statuses.items() if s == "PASSED"}


def _baseline(sb: SandboxLike, lib: Library) -> _Baseline:
    t0 = time.monotonic()
    statuses, log, timed_out = _run_tests(sb, lib, 600)
    if timed_out or not any(s == "PASSED" for s in statuses.values()):
        raise RuntimeError(f"{lib.name}: the pristine test suite does not run:\n{log[-2000:]}")
    commit = sb.exec("git rev-parse HEAD", cwd="/testbed").stdout.strip()
    return _Baseline(statuses, time.monotonic() - t0, commit)


def _interleave(specs: list[MutationSpec], rng: random.Random) -> list[MutationSpec]:
    """Candidates in a seeded order that alternates between kinds (so a set mixes them)."""
    by_kind: dict[str, list[MutationSpec]] = {k: [] for k in KINDS}
    for s in specs:
        by_kind[s.kind].append(s)
    for v in by_kind.values():
        rng.shuffle(v)
    out: list[MutationSpec] = []
    while any(by_kind.values()):
        for k in KINDS:
            if by_kind[k]:
                out.append(by_kind[k].pop())
    return out


def _failing(base: _Baseline, statuses: dict[str, str]) -> list[str]:
    return sorted(t for t in base.passing if statuses.get(t, "MISSING") not in PASSING)


def search(lib: Library, *, keep: int, max_tries: int, seed: int, log: Log) -> list[MutationSpec]:
    """Pinned-to-be mutation specs of ``lib`` that its own tests catch (see the module doc)."""
    from envs.images import extract_sdist, fetch_sdist

    lib.need("tests", "mutate", for_what="search")

    src_dir = extract_sdist(fetch_sdist(lib.name, lib.version, lib.sha256),
                            Path(f"/var/tmp/agentenv-src-{lib.name}-{lib.version}"))
    sources = {f: (src_dir / f).read_text() for f in lib.mutate}
    rng = random.Random(f"{lib.name}-{lib.version}-{seed}")
    order = _interleave([c for f, s in sources.items() for c in candidates(s, f)], rng)
    kept: list[MutationSpec] = []
    used_functions: set[tuple[str, str]] = set()
    per_kind_cap = max(2, (keep + 2) // 3)
    with agentenv.Sandbox.create(lib.image, cpus=1.0, memory="2g", ttl=BUILD_TTL) as sb:
        base = _baseline(sb, lib)
        timeout = max(30.0, 10 * base.seconds)
        tries = 0
        for spec in order:
            if len(kept) >= keep or tries >= max_tries:
                break
            if (spec.file, spec.function) in used_functions or sum(k.kind == spec.kind for k in kept) >= per_kind_cap:
                continue
            try:
                mutated, edit = apply(sources[spec.file], spec)
            except MutationError:
                continue
            tries += 1
            sb.write_file(f"/testbed/{spec.file}", mutated)
            try:
                statuses, _log, timed_out = _run_tests(sb, lib, timeout)
            finally:
                sb.exec(f"git checkout -q -- {shlex.quote(spec.file)}", cwd="/testbed")
            failing = _failing(base, statuses)
            ok = not timed_out and 1 <= len(failing) <= MAX_FAILING
            log(f"[search] {lib.name} {spec.function} {spec.kind}#{spec.index}: "
                f"{'timed out' if timed_out else f'{len(failing)} failing'}{' -> kept' if ok else ''}")
            if ok:
                kept.append(spec)
                used_functions.add((spec.file, spec.function))
    return kept


def write_mutations(found: dict[str, list[MutationSpec]], seed: int, path: Path = MUTATIONS_FILE) -> None:
    data: dict[str, Any] = {"_comment": "Pinned bug injections (see envs/tasks/mutate.py for the kinds); "
                                        "written by `agentenv tasks search`, read by `build`.",
                            "seed": seed, "max_failing": MAX_FAILING,
                            "mutations": {k: [s.to_json() for s in v] for k, v in found.items()}}
    path.write_text(json.dumps(data, indent=1) + "\n")


def read_mutations(path: Path = MUTATIONS_FILE) -> dict[str, list[MutationSpec]]:
    data = json.loads(path.read_text())
    return {k: [MutationSpec.from_json(s) for s in v] for k, v in data["mutations"].items()}


def instance_id(lib: Library, spec: MutationSpec) -> str:
    return f"{lib.name}-{lib.version}__{spec.function}__{spec.kind}_{spec.index}"


_SUMMARY_FAIL = ("FAILED ", "ERROR ")


def failure_messages(log: str) -> dict[str, str]:
    """Test id -> the one-line message of each FAILED/ERROR line in pytest's ``-rA`` summary."""
    out: dict[str, str] = {}
    for line in log.splitlines():
        if not line.startswith(_SUMMARY_FAIL):
            continue
        rest = line.split(" ", 1)[1].rstrip()
        start = rest.rfind("]") if "[" in rest.split(" - ", 1)[0] else 0  # an id may hold ' - ' in brackets
        cut = rest.find(" - ", max(start, 0))
        tid, msg = (rest, "") if cut < 0 else (rest[:cut], rest[cut + 3:])
        out.setdefault(tid, msg)
    return out


def problem_statement(lib: Library, failing: list[str], messages: dict[str, str]) -> str:
    files = sorted({t.split("::", 1)[0] for t in failing})
    lines = [f"{lib.name} {lib.version}: {len(failing)} of the library's own tests fail "
             f"({', '.join(files)}).", "", "For example:", ""]
    for t in failing[:3]:
        msg = messages.get(t, "").strip() or "the test fails"
        lines += [f"    {t}", f"        {msg[:300]}", ""]
    lines.append("The tests are right; the library's code is not. Find the bug in the library's source and fix "
                 "it so these tests pass again, without breaking the other tests.")
    return "\n".join(lines)


def build_library(lib: Library, specs: Iterable[MutationSpec], log: Log) -> list[Task]:
    """Task records for ``lib`` from pinned specs (each checked again: it must still fail some test)."""
    from envs.images import extract_sdist, fetch_sdist

    lib.need("tests", "license", for_what="build")
    src_dir = extract_sdist(fetch_sdist(lib.name, lib.version, lib.sha256),
                            Path(f"/var/tmp/agentenv-src-{lib.name}-{lib.version}"))
    tasks = []
    with agentenv.Sandbox.create(lib.image, cpus=1.0, memory="2g", ttl=BUILD_TTL) as sb:
        base = _baseline(sb, lib)
        timeout = max(30.0, 10 * base.seconds)
        for spec in specs:
            mutated, _edit = apply((src_dir / spec.file).read_text(), spec)
            sb.write_file(f"/testbed/{spec.file}", mutated)
            gold = sb.exec("git diff -R", cwd="/testbed").stdout
            statuses, test_log, timed_out = _run_tests(sb, lib, timeout)
            sb.exec(f"git checkout -q -- {shlex.quote(spec.file)}", cwd="/testbed")
            failing = _failing(base, statuses)
            if timed_out or not 1 <= len(failing) <= MAX_FAILING:
                log(f"[build] {lib.name} {spec}: dropped ({len(failing)} failing, timed out={timed_out})")
                continue
            cmds = setup_commands(gold)
            # one command a line: a heredoc's terminator must stand alone on its line
            script = "\n".join(["set -e", "rm -rf /tmp/tb", "cp -a /testbed /tmp/tb", "cd /tmp/tb", *cmds,
                                 "git rev-parse HEAD"])
            r = sb.exec(script, cwd="/tmp")
            sb.exec("rm -rf /tmp/tb")
            if r.exit_code != 0:
                raise RuntimeError(f"{lib.name} {spec}: setup commands fail: {r.stdout + r.stderr}")
            files = {t.split("::", 1)[0] for t in failing}
            p2p = sorted(t for t in base.passing - set(failing)
                         if t.split("::", 1)[0] in files and statuses.get(t) == "PASSED")
            tid = instance_id(lib, spec)
            tasks.append(Task.from_json({
                "instance_id": tid, "repo": f"pypi/{lib.name}", "version": lib.version,
                "base_commit": r.stdout.strip().splitlines()[-1], "environment_setup_commit": base.commit,
                "patch": gold, "test_patch": "", "hints_text": "",
                "problem_statement": problem_statement(lib, failing, failure_messages(test_log)),
                "FAIL_TO_PASS": failing, "PASS_TO_PASS": p2p, "image": lib.image,
                "setup_commands": cmds, "test_command": TEST_COMMAND, "log_parser": "pytest",
                "metadata": {"library": lib.name, "license": lib.license, "mutation": spec.to_json()},
            }))
            log(f"[build] {tid}: {len(failing)} FAIL_TO_PASS, {len(p2p)} PASS_TO_PASS")
    return tasks


def build(libraries: list[Library] | None = None, out: Path = SHIPPED, log: Log = print,
          mutations: Path = MUTATIONS_FILE) -> list[Task]:
    pinned = read_mutations(mutations)
    tasks: list[Task] = []
    for lib in libraries or load_libraries():
        tasks += build_library(lib, pinned.get(lib.name, []), log)
    write_tasks(tasks, out)
    log(f"[build] wrote {len(tasks)} tasks to {out}")
    return tasks


def prepare_images(tasks: Iterable[Task], libraries: Iterable[Library], *, build: bool = True,
                   libraries_file: str = "LIBRARIES.json", log: Log = print) -> dict[str, str]:
    """Build (or find up to date) the images ``tasks`` need; image -> why it is not usable, for those that are not.

    An image a library of ``libraries`` makes is built (unless ``build`` is false); any other image must be on
    this host, or, named by a published dataset's rule, come from one of its sources (a tarball, a mirror, a
    registry: ``agentenv.ensure_image``).
    """
    from agentenv.errors import ImageUnavailable
    from envs.images import build_image, image_exists

    by_image = {lib.image: lib for lib in libraries}
    agentenv_rule = {t.image for t in tasks if t.dataset == "agentenv"}
    problems: dict[str, str] = {}
    for image in dict.fromkeys(t.image for t in tasks):
        lib = by_image.get(image)
        try:
            if lib is not None and build:
                build_image(lib.recipe, log=log)
            elif lib is not None and not image_exists(image):
                problems[image] = (f"image {image} is missing: build it with `agentenv tasks images "
                                   f"--libraries {libraries_file}`")
            elif lib is None and not image_exists(image):
                if image in agentenv_rule:  # agentenv's own images are built here, never published
                    raise ImageUnavailable(f"image {image} is missing: no library in {libraries_file} makes it; "
                                           + build_hint(image, libraries_file))
                got = agentenv.ensure_image(image)
                log(f"[image] {image}: from {got.source} {got.detail}".rstrip())
        except ImageUnavailable as e:
            problems[image] = str(e)
        except AgentEnvError as e:
            problems[image] = f"image {image} could not be built: {e}"
    return problems


def sample(tasks: list[Task], n: int, seed: int = 0) -> list[Task]:
    """``n`` tasks, spread over libraries (round robin over a seeded shuffle)."""
    rng = random.Random(seed)
    by_lib: dict[str, list[Task]] = {}
    for t in tasks:
        by_lib.setdefault(t.repo, []).append(t)
    for v in by_lib.values():
        rng.shuffle(v)
    out: list[Task] = []
    while len(out) < n and any(by_lib.values()):
        for v in by_lib.values():
            if v and len(out) < n:
                out.append(v.pop())
    return out


def load(path: Path = SHIPPED) -> list[Task]:
    return load_tasks(path)
