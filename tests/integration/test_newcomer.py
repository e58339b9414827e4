"""A newcomer's first hour, end to end (issue 45's "Done means"), following only what README.md and docs/ show, in
a fresh ``AGENTENV_HOME`` and ``HOME``: the README's tour; ``agentenv serve`` with a token and the quickstart's
client and Pool on it, the CLI's ``ls`` / ``exec`` against it; the E2B quickstart's chart through the official SDK;
the console's fork tree and the trajectory viewer in a browser; a task of one's own; one integration page; then the
server stopped and ``agentenv gc``, and nothing of the home left: no sandbox, container, mount, uid lease, cgroup,
reaper or server. The doc blocks run as the pages write them (tests/docblocks.py); every wait is on state."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sybil import Example

import agentenv
from agentenv.sandbox import watchdog
from rollout import scripted
from rollout.agent import LocalTokenizer
from tests import docblocks

from .conftest import cleanup, leaked
from .console.test_console import browser as browser  # noqa: PLC0414 - the console tests' Chromium
from .console.test_console import log_in, present
from .console.test_viewer import ready
from .home_checks import agentenv_cli, cgroups_left, mounts_under, processes, reapers, sandbox_cgroups
from .server_fixtures import free_port, threaded_app, wait_for
from .test_e2b_quickstart import run_the_program

pytestmark = pytest.mark.integration
ROOT = docblocks.ROOT
PATIENCE = 120.0  # seconds a wait on state may take at most on a loaded host before the test fails

from selenium.webdriver.common.by import By  # noqa: E402 - after test_console skipped where there is no browser


def block(page: str, holding: str) -> Example:
    """The one Python or shell block of ``page`` (under ROOT) whose code holds ``holding``."""
    found = [ex for ex in docblocks.examples(ROOT / page) if ex.parsed.needs_mark and holding in ex.parsed.source]
    assert len(found) == 1, f"{page}: {len(found)} blocks hold {holding!r}; the test expects one"
    return found[0]


def run(*command: str) -> str:
    """``command`` run as the reader's shell runs it (docblocks.shell_env) in the working folder; its stdout (it
    fails the test if the command fails)."""
    r = subprocess.run(command, capture_output=True, text=True, timeout=600, env=docblocks.shell_env(), check=False)
    assert r.returncode == 0, f"{' '.join(command)} exited {r.returncode}: {r.stdout[-3000:]}{r.stderr[-3000:]}"
    return r.stdout


def node(kind: str, item_id: str) -> str:
    return f'li[data-kind="{kind}"][data-id="{item_id}"]'


@pytest.fixture
def newcomer(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh agentenv home and user home, and a working folder that sees the checkout as a reader's shell does
    (docblocks.scratch); the home is removed after the test (what the test found in it is the test's verdict)."""
    home = Path(tempfile.mkdtemp(prefix="agentenv-newcomer-", dir="/var/tmp"))
    user = Path(tempfile.mkdtemp(prefix="agentenv-newcomer-user-"))
    work = docblocks.scratch(Path(tempfile.mkdtemp(prefix="agentenv-newcomer-work-")))
    monkeypatch.setenv("AGENTENV_HOME", str(home))
    monkeypatch.setenv("HOME", str(user))
    monkeypatch.chdir(work)
    try:
        yield home
    finally:
        cleanup(home)
        for folder in (user, work):
            subprocess.run(["rm", "-rf", "--one-file-system", str(folder)], check=False)


@contextlib.contextmanager
def served(work: Path, port: int) -> Iterator[tuple[str, str]]:
    """``agentenv serve --token-file env.token --port PORT --runs runs/`` (docs/quickstart.md, docs/viewer.md) as
    the reader starts it, in ``work``; yields its URL and token once /health answers, and stops it with SIGTERM
    (the quickstart's ``kill $SERVER``) after."""
    runs = work / "runs"
    if runs.is_symlink():  # the checkout's own runs/ (git ignores it), linked by docblocks.scratch: not this test's
        runs.unlink()
    runs.mkdir()
    out = work / "serve.out"
    with out.open("wb") as sink:
        proc = subprocess.Popen(["agentenv", "serve", "--token-file", "env.token", "--port", str(port), "--runs",
                                 "runs/"], cwd=work, env=docblocks.shell_env(), stdout=sink, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            assert proc.poll() is None, f"agentenv serve exited {proc.returncode}: {out.read_text()[-3000:]}"
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(f"{url}/health", timeout=2).status_code == 200
            return False

        wait_for(up, "agentenv serve answering /health", limit=PATIENCE)
        said = out.read_text()  # where the API, the console and the token are (docs/operations.md); never the token
        token = (work / "env.token").read_text().strip()
        assert f"the console at {url}/console/login" in said and f"{work / 'env.token'} (made now)" in said, said
        assert token not in said
        yield url, token
    finally:
        proc.terminate()
        proc.wait(timeout=PATIENCE)
    assert proc.returncode in (0, -15), out.read_text()[-3000:]


def test_a_newcomers_hour(newcomer: Path, browser, monkeypatch: pytest.MonkeyPatch) -> None:
    home, work = newcomer, Path.cwd()
    cgroups_before = sandbox_cgroups()
    took: dict[str, float] = {}
    clock = time.monotonic()

    def lap(step: str) -> None:
        nonlocal clock
        took[step], clock = time.monotonic() - clock, time.monotonic()

    # 1. The README's tour: a sandbox, a job, a memory snapshot, four forks, a pause, a restore; all closed.
    block("README.md", "kids = sb.fork(4)").evaluate()
    assert agentenv.Sandbox.list() == [] and agentenv.Snapshot.list() == []
    lap("README tour")

    with served(work, free_port()) as (url, token):
        assert processes(home, "serve")  # what the end checks is gone: the server, found by its home
        # 2. Remote, as docs/quickstart.md ("A server, and a Pool of servers") writes it: its client program, on
        #    this server (the page's port replaced by this one's), then the CLI's ls, snapshots ls and exec with
        #    --url and --token-file (docs/operations.md).
        server_block = block("docs/quickstart.md", "agentenv serve --token-file env.token").parsed.source
        program = server_block.split("<<'PY'\n", 1)[1].split("\nPY\n", 1)[0]
        program = program.replace("http://127.0.0.1:8790", url)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(program, "docs/quickstart.md", "exec"), {"__name__": "__main__"})  # noqa: S102
        assert printed.getvalue().split("\n")[1:] == ["", "42", "", ""], printed.getvalue()
        assert printed.getvalue().startswith("hello from ")
        with agentenv.connect(url, token) as server:
            sb = server.Sandbox.create(image="agentenv/base")
            snap = sb.snapshot(memory=True)
            kids = sb.fork(2)
            try:
                remote = ["--url", url, "--token-file", str(work / "env.token")]
                listed = agentenv_cli(home, "ls", *remote)
                assert all(s.id in listed for s in [sb, *kids]), listed
                assert snap.id in agentenv_cli(home, "snapshots", "ls", *remote)
                assert agentenv_cli(home, "exec", kids[0].id, *remote, "--", "echo", "hi from", "$(hostname)") \
                    .startswith("hi from")
                lap("remote: client, Pool, CLI --url")

                # 3. The console's fork tree (docs/console.md): the snapshot under its sandbox, the two forks
                #    under the fork's own snapshot, each node a link.
                log_in(browser, url, token)
                wait_for(lambda: browser.current_url == f"{url}/console/", "the console after logging in")
                browser.get(f"{url}/console/snapshots")
                wait_for(lambda: present(browser, f"{node('sandbox', sb.id)} > ul > {node('snapshot', snap.id)}"),
                         "the snapshot under its sandbox", limit=PATIENCE)
                jar = {c["name"]: c["value"] for c in browser.get_cookies()}
                rows: dict[str, dict[str, object]] = {}

                def read() -> bool:  # the console's readings are shared: wait for one taken after the fork
                    state = httpx.get(f"{url}/console/api/state", cookies=jar).json()
                    rows.update({r["id"]: r for r in state["sandboxes"]})
                    return all(k.id in rows for k in kids)

                wait_for(read, "the fork's children in the console's reading", limit=PATIENCE)
                (group,) = {rows[k.id]["parent_snapshot"] for k in kids}
                assert isinstance(group, str)
                wait_for(lambda: all(present(browser, f"{node('snapshot', group)} > ul > {node('sandbox', k.id)}")
                                     for k in kids), "both forks under the fork's snapshot", limit=PATIENCE)
                browser.find_element(By.CSS_SELECTOR, f"{node('sandbox', kids[1].id)} > .node a").click()
                wait_for(lambda: browser.current_url == f"{url}/console/sandbox/{kids[1].id}", "a fork's own page")
                lap("console fork tree")
            finally:
                for s in [*kids, sb]:
                    s.close()
                snap.delete()

        # 4. E2B with a chart: docs/e2b-quickstart.md's two variables and key, then its program as written.
        monkeypatch.setenv("E2B_API_URL", url)
        monkeypatch.setenv("E2B_SANDBOX_URL", url)
        monkeypatch.setenv("E2B_API_KEY", token)
        monkeypatch.delenv("E2B_DEBUG", raising=False)
        run_the_program(work)
        lap("E2B quickstart with a chart")

        # 5. The viewer (docs/viewer.md): a run of `agentenv rollout` (docs/quickstart.md's command, the scripted
        #    stand-in of the quickstart's rollout program behind the policy URL), in the console's runs.
        def script(prompt: str, turn: int) -> str:
            if turn == 0:
                return scripted.tool_call("calculator", {"expression": "6 * 7"})
            return scripted.tool_call("answer", {"answer": "42"})

        with threaded_app(scripted.create_app(script, LocalTokenizer())) as policy_url:
            run("agentenv", "rollout", "--env", "agentenv/Tool-v0", "--limit", "2", "--group-size", "2", "--workers",
                "0", "--policy-url", policy_url, "--out", "runs/tool-1")
        ready(browser, f"{url}/console/runs")
        assert present(browser, 'tr[data-run="tool-1"]')
        ready(browser, f"{url}/console/runs/tool-1")
        rows_shown = browser.find_elements(By.CSS_SELECTOR, "#episodes tbody tr")
        assert len(rows_shown) == 4, [e.text for e in rows_shown]  # 2 tasks x a group of 2
        ready(browser, f"{url}/console/runs/tool-1/episodes/{rows_shown[0].get_attribute('data-episode')}")
        assert browser.find_elements(By.CSS_SELECTOR, ".conversation .tok")
        assert "calculator(" in browser.find_element(By.ID, "conversation").text
        lap("viewer")

    # 6. A task of one's own (docs/quickstart.md, "Your own task"): written, loaded, fixed through step, graded.
    byo = block("docs/quickstart.md", 'load_tasks("my_tasks.jsonl")')
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        byo.evaluate()
    assert printed.getvalue().split() == ["1.0"], printed.getvalue()
    validated = run("agentenv", "tasks", "validate", "--tasks", "my_tasks.jsonl")  # the page's check of a task set
    assert "1/1 tasks valid" in validated, validated  # the fix resolves it; no fix, or a wrong one, does not
    lap("your own task")

    # 7. One integration page: SWE-ReX's deployment on an agentenv sandbox (docs/integrations/swerex.md).
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        block("docs/integrations/swerex.md", "AgentenvDeployment(").evaluate()
    assert "hi from /tmp" in printed.getvalue(), printed.getvalue()
    lap("integration: SWE-ReX")

    # 8. Nothing left: no sandbox (`agentenv ls`), container, record, snapshot, veth or uid lease; once the reaper
    #    has gone, `agentenv gc` unmounts the home's volume and namespaces, and nothing is mounted under the home;
    #    no sandbox cgroup of the home; no server, no reaper.
    listed = agentenv_cli(home, "ls")
    assert "┃ id ┃ state ┃" in listed and "│" not in listed, listed  # the table's head, and no row
    assert leaked(home) == {}
    wait_for(lambda: not watchdog.running(), "the home's reaper to exit", limit=PATIENCE)
    assert "unmounted" in agentenv_cli(home, "gc")
    assert mounts_under(home) == []
    wait_for(lambda: not cgroups_left(home, cgroups_before), "the home's sandbox cgroups gone", limit=PATIENCE)
    assert reapers(home) == [] and processes(home, "serve") == []
    lap("nothing left")
    print("\n".join(f"{step:32} {s:6.1f} s" for step, s in took.items()), file=sys.stderr)
