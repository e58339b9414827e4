"""The evaluation's statistics (mean@k, pass@k, bootstrap intervals, the paired gain) and the pre-flight's proof
that held-out, validation and training tasks are apart."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envs import lookup_env
from trainer.loop.config import load
from trainer.loop.evaluation import paired_gain, pass_at_k, per_task_passes, summarize
from trainer.loop.services import PreflightError, preflight
from trainer.loop.tasks import check_apart

LOOKUP = "agentenv/Lookup-v0"


def test_pass_at_k_is_the_chance_one_of_k_draws_passes():
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0 and pass_at_k(8, 8, 1) == 1.0
    assert pass_at_k(4, 2, 1) == pytest.approx(0.5)
    assert pass_at_k(10, 3, 2) == pytest.approx(1 - (7 * 6) / (10 * 9))
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_summarize_gives_mean_and_pass_at_k_with_intervals_that_hold_them():
    per_task = {"a": [True, True, False, False], "b": [True] * 4, "c": [False] * 4, "d": [], "e": [True, False] * 2}
    s = summarize(per_task, 4, seed=1)
    assert s["tasks"] == 4 and s["unscored_tasks"] == 1 and s["samples"] == 16 and s["k"] == 4
    assert s["mean_at_k"] == pytest.approx((0.5 + 1 + 0 + 0.5) / 4)
    assert s["pass_at_k"] == pytest.approx(3 / 4)
    lo, hi = s["mean_at_k_ci"]
    assert 0 <= lo < s["mean_at_k"] < hi <= 1
    assert summarize(per_task, 4, seed=1) == s                 # the bootstrap is seeded: figures repeat


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.booleans(), min_size=1, max_size=6), min_size=2, max_size=30), st.integers(0, 5))
def test_the_interval_always_holds_the_estimate(samples, seed):
    s = summarize({str(i): v for i, v in enumerate(samples)}, 6, seed=seed)
    for key in ("mean_at_k", "pass_at_k"):
        lo, hi = s[f"{key}_ci"]
        assert lo - 1e-12 <= s[key] <= hi + 1e-12 and 0 <= lo <= hi <= 1


def test_the_paired_gain_cancels_the_spread_between_tasks():
    # hard and easy tasks, each one sample in four better after: the gain is +0.25 on every task
    before = {f"t{i}": [True] * (i % 3) + [False] * (4 - i % 3) for i in range(30)}
    after = {t: [True] * (sum(v) + 1) + [False] * (3 - sum(v)) for t, v in before.items()}
    g = paired_gain(before, after)
    assert g["tasks"] == 30 and g["gain"] == pytest.approx(0.25) and g["gain_ci"] == pytest.approx([0.25, 0.25])
    unpaired = summarize(after, 4)["mean_at_k_ci"]
    assert unpaired[1] - unpaired[0] > 0.1                      # the tasks' spread, which pairing removes
    assert paired_gain({"x": []}, {"x": [True]})["tasks"] == 0 and math.isnan(paired_gain({}, {})["gain"])


def test_per_task_passes_leave_infrastructure_failures_unscored():
    t = [SimpleNamespace(task_id="a", reward=1.0, infra_error=False), SimpleNamespace(task_id="a", reward=0.0,
         infra_error=False), SimpleNamespace(task_id="b", reward=None, infra_error=True)]
    assert per_task_passes(t, 1.0) == {"a": [True, False], "b": []}


def test_the_splits_of_lookup_and_tool_are_apart_and_an_overlap_is_refused():
    ids = "py:envs.lookup_env:task_ids split={} n={} levels=[0] words=12"
    assert check_apart(LOOKUP, {"train": ids.format("train", 2000), "heldout": ids.format("heldout", 100),
                                "validation": ids.format("validation", 100)}) is None
    assert check_apart("agentenv/Tool-v0", {s: f"py:envs.tool_env:task_ids split={s}"
                                            for s in ("train", "heldout", "validation")}) is None
    # two seeds of one split can make the same task: the check compares what the policy sees, not ids
    other_seeds = "ids:" + ",".join(lookup_env.task_ids("train", 200, (0,), start=500, words=12))
    problem = check_apart(LOOKUP, {"train": ids.format("train", 50), "heldout": other_seeds})
    assert problem is not None and "share a task" in problem
    assert "cannot check" in (check_apart("agentenv/Tool-v0", {"train": "seeds:0-9", "heldout": "seeds:10-19"}) or "")
    # an env without task_key is compared by id
    assert "share a task" in (check_apart("agentenv/Shell-v0", {"train": "ids:a,b", "heldout": "ids:b"}) or "")


def test_the_preflight_refuses_a_run_whose_heldout_tasks_are_training_tasks(tmp_path):
    cfg = load(overrides=[f'out_dir="{tmp_path}"', 'env.train_tasks="ids:calc-001,calc-002"',
                          'env.heldout_tasks="ids:calc-002"', 'env.validation_tasks=""', "sft.enabled=false",
                          "swe.enabled=false"])
    with pytest.raises(PreflightError, match="share a task"):
        preflight(cfg, resume=False)
    with pytest.raises(Exception, match="validation"):
        load(overrides=['env.validation_tasks=""', "eval.every=2"])


def test_the_intervals_do_not_depend_on_the_order_tasks_finished_in():
    """Tasks finish in any order; the same results give the same intervals (the bootstrap draws by position)."""
    per_task = {f"t{i}": [j < i % 5 for j in range(4)] for i in range(12)}
    backwards = dict(reversed(list(per_task.items())))
    assert summarize(per_task, 4, seed=3) == summarize(backwards, 4, seed=3)
