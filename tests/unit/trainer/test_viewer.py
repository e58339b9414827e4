"""The trajectory viewer's data (trainer.viewer.data) over shards written by rollout.trajectory's writer, and its routes in
``agentenv serve --runs``'s app (no Docker: no lifespan): runs and the path rules, filters, an episode's tokens with
mask and logprob, groups with the run's advantage settings, saved searches, metrics with intervals."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from agentenv.server import create_app
from rollout import scripted, search
from rollout import trajectory as tj
from rollout.agent import LocalTokenizer
from rollout.cli import _tool_calls, split_messages
from trainer.algorithm.advantages import AdvantageConfig, group_advantages
from trainer.metrics import MetricsLog
from trainer.viewer import data as viewer
from trainer.viewer import runs as viewer_runs
from trainer.viewer import web as viewer_web

TOK = LocalTokenizer()
ROOT = Path(__file__).resolve().parents[3]
TOKEN = "viewer-test-token-" + "z" * 20


def episode(group: str, index: int, reward: float | None, *, answer: str = "42", finish: str = "submitted",
            version: int = 0, malformed: int = 0, grade: dict | None = None, phase: str = "train") -> tj.Trajectory:
    """A real conversation: prompt, a generated tool call, the tool's output, a generated answer."""
    t = tj.Trajectory(task_id=f"task-{group}", env_id="agentenv/Tool-v0", group_id=group, group_index=index,
                      reward=reward, finish_reason=finish, malformed_calls=malformed, grade=grade or {},
                      metadata={"phase": phase})
    t.append(TOK.encode_chat([{"role": "user", "content": "What is 6 * 7? é日"}]), generated=False)
    t.prompt_len = len(t.token_ids)
    for text, out in ((scripted.tool_call("calculator", {"expression": "6 * 7"}), "42"),
                      (scripted.tool_call("answer", {"answer": answer}), None)):
        ids = TOK.encode_assistant(text) + [TOK.eos_id]
        start = len(t.token_ids)
        t.append(ids, generated=True, logprobs=[-0.05 * (i + 1) for i in range(len(ids))])
        t.turns.append(tj.Turn(start, len(ids), version, tool_calls=1, policy_s=0.5, env_s=0.25))
        if out is not None:
            t.append(TOK.encode_chat([{"role": "tool", "tool_call_id": "functions.calculator:0", "content": out}]),
                     generated=False)
    if finish in tj.INFRA_ERRORS:
        t.reward = None
    return t.check()


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    runs = tmp_path / "runs"
    tj.write(runs / "roll", [episode("g1", 0, 1.0), episode("g1", 1, 0.0, answer="1", malformed=1),
                             episode("g1", 2, 1.0, version=1),
                             episode("g2", 0, None, finish="env_error", phase="eval")], records_per_shard=2)
    train = runs / "train"
    tj.write(train / "trajectories", [episode("t1", i, r) for i, r in enumerate([1.0, 0.0, 0.0])])
    (train / "config.toml").write_text('[rl]\nbaseline = "loo"  # leave-one-out\nstd_normalize = false\n')
    log = MetricsLog(train / "metrics.jsonl")
    log.write(0, {"pass_rate/heldout": 0.5, "pass_rate/heldout_lo": 0.25, "pass_rate/heldout_hi": 0.75,
                  "eval": "before"})
    log.write(1, {"reward/train": 0.4, "loss": float("nan"), "pass_rate/heldout": 0.6})
    with open(train / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "reward/tr')  # a torn last line
    (runs / "empty").mkdir()
    (runs / ".hidden").mkdir()
    tj.write(runs / ".hidden", [episode("h", 0, 1.0)])
    (runs / "out").symlink_to(runs / "roll")  # a symlink is never a run (it could lead anywhere)
    return runs


def test_runs_are_listed_from_the_folder_and_names_are_never_paths(root):
    assert set(viewer_runs.list_runs(root)) == {"roll", "train"}
    assert set(viewer_runs.list_runs(root / "roll")) == {"roll"}  # `agentenv view runs/NAME`: the run itself
    assert viewer_runs.load(root, "train").kind == "train" and viewer_runs.load(root, "roll").kind == "rollout"
    (root / "roll" / "summary.json").write_text(json.dumps({"groups": 2, "reward_mean": 0.5}))  # rollout's own
    line = viewer_runs.brief("roll", root / "roll")  # the runs page's line: no shard read
    assert (line["episodes"], line["groups"], line["reward_mean"], line["kind"]) == (4, 2, 0.5, "rollout")
    for bad in ("..", "../runs", "/etc", ".hidden", "roll/..", ""):
        with pytest.raises(viewer_runs.BadViewerRequest, match="plain name"):
            viewer_runs.load(root, bad)
    for absent in ("out", "empty", "nope"):
        with pytest.raises(viewer_runs.RunNotFound):
            viewer_runs.load(root, absent)
    elsewhere = root.parent / "elsewhere"  # a train run whose trajectories/ is a symlink out of the folder
    tj.write(elsewhere, [episode("x", 0, 1.0)])
    (root / "linked").mkdir()
    (root / "linked" / "metrics.jsonl").write_text("")
    (root / "linked" / "trajectories").symlink_to(elsewhere)
    assert "linked" not in viewer_runs.list_runs(root)
    with pytest.raises(viewer_runs.RunNotFound):
        viewer_runs.load(root, "linked")


def test_a_run_is_read_again_once_its_index_changes(root):
    assert viewer_runs.load(root, "roll").summary()["episodes"] == 4
    assert viewer_runs.load(root, "roll") is viewer_runs.load(root, "roll")  # cached
    with tj.ShardWriter(root / "roll") as w:
        w.write(episode("g3", 0, 1.0))
    assert viewer_runs.load(root, "roll").summary()["episodes"] == 5
    (root / "roll" / "index.json").unlink()  # a writer killed before its index: the shards are still read
    assert viewer_runs.load(root, "roll").summary()["episodes"] == 5


def ids(data: dict) -> list[tuple[str, int]]:
    return [(r["group_id"], r["group_index"]) for r in data["rows"]]


def test_the_filters(root):
    run = viewer_runs.load(root, "roll")
    assert len(viewer.episodes(run, {})["rows"]) == 4
    assert ids(viewer.episodes(run, {"reward_min": "0.5"})) == [("g1", 0), ("g1", 2)]
    assert ids(viewer.episodes(run, {"reward_max": "0"})) == [("g1", 1)]  # no reward passes no reward filter
    assert ids(viewer.episodes(run, {"finish": "env_error"})) == [("g2", 0)]
    assert ids(viewer.episodes(run, {"weight_version": "1"})) == [("g1", 2)]
    assert ids(viewer.episodes(run, {"malformed": "yes"})) == [("g1", 1)]
    assert ids(viewer.episodes(run, {"group": "g2"})) == ids(viewer.episodes(run, {"phase": "eval"})) == [("g2", 0)]
    assert ids(viewer.episodes(run, {"task": "task-g1", "limit": "1", "offset": "1"})) == [("g1", 1)]
    assert viewer.episodes(run, {"tampering": "yes"})["total"] == 0
    assert viewer.episodes(run, {})["choices"] == {"finish": ["env_error", "submitted"], "phase": ["eval", "train"],
                                                  "weight_version": [0, 1]}
    for params, words in (({"rewardmin": "1"}, "no filter rewardmin"), ({"reward_min": "x"}, "not a number"),
                          ({"finish": "won"}, "not a finish reason"), ({"malformed": "maybe"}, "yes, no or any"),
                          ({"limit": "0"}, "out of range")):
        with pytest.raises(viewer_runs.BadViewerRequest, match=words):
            viewer.episodes(run, params)


def test_an_episode_is_every_token_with_its_mask_and_logprob(root):
    run = viewer_runs.load(root, "roll")
    t = run.episodes[0]
    e = viewer.episode(run, t.episode_id, TOK.decode, _tool_calls, split_messages)
    spans = e["prompt"] + [tok for turn in e["turns_detail"] for part in ("before", "generated", "after")
                           for tok in turn[part]] + e["tail"]
    assert [s[0] for s in spans] == list(range(len(t.token_ids)))
    assert [s[2] for s in spans] == t.loss_mask and [s[3] for s in spans] == t.logprobs
    assert "".join(s[1] for s in spans) == TOK.decode(t.token_ids)  # é and 日 split over tokens come out whole
    assert all(s[2] == 1 for turn in e["turns_detail"] for s in turn["generated"])
    first, second = e["turns_detail"]
    assert first["tool_calls"] == ['calculator({"expression": "6 * 7"})'] and second["tool_calls"][0].startswith(
        "answer(")
    assert first["outputs"] == [{"name": "tool", "text": "## Return of functions.calculator:0\n42"}]
    assert e["time"]["policy_s"] == 1.0 and e["time"]["env_s"] == 0.5
    with pytest.raises(viewer_runs.RunNotFound):
        viewer.episode(run, "0" * 16, TOK.decode, _tool_calls, split_messages)


def test_the_grade_shows_tests_drops_and_tampering():
    g = viewer.grade_view({"resolved": False, "FAIL_TO_PASS": {"t::a": "FAILED"}, "PASS_TO_PASS": {"t::b": "PASSED"},
                           "patch": "diff", "grading": {"dropped": [{"path": "tests/x.py", "reason": "test"}],
                                                        "tampering": True, "tampering_reasons": ["canary tripped"],
                                                        "timings_ms": {"tests": 12.5}}})
    assert g["tests"] == {"FAIL_TO_PASS": {"t::a": "FAILED"}, "PASS_TO_PASS": {"t::b": "PASSED"}}
    assert g["dropped"] == [{"path": "tests/x.py", "reason": "test"}] and g["tampering"]
    assert g["tampering_reasons"] == ["canary tripped"] and g["other"] == {"resolved": False}
    t = episode("g", 0, 0.0, grade={"grading": {"tampering": True}})
    assert viewer.row(t)["tampering"] and not viewer.row(episode("g", 0, 0.0))["tampering"]


def test_a_group_has_the_advantages_the_run_computed(root):
    roll = viewer.group(viewer_runs.load(root, "roll"), "g1", TOK.decode, _tool_calls)
    assert [m["group_index"] for m in roll["members"]] == [0, 1, 2]
    assert [m["advantage"] for m in roll["members"]] == group_advantages([1.0, 0.0, 1.0])  # GRPO's defaults
    train = viewer.group(viewer_runs.load(root, "train"), "t1", TOK.decode, _tool_calls)
    loo = AdvantageConfig("loo", std_normalize=False)
    assert [m["advantage"] for m in train["members"]] == group_advantages([1.0, 0.0, 0.0], loo)
    assert train["advantages"]["baseline"] == "loo" and "config.toml" in train["advantages"]["source"]
    assert train["members"][0]["turns_detail"][1]["tool_calls"][0].startswith("answer(")
    with pytest.raises(viewer_runs.RunNotFound):
        viewer.group(viewer_runs.load(root, "roll"), "g9", TOK.decode, _tool_calls)


def test_a_saved_search_is_listed_with_its_tree(root):
    best = episode("s", 0, 1.0)
    nodes = [search.Node(0, None, 0, kept=True), search.Node(1, 0, 1, action="x", score=0.5, kept=True,
                                                             snapshot_id="snap-1"),
             search.Node(2, 1, 2, reward=1.0, done=True, finish="submitted")]
    path = search.SearchResult(best, nodes, [best], "beam").save(root / "roll", "s1")
    assert path == root / "roll" / "searches" / "s1.json" and not list(path.parent.glob(".*"))  # renamed in place
    (path.parent / "broken.json").write_text("{")
    found = viewer.searches(viewer_runs.load(root, "roll"))["searches"]
    assert [s["id"] for s in found] == ["s1"]
    assert found[0]["kind"] == "beam" and found[0]["best"]["reward"] == 1.0
    assert [n["snapshot_id"] for n in found[0]["nodes"]] == [None, "snap-1", None]
    assert viewer_runs.load(root, "roll").summary()["searches"] == 2  # files in searches/ (the broken one counts)


def test_metrics_are_series_and_held_out_points_with_intervals(root):
    m = viewer.metrics(viewer_runs.load(root, "train"))
    assert m["rows"] == 2  # the torn line is skipped
    assert m["intervals"] == {"pass_rate/heldout": [[0, 0.5, 0.25, 0.75]]}
    assert m["series"] == {"pass_rate/heldout": [[1, 0.6]], "reward/train": [[1, 0.4]]}  # NaN and text left out
    assert viewer.metrics(viewer_runs.load(root, "roll")) == {"run": "roll", "rows": 0, "series": {}, "intervals": {}}


def test_agentenv_serve_runs_shows_the_viewer_in_the_console(root):
    pages = [lambda app: viewer_web.install(app, root)]  # what agentenv serve --runs finds as an entry point
    c = TestClient(create_app(TOKEN, e2b=False, pages=pages), base_url="http://127.0.0.1:8700",
                   follow_redirects=False)
    assert c.get("/console/api/runs").status_code == 401
    assert c.get("/console/runs").headers["location"] == "/console/login"
    assert c.post("/console/login", data={"token": TOKEN}).status_code == 303
    page = c.get("/console/runs")
    assert page.status_code == 200 and "viewer.js" in page.text
    assert '<a href="/console/">Sandboxes</a>' in page.text  # the sandboxes' pages linked from the viewer's nav
    # one top bar on every page, the console's and the viewer's, the page's own section marked
    bars = {}
    for path, here in (("/console/", "Sandboxes"), ("/console/snapshots", "Snapshots"), ("/console/server", "Server"),
                       ("/console/sandbox/sb-x", "Sandboxes"), ("/console/runs", "Runs"), ("/console/runs/roll", "Runs"),
                       ("/console/runs/roll/metrics", "Runs")):
        bar = re.search(r"<nav>.*?</nav>", c.get(path).text, re.S)
        assert bar is not None, path
        assert re.findall(r'class="here">([^<]*)<', bar.group(0)) == [here], path
        bars[path] = bar.group(0).replace(' class="here"', "")
    assert len(set(bars.values())) == 1, bars
    assert "script-src 'self'" in page.headers["content-security-policy"]
    listed = c.get("/console/api/runs").json()
    assert listed["mode"] == "serve" and [r["name"] for r in listed["runs"]] == ["roll", "train"]
    assert c.get("/console/").status_code == 200  # the console's own pages are still there
    assert c.get("/console/runs/.hidden").json()["error"] == "BadViewerRequest"
    assert c.get("/console/api/runs/out/episodes").status_code == 404
    r = c.get("/console/api/runs/roll/episodes", params={"finish": "nope"})
    assert r.status_code == 400 and r.json()["fix"].startswith("one of")
    assert c.get("/console/api/runs/roll/episodes").json()["total"] == 4
    with pytest.raises(ValueError, match="not a folder"):
        viewer_web.install(create_app(TOKEN, e2b=False), root / "nope")
    plain = TestClient(create_app(TOKEN, e2b=False), base_url="http://127.0.0.1:8700", follow_redirects=False)
    plain.post("/console/login", data={"token": TOKEN})
    assert plain.get("/console/runs").status_code == 404  # no --runs, no viewer
    # the viewer's script and style come from its own package, beside the console's, by listed name only
    assert c.get("/console/static/viewer.js").status_code == 200 and c.get("/console/static/console.js").status_code == 200
    assert plain.get("/console/static/viewer.js").status_code == 404 and plain.get("/console/static/console.css").status_code == 200
    for name in ("runs.html", "..%2Fweb.py", "%2E%2E%2Fstatic%2Fviewer.js", "web.py"):
        assert c.get(f"/console/static/{name}").status_code == 404, name


def test_agentenv_view_is_the_viewers_command():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["agentenv.commands"]
    assert scripts["view"] == "trainer.viewer.cli:app"
    pages = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["agentenv.console"]
    assert pages["runs"] == "trainer.viewer.web:install"
    page = (ROOT / "trainer/viewer/static/run.html").read_text()  # its form sends every filter
    assert all(f'name="{f}"' in page for f in viewer.FILTERS)


def test_agentenv_serve_runs_finds_the_viewer_through_its_entry_point(root):
    from importlib.metadata import entry_points

    from agentenv.cli import _console_pages

    with pytest.raises(ValueError, match="no console pages named 'nope'"):
        _console_pages("nope", root)
    if not any(ep.name == "runs" for ep in entry_points(group="agentenv.console")):
        pytest.skip("this checkout's entry points are not installed yet (pip install -e ., as the bootstrap does)")
    c = TestClient(create_app(TOKEN, e2b=False, pages=[_console_pages("runs", root)]), base_url="http://127.0.0.1:8700")
    c.post("/console/login", data={"token": TOKEN})
    assert [r["name"] for r in c.get("/console/api/runs").json()["runs"]] == ["roll", "train"]


def test_a_harness_episode_shows_its_branch_its_session_and_its_other_branches(tmp_path):
    """docs/harnesses.md: the records of one harness episode's branches (same group and index) link to each other,
    and each shows its cause, parent and the session's calls its turns were."""
    session = {"session": "s", "calls": 3, "branches": 2, "causes": {"start": 1, "extend": 1, "answer_dropped": 1},
               "merge_rate": 0.5, "retries": 0, "errors": 0, "stopped": None}
    main, side = episode("h1", 0, 1.0), episode("h1", 0, 1.0)
    main.metadata.update(harness="mini-swe-agent", outcome="graded", harness_exit="Submitted", gateway={
        **session, "branch": 1, "cause": "answer_dropped", "parent_branch": 0, "parent_call": 0, "fork_at": 12,
        "calls_in_branch": [1, 2]})
    side.metadata.update(harness="mini-swe-agent", outcome="graded", gateway={
        **session, "branch": 0, "cause": "start", "parent_branch": None, "parent_call": None, "fork_at": 0,
        "calls_in_branch": [0]})
    plain = episode("h1", 1, 0.0)
    tj.write(tmp_path / "runs" / "h", [main, side, plain])
    run = viewer_runs.load(tmp_path / "runs", "h")
    h = viewer.episode(run, main.episode_id, TOK.decode, _tool_calls, split_messages)["harness"]
    assert (h["name"], h["outcome"], h["cause"], h["parent_branch"], h["fork_at"]) == (
        "mini-swe-agent", "graded", "answer_dropped", 0, 12)
    assert h["calls"] == [1, 2] and h["session"]["causes"]["answer_dropped"] == 1
    assert h["other_branches"] == [{"episode_id": side.episode_id, "branch": 0, "cause": "start"}]
    assert viewer.episode(run, plain.episode_id, TOK.decode, _tool_calls, split_messages)["harness"] is None
