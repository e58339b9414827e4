"""The benchmark harness (bench/harness.py): one percentile formula, the JSON layout, ratios, recorded errors.

No Docker and no timing assertions: only the arithmetic and the file the harness writes.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable
from pathlib import Path

import pytest

from bench import harness
from bench.harness import Report, Result, Stat, fmt_ratio, percentile, ratio, recording, write_json_atomic

REQUIRED_KEYS = {"schema", "benchmark", "started_at", "duration_s", "commit", "dirty", "machine", "args",
                 "results", "ratios", "errors", "fatal", "info", "notes"}
STAT_KEYS = {"n", "median_ms", "p90_ms", "p99_ms", "min_ms", "max_ms", "mean_ms", "samples_ms"}


# --- the percentile formula ---------------------------------------------------------------------------------


def test_median_of_odd_and_even_counts() -> None:
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0  # odd n: the middle sample, order of input irrelevant
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5  # even n: mean of the two middle samples


def test_single_sample_is_every_percentile() -> None:
    for q in (0.0, 0.5, 0.9, 0.99, 1.0):
        assert percentile([7.0], q) == 7.0


def test_p90_interpolates_between_closest_ranks() -> None:
    # n = 5: h = 4 * 0.9 = 3.6 -> x[3] + 0.6 (x[4] - x[3]) = 40 + 0.6 * 60 = 76
    assert percentile([10.0, 20.0, 30.0, 40.0, 100.0], 0.9) == pytest.approx(76.0)
    # n = 3: h = 1.8 -> 2 + 0.8 * (10 - 2) = 8.4 (the old nearest-rank formulas gave 10 here)
    assert percentile([1.0, 2.0, 10.0], 0.9) == pytest.approx(8.4)
    # n = 11, 0..10: h = 9 exactly -> the sample 9; p99: h = 9.9 -> 9.9
    xs = [float(i) for i in range(11)]
    assert percentile(xs, 0.9) == pytest.approx(9.0)
    assert percentile(xs, 0.99) == pytest.approx(9.9)
    assert percentile(xs, 0.0) == 0.0 and percentile(xs, 1.0) == 10.0


def test_agrees_with_statistics_inclusive_quantiles() -> None:
    xs = [0.31, 0.05, 0.77, 0.12, 0.5, 0.93, 0.44, 0.2]
    deciles = statistics.quantiles(xs, n=10, method="inclusive")
    assert percentile(xs, 0.9) == pytest.approx(deciles[8])
    assert percentile(xs, 0.5) == pytest.approx(statistics.median(xs))


def test_percentile_edges() -> None:
    assert percentile([], 0.5) is None
    with pytest.raises(ValueError):
        percentile([1.0], 1.5)


def test_stat_summary_and_units() -> None:
    st = Stat.of([0.001, 0.002, 0.003, 0.010])
    assert st is not None
    assert (st.n, st.min, st.max) == (4, 0.001, 0.010)
    assert st.median == pytest.approx(0.0025)
    assert st.mean == pytest.approx(0.004)
    js = st.to_json()
    assert js["median_ms"] == 2.5 and js["max_ms"] == 10.0 and js["mean_ms"] == 4.0
    # n = 4: h = 2.7 -> 3 + 0.7 * (10 - 3) = 7.9 ms
    assert js["p90_ms"] == pytest.approx(7.9)
    assert Stat.of([]) is None


# --- ratios -------------------------------------------------------------------------------------------------


def test_ratio_and_its_text() -> None:
    assert ratio(3.0, 1.5) == 2.0
    assert ratio(None, 1.0) is None and ratio(1.0, None) is None and ratio(1.0, 0.0) is None
    assert fmt_ratio(2.0) == "2.0×"
    assert fmt_ratio(30.44) == "30.4×"
    assert fmt_ratio(0.83) == "0.8×"
    assert fmt_ratio(0.0123) == "0.012×"
    assert fmt_ratio(None) == "-"


def test_report_ratio_uses_medians_of_named_results(tmp_path: Path) -> None:
    rep = Report("t")
    rep.results["docker.op"] = Result(samples=[0.3, 0.1, 0.2])  # median 0.2
    rep.results["agentenv.op"] = Result(samples=[0.05, 0.1, 0.5, 0.08])  # median 0.09
    x = rep.add_ratio("op", "docker.op", "agentenv.op")
    assert x == pytest.approx(0.2 / 0.09)
    assert rep.ratios["op"] == {"value": round(0.2 / 0.09, 3), "text": "2.2×", "numerator": "docker.op",
                                "denominator": "agentenv.op"}
    assert rep.add_ratio("missing", "docker.nothing", "agentenv.op") is None
    assert rep.ratios["missing"]["value"] is None and rep.ratios["missing"]["text"] == "-"


# --- errors -------------------------------------------------------------------------------------------------


def test_an_errored_operation_keeps_its_error_and_only_real_samples() -> None:
    r = Result()
    with recording(r, "op"):
        r.add(0.004)
        raise RuntimeError("checkpoint refused")
    assert r.error == "RuntimeError: checkpoint refused"
    js = r.to_json()
    assert js["error"] == "RuntimeError: checkpoint refused"
    assert js["n"] == 1 and js["samples_ms"] == [4.0]

    never = Result()
    with recording(never, "op2"):
        raise TimeoutError("no answer")
    js = never.to_json()
    assert js == {"n": 0, "error": "TimeoutError: no answer"}  # no figure is made up


def test_recording_lets_keyboard_interrupt_through() -> None:
    with pytest.raises(KeyboardInterrupt), recording(Result(), "op"):
        raise KeyboardInterrupt


# --- the JSON document ---------------------------------------------------------------------------------------


def test_report_json_has_the_schema(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(harness, "git_commit", lambda root=harness.ROOT: ("abc123", False))
    rep = Report("demo", {"runs": 3})
    ok = rep.result("fast", note="a note")
    ok.samples += [0.001, 0.002, 0.003]
    ok.add_extra("phase", 0.0005)
    ok.fields["target_ms"] = 5.0
    rep.result("broken").fail(RuntimeError("boom"))
    rep.info["k"] = 1
    rep.notes.append("hello")
    path = rep.write(tmp_path / "demo.json")
    doc = json.loads(Path(tmp_path / "demo.json").read_text())
    assert path.name == "demo.json"
    assert set(doc) == REQUIRED_KEYS
    assert doc["schema"] == harness.SCHEMA == 1
    assert (doc["benchmark"], doc["commit"], doc["dirty"], doc["args"]) == ("demo", "abc123", False, {"runs": 3})
    assert doc["started_at"].endswith("Z")
    assert {"cpus", "kernel", "python", "loadavg_end", "cpu_probe_ms_start", "cpu_probe_ms_end"} <= set(doc["machine"])
    assert doc["machine"]["cpu_probe_ms_start"] > 0 and doc["machine"]["cpu_probe_ms_end"] > 0
    assert 0 <= doc["machine"].get("steal_pct", 0) <= 100
    fast = doc["results"]["fast"]
    assert set(fast) >= STAT_KEYS
    assert fast["median_ms"] == 2.0 and fast["note"] == "a note" and fast["target_ms"] == 5.0
    assert fast["extra"]["phase"]["median_ms"] == 0.5
    assert "error" not in fast
    assert doc["results"]["broken"] == {"n": 0, "error": "RuntimeError: boom"}
    assert doc["errors"] == {"broken": "RuntimeError: boom"}
    assert doc["info"] == {"k": 1} and doc["notes"] == ["hello"] and doc["fatal"] is None


def test_write_is_atomic_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "x.json"
    write_json_atomic(target, {"a": 1})
    write_json_atomic(target, {"a": 2})
    assert json.loads(target.read_text()) == {"a": 2}
    assert os.listdir(target.parent) == ["x.json"]


def test_a_failed_write_keeps_the_previous_file(tmp_path: Path) -> None:
    target = tmp_path / "x.json"
    write_json_atomic(target, {"a": 1})

    class Unserialisable:
        def __str__(self) -> str:
            raise RuntimeError("cannot serialise")

    with pytest.raises(RuntimeError):
        write_json_atomic(target, {"a": Unserialisable()})
    assert json.loads(target.read_text()) == {"a": 1}
    assert os.listdir(tmp_path) == ["x.json"]


def test_git_commit_outside_a_checkout(tmp_path: Path) -> None:
    assert harness.git_commit(tmp_path) == ("unknown", None)


def test_long_sample_lists_keep_only_statistics() -> None:
    js = Result(samples=[0.001] * (harness.MAX_SAMPLES_IN_JSON + 1)).to_json()
    assert "samples_ms" not in js and js["n"] == harness.MAX_SAMPLES_IN_JSON + 1


# --- bench.sandbox's table and driver (fake sides: no Docker) ---------------------------------------------------


def test_sandbox_table_is_consistent() -> None:
    from bench.sandbox import OPERATIONS

    names = [op.name for op in OPERATIONS]
    assert len(names) == len(set(names))
    for i, op in enumerate(OPERATIONS):
        if op.measured_by is not None:
            assert op.agentenv is None and op.docker is None
            assert op.measured_by in names[:i]  # measured by an earlier row
        else:
            assert op.agentenv is not None and op.agentenv.__name__ == op.name
            assert op.docker is None or op.docker.__name__ == op.name
        assert op.fixture in (None, "repo", "mem", "fork")


def test_drive_runs_each_side_with_its_counts_and_releases_fixtures(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import sandbox
    from bench.sandbox_common import Cleanup, Fixture, Side

    log: list[str] = []

    class FakeSide(Side):
        def setup(self, name: str) -> Fixture:
            log.append(f"setup {name}")
            return Fixture(name, "true")

        def teardown(self, fx: Fixture) -> None:
            log.append(f"teardown {fx.handle}")

    def measure(op: str, fails: bool = False) -> Callable[[Side, int], None]:
        def fn(side: Side, runs: int) -> None:
            log.append(f"{side.name} {op} x{runs}")
            if op == "b":
                side.result("b_child")
            with recording(side.result(op), op):
                side.fixture({"a": "repo", "b": "fork", "c": "mem"}[op])
                if fails:
                    raise RuntimeError("nope")
                side.result(op).add(0.01)
        fn.__name__ = op
        return fn

    Op = sandbox.Op
    monkeypatch.setattr(sandbox, "OPERATIONS", [
        Op("a", "a", "-", None, measure("a"), measure("a"), fixture="repo"),
        Op("b", "b", "-", None, measure("b", fails=True), None, fixture="fork", slow=True),
        Op("b_child", "b child", "-", None, None, None, measured_by="b"),
        Op("c", "c", "-", None, measure("c"), measure("c"), fixture="mem", slow=True),
    ])
    a_side, d_side = FakeSide(Cleanup("t"), "repo"), FakeSide(Cleanup("t"), "repo")
    a_side.name, d_side.name = "agentenv", "docker"
    sandbox.drive(a_side, runs=5, docker_runs=2)
    assert log == ["agentenv a x5", "setup repo", "agentenv b x5", "teardown repo", "agentenv c x5", "setup mem",
                   "teardown mem"]
    assert a_side.results["b"].error == "RuntimeError: nope"
    assert a_side.results["b_child"].error == "not measured: b failed (RuntimeError: nope)"
    assert a_side.results["a"].samples == [0.01] and a_side.results["c"].samples == [0.01]
    log.clear()
    sandbox.drive(d_side, runs=5, docker_runs=2)
    assert log == ["docker a x5", "setup repo", "teardown repo", "docker c x2", "setup mem", "teardown mem"]
    assert "b" not in d_side.results and "b_child" not in d_side.results
