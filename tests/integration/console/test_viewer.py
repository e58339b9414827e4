"""The trajectory viewer in a real browser (headless Chromium, as the console's tests) over a real run: a rollout of
Tool-v0 tasks played by a scripted policy served over HTTP (``agentenv rollout --workers 0``), a real beam search
over real sandbox forks saved beside its shards, and metrics written by the trainer's MetricsLog from that run's
rewards. ``agentenv view`` (its module) serves them; the pages are checked against the shards themselves. Each
page's screenshot goes to docs/console/ with AGENTENV_SCREENSHOTS=1."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from rollout import scripted, search
from rollout import trajectory as tj
from rollout.agent import AgentConfig, LocalTokenizer
from trainer.algorithm.advantages import group_advantages
from trainer.loop.evaluation import per_task_passes, summarize
from trainer.metrics import MetricsLog

from ..server_fixtures import free_port, threaded_app, wait_for
from .test_console import browser as browser  # noqa: PLC0414 - the console tests' Chromium, one per module
from .test_console import displayed, present, shot, text

pytestmark = pytest.mark.integration
TOK = LocalTokenizer()
HOSTILE = '<img src=x onerror="document.title=1">'  # the agent's text: shown as text, never run
CALC = scripted.tool_call("calculator", {"expression": "37 * 1234 - 5678"})
PY = scripted.tool_call("python", {"code": "print(37 * 1234 - 5678)"})
RIGHT, WRONG = (scripted.tool_call("answer", {"answer": a}) for a in ("39980", "1"))
NOISE = 2e-17  # a metric's rounding noise around 0

from selenium.webdriver.common.by import By  # noqa: E402 - after test_console skipped where there is no browser


def _answers() -> scripted.Script:
    """Turn 0: a thought (hostile markup) and the calculator; then task #0 is always answered right, #1 twice in
    three, #2 never (mixed rewards, tasks of different pass rates)."""
    calls = itertools.count()

    def script(prompt: str, turn: int) -> str:
        if turn == 0:
            return "Let me compute " + HOSTILE + CALC
        if "(#0)" in prompt:
            return RIGHT
        return RIGHT if "(#1)" in prompt and next(calls) % 3 < 2 else WRONG
    return script


def _rollout(run: Path, policy_url: str) -> None:
    from rollout.cli import app

    tasks = run.parent / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"c{i}", "question": f"What is 37 * 1234 - 5678? (#{i})",
                                         "answer": "39980", "match": "numeric"}) + "\n" for i in range(3)))
    r = CliRunner().invoke(app, ["--env", "agentenv/Tool-v0", "--tasks", str(tasks), "--policy-url", policy_url,
                                 "--group-size", "3", "--workers", "0", "--out", str(run), "--max-turns", "3"])
    assert r.exit_code == 0, r.output


def _search(run: Path) -> search.SearchResult:
    """A beam search on real sandboxes (the python tool starts one), each kept node snapshotted; saved."""
    import httpx as _httpx

    from envs import ToolEnv
    from policy.client import PolicyClient

    def script(prompt: str, turn: int) -> list[str]:
        return [PY, WRONG] if turn == 0 else [RIGHT, WRONG]

    async def go() -> search.SearchResult:
        env = ToolEnv(task="calc-001")
        app = scripted.create_app(script, TOK)
        async with PolicyClient("http://scripted", transport=_httpx.ASGITransport(app=app), max_retries=0) as p:
            try:
                return await search.beam(env, p, TOK, width=2, depth=2, beam_size=1, keep_snapshots=True,
                                         config=AgentConfig(max_turns=3), task_id="calc-001", env_id="agentenv/Tool-v0")
            finally:
                env.close()

    result = asyncio.run(go())
    result.save(run, "beam-calc")
    return result


def _metrics(run: Path, trajs: list[tj.Trajectory]) -> None:
    """Per group (a step): its reward mean, and the pass rate over the episodes so far with its interval."""
    log = MetricsLog(run / "metrics.jsonl")
    groups: dict[str, list[tj.Trajectory]] = {}
    for t in trajs:
        groups.setdefault(t.group_id, []).append(t)
    seen: list[tj.Trajectory] = []
    for step, members in enumerate(groups.values()):
        seen += members
        rewards = [t.reward for t in members if t.reward is not None]
        s = summarize(per_task_passes(seen, 1.0), k=1)
        lo, hi = s["mean_at_k_ci"]
        log.write(step, {"reward/train": sum(rewards) / len(rewards), "pass_rate/heldout": s["mean_at_k"],
                         "pass_rate/heldout_lo": lo, "pass_rate/heldout_hi": hi,
                         "advantage/mean": NOISE * (-1) ** step})  # a mean that is 0 but for rounding


@pytest.fixture(scope="module")
def site() -> Iterator[dict[str, Any]]:
    """The run (rollout, search, metrics) under a runs folder, and ``python -m trainer.viewer.cli`` (what
    ``agentenv view`` runs) serving it; yields the URL it printed and the run's data."""
    root = Path(tempfile.mkdtemp(prefix="agentenv-viewer-"))
    run = root / "calc"
    snapshots: list[str] = []
    proc = None
    try:
        with threaded_app(scripted.create_app(_answers(), TOK)) as policy_url:
            _rollout(run, policy_url)
        trajs = list(tj.read(run))
        result = _search(run)
        snapshots = [n.snapshot_id for n in result.nodes if n.snapshot_id]
        _metrics(run, trajs)
        (root / "outside").symlink_to(Path(tempfile.gettempdir()))  # a symlink out of the folder: never a run
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "trainer.viewer.cli", str(root), "--port", str(port)],
                                stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert proc.stdout is not None
        printed = proc.stdout.readline().strip()  # the one line it prints, or nothing when it failed to start
        assert ": http://" in printed, f"the viewer printed {printed!r} (exit status {proc.poll()})"
        link = printed.split(": ", 1)[1]
        base = f"http://127.0.0.1:{port}"
        assert link.startswith(f"{base}/console/login#token=")

        def up() -> bool:
            try:
                return httpx.get(f"{base}/console/login").status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, "the viewer listening", limit=60)
        yield {"base": base, "link": link, "token": link.split("#token=")[1], "trajs": trajs, "result": result}
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
        from agentenv import Snapshot

        for sid in snapshots:
            Snapshot.get(sid).delete()
        shutil.rmtree(root, ignore_errors=True)


def ready(browser: Any, url: str) -> None:
    browser.get(url)
    wait_for(lambda: browser.execute_script("return document.body.dataset.ready") == "1", f"{url} drawn")


def test_login_refused_without_the_token(browser, site):
    base = site["base"]
    assert httpx.get(f"{base}/console/api/runs").status_code == 401
    r = httpx.get(f"{base}/console/runs/calc", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/console/login"
    assert httpx.post(f"{base}/console/login", data={"token": site["token"] + "x"}).status_code == 401
    browser.delete_all_cookies()
    browser.get(f"{base}/console/login#token=wrong")  # a wrong token in the printed URL's place logs nobody in
    wait_for(lambda: displayed(browser, "#error"),
             "the login page saying the token is wrong")
    assert browser.get_cookies() == []
    browser.get(f"{base}/console/runs")
    assert browser.current_url == f"{base}/console/login"


def test_the_printed_url_logs_in_and_lists_the_run(browser, site):
    browser.delete_all_cookies()
    browser.get(site["link"])
    wait_for(lambda: browser.current_url == f"{site['base']}/console/runs", "the runs page after the login")
    assert "token" not in browser.current_url
    wait_for(lambda: present(browser, 'tr[data-run="calc"]'), "the run's row")
    assert not present(browser, 'tr[data-run="outside"]')  # the symlink out is not a run
    # agentenv view: the console's bar with no sandboxes' pages, and no live badge (no event stream here)
    assert [a.text for a in browser.find_elements(By.CSS_SELECTOR, "nav > a")] == ["Runs"]
    assert not displayed(browser, "#live")
    row = browser.find_element(By.CSS_SELECTOR, 'tr[data-run="calc"]').text
    assert f"{len(site['trajs'])}" in row and "1 searches" in row
    shot(browser, "viewer-runs")
    jar = {c["name"]: c["value"] for c in browser.get_cookies()}
    for bad, error in ((".hidden", "BadViewerRequest"), ("%2e%2e", "BadViewerRequest"), ("outside", "RunNotFound")):
        r = httpx.get(f"{site['base']}/console/api/runs/{bad}/episodes", cookies=jar)
        assert r.status_code in (400, 404) and r.json()["error"] == error, (bad, r.status_code, r.text)


def test_the_episode_list_filters(browser, site):
    losers = [t for t in site["trajs"] if t.reward == 0.0]
    assert losers and len(losers) < len(site["trajs"])
    ready(browser, f"{site['base']}/console/runs/calc?reward_max=0")
    rows = browser.find_elements(By.CSS_SELECTOR, "#episodes tbody tr")
    assert {r.get_attribute("data-episode") for r in rows} == {t.episode_id for t in losers}
    ready(browser, f"{site['base']}/console/runs/calc")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#episodes tbody tr")) == len(site["trajs"])
    shot(browser, "viewer-episodes")


def test_an_unknown_filter_is_refused_with_a_message(browser, site):
    browser.get(f"{site['base']}/console/runs/calc?reward_max=0&colour=red&apply=1")
    wait_for(lambda: "no filter apply, colour" in text(browser, "#status.error"), "the viewer refusing the filters")
    assert "filter by reward_min" in text(browser, "#status")  # what to do instead
    assert not browser.find_elements(By.CSS_SELECTOR, "#episodes tbody tr")


def test_the_episode_page_highlights_exactly_the_loss_mask(browser, site):
    t = next(t for t in site["trajs"] if t.reward == 1.0)
    ready(browser, f"{site['base']}/console/runs/calc/episodes/{t.episode_id}")
    tokens = browser.execute_script("return [...document.querySelectorAll('.conversation .tok')].map(e => "
                                    "[Number(e.dataset.i), e.classList.contains('trained'), Number(e.dataset.mask), "
                                    "Number(e.dataset.logprob), e.textContent])")
    assert [i for i, *_ in tokens] == list(range(len(t.token_ids)))  # every token, once, in order
    assert [i for i, trained, *_ in tokens if trained] == [i for i, m in enumerate(t.loss_mask) if m]
    assert [m for _i, _t, m, *_ in tokens] == t.loss_mask
    assert all(abs(lp - t.logprobs[i]) < 1e-9 for i, _t, _m, lp, _x in tokens)
    assert "".join(text for *_, text in tokens) == TOK.decode(t.token_ids)
    text = browser.find_element(By.ID, "conversation").text
    assert HOSTILE in text and "calculator(" in text and "answer(" in text  # the markup shown as text
    assert not browser.find_elements(By.CSS_SELECTOR, ".conversation img") and browser.title != "1"
    facts = browser.find_element(By.ID, "facts").text
    assert "reward" in facts and "policy" in facts and "submitted" in facts
    shot(browser, "viewer-episode")


def test_a_group_page_shows_every_member_with_its_advantage(browser, site):
    groups: dict[str, list[tj.Trajectory]] = {}
    for t in site["trajs"]:
        groups.setdefault(t.group_id, []).append(t)
    gid, members = next((g, m) for g, m in groups.items() if len({t.reward for t in m}) > 1)
    members.sort(key=lambda t: t.group_index)
    ready(browser, f"{site['base']}/console/runs/calc/groups/{gid}")
    shown = browser.find_elements(By.CSS_SELECTOR, ".member")
    assert [s.get_attribute("data-episode") for s in shown] == [t.episode_id for t in members]
    want = group_advantages([t.reward for t in members])
    for s, t, a in zip(shown, members, want, strict=True):
        assert float(s.find_element(By.CSS_SELECTOR, ".reward").text) == t.reward
        assert abs(float(s.find_element(By.CSS_SELECTOR, ".advantage").text) - a) < 1e-3
    shot(browser, "viewer-group")


def test_the_search_tree_shows_every_node_and_its_snapshot(browser, site):
    result = site["result"]
    ready(browser, f"{site['base']}/console/runs/calc/searches")
    nodes = browser.find_elements(By.CSS_SELECTOR, '[data-search="beam-calc"] li[data-node]')
    assert sorted(int(n.get_attribute("data-node")) for n in nodes) == [n.id for n in result.nodes]
    snaps = {n.snapshot_id for n in result.nodes if n.snapshot_id}
    assert snaps and {e.text for e in browser.find_elements(By.CSS_SELECTOR, ".snapshot")} == snaps
    best = browser.find_element(By.CSS_SELECTOR, '[data-search="beam-calc"]').text
    assert result.best.reward == 1.0 and "best leaf: reward 1," in best
    shot(browser, "viewer-search")


def test_the_metrics_page_draws_every_point_and_interval(browser, site):
    ready(browser, f"{site['base']}/console/runs/calc/metrics")
    groups = len({t.group_id for t in site["trajs"]})
    points = browser.find_elements(By.CSS_SELECTOR, 'svg[data-key="reward/train"] circle.point')
    assert len(points) == groups
    held = browser.find_elements(By.CSS_SELECTOR, 'svg[data-key="pass_rate/heldout"] circle.point.heldout')
    bars = browser.find_elements(By.CSS_SELECTOR, 'svg[data-key="pass_rate/heldout"] line.interval')
    assert len(held) == len(bars) == groups
    assert not present(browser, 'svg[data-key="pass_rate/heldout_lo"]')  # the interval's ends are not series
    # the charts fill the page's width, a row at a time
    width = browser.execute_script("return document.getElementById('charts').getBoundingClientRect().width")
    rights = browser.execute_script("return [...document.querySelectorAll('#charts figure')].map("
                                    "f => f.getBoundingClientRect().right - document.getElementById('charts')"
                                    ".getBoundingClientRect().left)")
    assert max(rights) > 0.95 * width, (rights, width)
    for svg in browser.find_elements(By.CSS_SELECTOR, "svg.chart"):
        assert float(svg.get_attribute("width")) > 0.4 * width
    # the y axis has round ticks, evenly spaced, not only its ends
    values = [float(t.get_attribute("data-value")) for t in
              browser.find_elements(By.CSS_SELECTOR, 'svg[data-key="reward/train"] text.tick.y')]
    assert len(values) >= 3 and len({round(b - a, 12) for a, b in itertools.pairwise(values)}) == 1, values
    # rounding noise around 0 draws flat, on an axis that does not blow it up
    noise = browser.find_elements(By.CSS_SELECTOR, 'svg[data-key="advantage/mean"] circle.point')
    assert len(noise) == groups
    heights = [float(c.get_attribute("cy")) for c in noise]
    assert max(heights) - min(heights) < 1, heights
    shown = [t.text for t in browser.find_elements(By.CSS_SELECTOR, 'svg[data-key="advantage/mean"] text.tick.y')]
    assert not any("e-17" in t for t in shown), shown
    shot(browser, "viewer-metrics")
