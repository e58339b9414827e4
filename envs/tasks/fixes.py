"""SWE-bench-shaped records from real upstream fixes between consecutive releases (``agentenv tasks fixes``).

``fixes.json`` pins, per repository, two consecutive releases of its PyPI sdist (``version`` and ``next``, each
with its sha256) and, for each fix found by diffing them, the files of its code change and of its test change. The
builder makes, offline but for pip on the host:

1. the image of the older release in SWE-bench's layout (``envs.swebench_layout``: /testbed, a ``testbed``
   environment at /opt/miniconda3), ``docker tag``-ged once per instance with SWE-bench's name
   (``swebench/sweb.eval.x86_64.<id, "__" -> "_1776_">:latest``); its /testbed commit is every record's
   ``base_commit``;
2. each record's ``patch`` and ``test_patch``: the newer release's files written over /testbed and ``git diff``-ed
   (the real fix and the real test change, in git's format against the base commit);
3. the record's ``eval_script``, built by the official ``swebench`` 4.1.0 (``make_eval_script_list``, in its own
   process: ``envs.grading.runners.official``) from its specs for the repository and version (Django 5.0: ``./tests/
   runtests.py --verbosity 2 --settings=test_sqlite --parallel 1`` on test modules; SymPy 1.13: ``bin/test -C
   --verbose`` on test files; requests, which it has no 2.32 specs for: those of its 2.x, ``pytest -rA``), and its
   ``log_parser`` / ``eval_type`` (SWE-bench 5's fields). Its reinstall step (``python -m pip install -e .``) fails
   at once in these images (the testbed venv has no pip; the repository is installed by a ``.pth`` file);
4. FAIL_TO_PASS and PASS_TO_PASS as SWE-bench's validation finds them: the eval script run in a sandbox of the
   image without and with the gold patch, each log read by the official parser of the runner (``swebench`` 5.0.2's
   ``PARSER_REGISTRY[log_parser]``), so the ids are the runner's own (Django: ``test_x (module.Class.test_x)`` or a
   docstring's first line, as Django's runner prints them under Python 3.11; SymPy: test function names; pytest:
   node ids). F2P: passes with the fix, not without; P2P: passes with and without.

SymPy's sdist has no bin/: the image carries agentenv's stand-in for ``bin/test`` (``sympy_bin_test.txt``).
The images hold the whole sdist, Django's 200 test packages included: built from cached downloads, Django's takes
about 17 s on the development machine, so CI builds it whole rather than a trimmed test tree.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentenv.config import write_atomic
from envs.images import ImageRecipe, extract_sdist, fetch_sdist
from envs.swebench_layout import instance_image
from envs.task import image_name
from envs.tasks.build import BUILD_TTL

FIXES_FILE = Path(__file__).with_name("fixes.json")
RECORDS_FILE = Path(__file__).with_name("fixes_tasks.jsonl")
START, END = ">>>>> Start Test Output", ">>>>> End Test Output"

Log = Callable[[str], None]


# the official parser of each runner's log (SWE-bench 5's log_parser field); psf/requests has a name of its own
PARSERS = {"django": "parse_log_django", "sympy": "parse_log_sympy", "pytest": "parse_log_pytest_options"}
PARSERS_BY_REPO = {"psf/requests": "parse_log_requests"}


@dataclass(frozen=True)
class Fix:
    instance_id: str
    code: tuple[str, ...]           # the files of the fix (the record's patch)
    tests: tuple[str, ...]          # the files of its test change (the record's test_patch)
    problem_statement: str
    upstream: str                   # where the fix comes from (ticket, issue, CVE, release)


@dataclass(frozen=True)
class Release:
    """A repository at one release, the next release, and the fixes between them."""

    repo: str                       # owner/name, as SWE-bench names it
    dist: str                       # the distribution on PyPI
    series: str                     # SWE-bench's version (major.minor)
    runner: str                     # a key of PARSERS
    version: str
    sha256: str
    next: str
    next_sha256: str
    fixes: tuple[Fix, ...]
    requirements: tuple[str, ...] = ()
    pythonpath: str = "."
    overlay: Mapping[str, str] = field(default_factory=dict)   # path in /testbed -> file beside this module

    @property
    def recipe(self) -> ImageRecipe:
        overlay = {path: (FIXES_FILE.parent / name).read_text() for path, name in self.overlay.items()}
        return ImageRecipe(repo=self.dist, version=self.version, sha256=self.sha256, pythonpath=self.pythonpath,
                           requirements=self.requirements, image=image_name(self.repo, self.version),
                           layout="swebench", overlay=overlay,
                           tags=tuple(instance_image(f.instance_id) for f in self.fixes))

    @property
    def log_parser(self) -> str:
        return PARSERS_BY_REPO.get(self.repo, PARSERS[self.runner])


def load_releases(path: Path = FIXES_FILE) -> list[Release]:
    data = json.loads(path.read_text())
    out = []
    for r in data["releases"]:
        fixes = tuple(Fix(f["instance_id"], tuple(f["code"]), tuple(f["tests"]), f["problem_statement"],
                          f["upstream"]) for f in r["fixes"])
        if r["runner"] not in PARSERS:
            raise ValueError(f"{path}: {r['repo']}: unknown runner {r['runner']!r}; known: {', '.join(PARSERS)}")
        out.append(Release(r["repo"], r["dist"], r["series"], r["runner"], r["version"], r["sha256"], r["next"],
                           r["next_sha256"], fixes, tuple(r.get("requirements", ())), r.get("pythonpath", "."),
                           dict(r.get("overlay", {}))))
    return out


# SWE-bench 4.1.0 has no specs for requests 2.32: those of its 2.x versions (SPECS_REQUESTS)
SPECS = {"psf/requests": {"python": "3.9", "packages": "pytest", "install": "python -m pip install .",
                          "test_cmd": "pytest -rA"}}


def eval_script(release: Release, base_commit: str, test_patch: str, instance_id: str = "") -> str:
    """The record's ``eval_script``: what ``swebench`` 4.1.0's ``make_eval_script_list`` builds for it (in its own
    process, ``envs.grading.runners.official``), with the package's specs for the repository and version."""
    from envs.grading.runners import official

    inst = {"instance_id": instance_id or release.repo, "repo": release.repo, "version": release.series,
            "base_commit": base_commit, "test_patch": test_patch}
    ans = official.harness(4).call([{"op": "eval_script", "instance": inst, "specs": SPECS.get(release.repo)}])[0]
    return str(ans["script"])


def official_statuses(parser: str, log: str) -> dict[str, str]:
    """The status map the official ``swebench`` 5.0.2 parser ``parser`` reads from a test log, from the part between
    the markers as its harness does."""
    from envs.grading.runners import official

    part = log.split(START, 1)[-1].split(END, 1)[0] if START in log else log
    return dict(official.harness(5).call([{"op": "parse", "parser": parser, "log": part}])[0]["statuses"])


def _git_diff(sb: Any, writes: Mapping[str, bytes]) -> str:
    for path, data in writes.items():
        sb.write_file(f"/testbed/{path}", data)
    r = sb.exec("git add -A && git diff --cached --no-renames && git reset -q --hard", cwd="/testbed", timeout=120)
    if r.exit_code != 0:
        raise RuntimeError(f"git diff failed: {r.stderr[-500:]}")
    return r.stdout


def build_release(release: Release, log: Log = print) -> list[dict[str, Any]]:
    """The records of ``release``'s fixes (see the module doc); builds its image first."""
    import agentenv
    from envs.images import build_image

    tag = build_image(release.recipe, log=log)
    records = []
    with tempfile.TemporaryDirectory(prefix="agentenv-fixes-") as tmp:
        newer = extract_sdist(fetch_sdist(release.dist, release.next, release.next_sha256), Path(tmp) / "next")
        with agentenv.Sandbox.create(tag, cpus=1.0, memory="3g", network=False, ttl=BUILD_TTL) as sb:
            base = sb.exec("git rev-parse HEAD", cwd="/testbed").stdout.strip()
            for fix in release.fixes:
                patch = _git_diff(sb, {p: (newer / p).read_bytes() for p in fix.code})
                test_patch = _git_diff(sb, {p: (newer / p).read_bytes() for p in fix.tests})
                script = eval_script(release, base, test_patch, fix.instance_id)
                before = _run_eval(sb, script, "")
                after = _run_eval(sb, script, patch)
                parse = release.log_parser
                old, new = official_statuses(parse, before), official_statuses(parse, after)
                f2p = sorted(t for t, s in new.items() if s in ("PASSED", "XFAIL") and old.get(t) not in (
                    "PASSED", "XFAIL"))
                p2p = sorted(t for t, s in new.items() if s in ("PASSED", "XFAIL") and old.get(t) in (
                    "PASSED", "XFAIL"))
                log(f"[fixes] {fix.instance_id}: {len(f2p)} FAIL_TO_PASS, {len(p2p)} PASS_TO_PASS")
                if not f2p:
                    raise RuntimeError(f"{fix.instance_id}: no test fails without the fix and passes with it:\n"
                                       f"{after[-3000:]}")
                records.append({
                    "instance_id": fix.instance_id, "repo": release.repo, "base_commit": base, "patch": patch,
                    "test_patch": test_patch, "problem_statement": fix.problem_statement, "hints_text": "",
                    "created_at": "", "version": release.series, "environment_setup_commit": base,
                    "FAIL_TO_PASS": json.dumps(f2p), "PASS_TO_PASS": json.dumps(p2p),
                    "image": instance_image(fix.instance_id), "eval_script": script,
                    "log_parser": parse, "eval_type": "pass_and_fail", "upstream": fix.upstream,
                    "upstream_release": f"{release.dist} {release.version} -> {release.next}"})
    return records


def _run_eval(sb: Any, script: str, patch: str) -> str:
    """The eval script's log in ``sb`` with ``patch`` applied first (the repository reset before and after)."""
    sb.write_file("/tmp/eval.sh", script)
    prep = ""
    if patch:
        sb.write_file("/tmp/gold.patch", patch)
        prep = "git apply /tmp/gold.patch && "
    r = sb.exec(f"{prep}bash /tmp/eval.sh 2>&1", cwd="/testbed", timeout=1800)
    sb.exec("git reset -q --hard && git clean -fdq", cwd="/testbed", timeout=120)
    return r.stdout + r.stderr


def build(releases: list[Release] | None = None, out: Path = RECORDS_FILE, log: Log = print) -> list[dict[str, Any]]:
    """Build the records of ``releases`` (default: all) into ``out``; the records ``out`` holds for other
    repositories are kept."""
    releases = releases or load_releases()
    built = {r.repo for r in releases}
    kept = [json.loads(line) for line in out.read_text().splitlines() if line.strip()] if out.exists() else []
    records = [r for r in kept if r.get("repo") not in built]
    records += [rec for release in releases for rec in build_release(release, log)]
    write_atomic(out, "".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
    log(f"[fixes] wrote {len(records)} records to {out}")
    return records
