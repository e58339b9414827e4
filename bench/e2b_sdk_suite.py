"""Run E2B's own Python SDK tests, unchanged, against a local ``agentenv serve`` and report pass/fail per group.

What: takes ``packages/python-sdk/tests`` (sync and async) from a checkout or a bare git mirror of the
e2b-dev/E2B repository (``--e2b-repo`` or ``$AGENTENV_E2B_REPO``; a bare one at ``--rev``, HEAD by default)
into a temporary folder, starts ``agentenv serve`` with a private $AGENTENV_HOME, points the installed SDK at
it (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY) and runs pytest with their own pytest.ini, then turns the
junit XML into JSON: per group passed/failed/skipped/errors and, per test that did not pass, the first line
of its message. Why: E2B's suite is the yardstick of the compatibility layer; their tests never enter our tree.

    .venv/bin/python -m bench.e2b_sdk_suite --e2b-repo PATH [--groups commands,files] [-k EXPR] [--out F.json]
"""

from __future__ import annotations

import argparse
import fnmatch
import io
import json
import os
import secrets
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

from rich.table import Table

from agentenv.host import archives
from bench.harness import console, write_json_atomic
from bench.server import leaks, start_server, stop_server

SDK = "packages/python-sdk"
TAKEN = (f"{SDK}/tests", f"{SDK}/pytest.ini", f"{SDK}/pyproject.toml")  # what the run needs of their repo

# group -> patterns on a test file's path under tests/; a file belongs to the first group that matches
GROUPS: dict[str, tuple[str, ...]] = {
    "api": ("sync/api_sync/*", "async/api_async/*"),
    "commands": ("*/commands/*",),
    "files": ("*/files/*",),
    "pty": ("*/pty/*",),
    "templates": ("sync/template_sync/*", "async/template_async/*"),
    "volumes": ("sync/volume_sync/*", "async/volume_async/*"),
    "secrets": ("sync/secret_sync/*", "async/secret_async/*"),
    "connect": ("*/test_connect.py",),
    "create": ("*/test_create.py",),
    "kill": ("*/test_kill.py",),
    "timeout": ("*/test_timeout.py",),
    "fork": ("*/test_fork.py",),
    "snapshots": ("*/test_snapshot*.py",),
    "metrics": ("*/test_metrics.py",),
    "network": ("*/test_network.py", "*/test_internet_access.py", "*/test_host.py"),
    "sandbox": ("sync/sandbox_sync/*", "async/sandbox_async/*"),
    "git": ("shared/git/*",),  # sandbox.git.* in real sandboxes
    "offline": ("test_*.py", "shared/*"),  # SDK-internal unit tests: no server involved
}
REAP_INTERVAL = 0.5  # their timeout tests expect a sandbox past its end to be paused within a second or so
DEFAULT_HOME = Path("/var/tmp/agentenv-e2b-suite-home")
DEFAULT_EXCLUDED = ("offline",)  # the brief's yardstick is the sync and async tests, which talk to a server


class SuiteError(Exception):
    """A usage or setup problem, said in one line (no traceback)."""


def group_of(rel: str) -> str | None:
    """The group of a test file, by its path under tests/ (posix), or None when no group takes it."""
    for name, patterns in GROUPS.items():
        if any(fnmatch.fnmatchcase(rel, p) for p in patterns):
            return name
    return None


def test_files(tests: Path) -> dict[str, str]:
    """Every test file under ``tests`` (path relative to it) -> its group."""
    out = {}
    for f in sorted(tests.rglob("test_*.py")):
        rel = f.relative_to(tests).as_posix()
        g = group_of(rel)
        if g is not None:
            out[rel] = g
    return out


def parse_groups(spec: str | None) -> list[str]:
    """``--groups`` (comma-separated, or None for all but the offline ones) as a list; unknown names refused."""
    if spec is None:
        return [g for g in GROUPS if g not in DEFAULT_EXCLUDED]
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in GROUPS]
    if unknown or not names:
        raise SuiteError(f"unknown group(s) {unknown or spec!r}; the groups are: {', '.join(GROUPS)}")
    return names


@dataclass
class Case:
    """One test case from the junit XML."""

    group: str
    test: str
    outcome: str  # passed | failed | errors | skipped
    message: str = ""


def first_line(text: str | None, limit: int = 300) -> str:
    for line in (text or "").splitlines():
        if line.strip():
            return line.strip()[:limit]
    return ""


def _module_of(files: dict[str, str]) -> dict[str, str]:
    """Dotted module path (as junit's classname starts, with or without the ``tests.`` of the rootdir) -> file."""
    out = {}
    for rel in files:
        dotted = rel.removesuffix(".py").replace("/", ".")
        out[dotted] = out[f"tests.{dotted}"] = rel
    return out


def read_junit(xml: str | bytes, files: dict[str, str]) -> list[Case]:
    """The cases of a pytest junit XML, each put in the group of its file (``classname`` starts with the file's
    dotted path); a case whose file is unknown goes to the group ``?``."""
    modules = _module_of(files)
    root = ET.fromstring(xml)
    cases = []
    for tc in root.iter("testcase"):
        cls, name = tc.get("classname", ""), tc.get("name", "")
        if not cls:  # a module that failed to be collected: its dotted path is the name
            cls, name = name, "<collection>"
        mod = max((m for m in modules if cls == m or cls.startswith(m + ".")), key=len, default=None)
        rel = modules[mod] if mod is not None else cls
        group = files.get(rel, "?")
        test = f"{rel}::{name}"
        kinds = {child.tag: child for child in tc}
        for tag, outcome in (("failure", "failed"), ("error", "errors"), ("skipped", "skipped")):
            if tag in kinds:
                el = kinds[tag]
                cases.append(Case(group, test, outcome, first_line(el.get("message")) or first_line(el.text)))
                break
        else:
            cases.append(Case(group, test, "passed"))
    return cases


def summarize(cases: Iterable[Case], groups: Sequence[str]) -> dict[str, Any]:
    """Per group (those asked, in order, plus any ``?``) the counts and the cases that failed or errored."""
    out: dict[str, Any] = {g: {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "problems": []} for g in groups}
    for c in cases:
        g = out.setdefault(c.group, {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "problems": []})
        g[c.outcome] += 1
        if c.outcome in ("failed", "errors"):
            g["problems"].append({"test": c.test, "outcome": c.outcome, "message": c.message})
    return out


def totals(groups: dict[str, Any]) -> dict[str, int]:
    keys = ("passed", "failed", "skipped", "errors")
    t = {k: sum(g[k] for g in groups.values()) for k in keys}
    t["total"] = sum(t.values())
    return t


def _git(git_dir: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", f"--git-dir={git_dir}", *args], capture_output=True, check=False)


def is_git_dir(path: Path) -> bool:
    """A git directory itself (a bare repository, or a checkout's .git); a mirror may lack the config that
    ``rev-parse --is-bare-repository`` reads, so its layout is what counts."""
    return (path / "HEAD").is_file() and (path / "objects").is_dir()


def extract(repo: Path, rev: str | None, into: Path) -> tuple[Path, str]:
    """Lay E2B's python-sdk tests (plus its pytest.ini and pyproject) under ``into``; return the python-sdk folder
    there and the commit it came from (``worktree`` for a checkout taken as it is)."""
    if not repo.exists():
        raise SuiteError(f"--e2b-repo {repo}: no such folder")
    if rev is None and (repo / SDK / "tests").is_dir():  # a checkout, as it is on disk
        for part in TAKEN:
            src = repo / part
            if src.is_dir():
                shutil.copytree(src, into / part, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
            elif src.exists():
                (into / part).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, into / part)
        return into / SDK, "worktree"
    git_dir = repo if is_git_dir(repo) else repo / ".git"
    if not is_git_dir(git_dir):
        raise SuiteError(f"--e2b-repo {repo}: neither a checkout with {SDK}/tests nor a git repository")
    rv = rev or "HEAD"
    r = _git(git_dir, "rev-parse", "--verify", f"{rv}^{{commit}}")
    if r.returncode != 0:
        raise SuiteError(f"--rev {rv}: not a commit of {repo}")
    commit = r.stdout.decode().strip()
    present = [p for p in TAKEN if _git(git_dir, "cat-file", "-e", f"{commit}:{p}").returncode == 0]
    if f"{SDK}/tests" not in present:
        raise SuiteError(f"--e2b-repo {repo}: {commit[:12]} has no {SDK}/tests")
    r = _git(git_dir, "archive", "--format=tar", commit, *present)
    if r.returncode != 0:
        raise SuiteError(f"git archive failed: {r.stderr.decode(errors='replace').strip()}")
    with tarfile.open(fileobj=io.BytesIO(r.stdout)) as tar:
        archives.extract(tar, into)
    return into / SDK, commit


def sdk_version(sdk_dir: Path) -> str | None:
    """The SDK version their tests were written for (their pyproject's ``version``)."""
    import tomllib

    p = sdk_dir / "pyproject.toml"
    if not p.exists():
        return None
    return str(tomllib.loads(p.read_text()).get("project", {}).get("version"))


def pytest_env(url: str | None, token: str | None) -> dict[str, str]:
    """The environment of the pytest child: the SDK pointed at our server as docs/e2b.md says (with ``url``;
    without, for the offline tests, no ``E2B_*`` at all, as their own defaults assume); nothing of our own tree
    on PYTHONPATH (their ``tests`` package must not meet ours)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_") and k != "PYTHONPATH"}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    if url is not None and token is not None:
        env.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY=token)
    return env


def run_pytest(sdk_dir: Path, files: Sequence[str], junit: Path, env: dict[str, str], k: str | None,
               log: Path) -> int:
    cmd = [sys.executable, "-m", "pytest", "-c", str(sdk_dir / "pytest.ini"), "--rootdir", str(sdk_dir),
           "-p", "no:cacheprovider", "-q", "-rN", "--continue-on-collection-errors", f"--junitxml={junit}", *(["-k", k] if k else []),
           *(f"tests/{f}" for f in files)]
    with log.open("ab") as out:
        return subprocess.run(cmd, cwd=sdk_dir, env=env, stdout=out, stderr=subprocess.STDOUT, check=False).returncode


def print_summary(doc: dict[str, Any]) -> None:
    t = Table(title=f"E2B SDK {doc['tests_version']} tests against agentenv serve (SDK {doc['sdk_installed']})")
    for col in ("group", "passed", "failed", "errors", "skipped"):
        t.add_column(col, justify="left" if col == "group" else "right")
    for name, g in doc["groups"].items():
        t.add_row(name, str(g["passed"]), str(g["failed"]), str(g["errors"]), str(g["skipped"]))
    s = doc["summary"]
    t.add_row("all", str(s["passed"]), str(s["failed"]), str(s["errors"]), str(s["skipped"]), style="bold")
    console.print(t)


def list_groups() -> None:
    t = Table(title="groups (a test file belongs to the first whose pattern matches its path under tests/)")
    t.add_column("group")
    t.add_column("patterns")
    for name, pats in GROUPS.items():
        t.add_row(name + (" (only when named)" if name in DEFAULT_EXCLUDED else ""), "  ".join(pats))
    console.print(t)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--e2b-repo", type=Path, default=os.environ.get("AGENTENV_E2B_REPO") or None,
                    help="checkout or bare git dir of e2b-dev/E2B (default $AGENTENV_E2B_REPO)")
    ap.add_argument("--rev", help="commit of a git repository to take the tests from (default HEAD)")
    ap.add_argument("--groups", help="comma-separated groups (default all but 'offline'); see --list-groups")
    ap.add_argument("--list-groups", action="store_true", help="print the groups and their test files' patterns")
    ap.add_argument("-k", dest="k", help="pytest -k expression, passed through")
    ap.add_argument("--out", type=Path, help="write the JSON report here")
    ap.add_argument("--max-sandboxes", type=int, default=64)
    ap.add_argument("--home", type=Path, default=DEFAULT_HOME,
                    help="the server's $AGENTENV_HOME, kept between runs (its volume stays mounted, as any home's)")
    return ap.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Extract, serve, test, convert: the JSON report."""
    if args.e2b_repo is None:
        raise SuiteError("no E2B repository: pass --e2b-repo PATH (a checkout or bare git dir of e2b-dev/E2B) "
                         "or set AGENTENV_E2B_REPO")
    groups = parse_groups(args.groups)
    work = Path(tempfile.mkdtemp(prefix="agentenv-e2b-suite-", dir="/var/tmp"))
    left: dict[str, int] = {}
    try:
        sdk_dir, commit = extract(Path(args.e2b_repo), args.rev, work / "e2b")
        if not (sdk_dir / "pytest.ini").exists():
            raise SuiteError(f"{SDK}/pytest.ini is missing: their conftest needs its asyncio settings")
        files = {rel: g for rel, g in test_files(sdk_dir / "tests").items() if g in groups}
        home = Path(args.home)
        home.mkdir(parents=True, exist_ok=True)
        token = secrets.token_urlsafe(24)
        log = work / "pytest.log"
        started = time.monotonic()
        proc = None
        cases: list[Case] = []
        rc = 0
        try:
            proc, url = start_server(home, token, max_sandboxes=args.max_sandboxes, log=work / "server.log",
                                     reap_interval=REAP_INTERVAL)
            for offline in (False, True):  # the offline tests in a run of their own, without our E2B_* settings
                batch = sorted(f for f, g in files.items() if (g in DEFAULT_EXCLUDED) == offline)
                if not batch:
                    continue
                junit = work / f"junit{'-offline' if offline else ''}.xml"
                env = pytest_env(None, None) if offline else pytest_env(url, token)
                rc = max(rc, run_pytest(sdk_dir, batch, junit, env, args.k, log))
                if not junit.exists():
                    raise SuiteError(f"pytest wrote no junit XML (exit {rc}); its output: {log.read_text()[-1500:]}")
                cases += read_junit(junit.read_bytes(), files)
        finally:
            stop_server(proc)
        per_group = summarize(cases, groups)
        left = leaks(home, home_mounts=False)
        kept = template_snapshots(home)
        left["snapshot_files"] -= kept
        doc = {"e2b_commit": commit, "tests_version": sdk_version(sdk_dir), "sdk_installed": version("e2b"),
               "groups_run": groups, "k": args.k, "pytest_exit": rc, "seconds": round(time.monotonic() - started, 1),
               "leaks": left, "template_snapshots": kept, "summary": totals(per_group), "groups": per_group}
        return doc
    finally:
        # the logs are kept when something leaked or when asked
        if not any(left.values()) and os.environ.get("AGENTENV_E2B_SUITE_KEEP") is None:
            shutil.rmtree(work, ignore_errors=True)
        else:
            console.log(f"kept {work}")


def template_snapshots(home: Path) -> int:
    """Snapshots of the templates the tests built that are still recorded: kept by design, not leaks (E2B's tests
    build templates and never delete them; a template with a start command owns its snapshot)."""
    count = 0
    for meta in (home / "snapshots").glob("*/meta.json"):
        labels = json.loads(meta.read_text()).get("labels") or {}
        template = labels.get("e2b.template")
        if labels.get("agentenv.kind") == "e2b-template" and template and \
                (home / "e2b-templates" / "templates" / f"{template}.json").exists():
            count += 1
    return count


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list_groups:
        list_groups()
        return 0
    try:
        doc = run(args)
    except SuiteError as e:
        console.print(f"[red]error:[/red] {e}")
        return 2
    print_summary(doc)
    if args.out is not None:
        write_json_atomic(args.out, doc)
        console.print(f"wrote {args.out}")
    s = doc["summary"]
    return 0 if s["failed"] == 0 and s["errors"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
