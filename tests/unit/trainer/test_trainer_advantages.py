"""GRPO advantages against hand-computed values: group-normalised, Dr. GRPO (no std), leave-one-out; infrastructure
failures left out of the statistics and the loss and counted; groups of equal rewards dropped on request."""

import math
import random
import sys
from pathlib import Path

import pytest

from trainer.algorithm.advantages import AdvantageConfig, group_advantages, grpo_advantages
from trainer.algorithm.batch import rl_batch

sys.path.insert(0, str(Path(__file__).parent))
from trainer_helpers import make_traj  # noqa: E402


def approx(xs, ys, tol=1e-6):
    return all((x is None and y is None) or (x is not None and y is not None and abs(x - y) < tol)
               for x, y in zip(xs, ys, strict=True))


def test_grpo_group_normalised_by_hand():
    # rewards 1,0,0,1: mean 0.5; sample std sqrt((4 * 0.25) / 3) = 0.57735
    a = group_advantages([1.0, 0.0, 0.0, 1.0])
    s = math.sqrt(1 / 3)
    assert approx(a, [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s], 1e-5)
    # rewards 2, 4, 9: mean 5, std sqrt((9 + 1 + 16) / 2) = sqrt(13)
    a = group_advantages([2.0, 4.0, 9.0], AdvantageConfig(eps=0.0))
    assert approx(a, [-3 / math.sqrt(13), -1 / math.sqrt(13), 4 / math.sqrt(13)])


def test_dr_grpo_has_no_std_division():
    a = group_advantages([1.0, 0.0, 0.0, 0.0], AdvantageConfig(std_normalize=False))
    assert approx(a, [0.75, -0.25, -0.25, -0.25])


def test_leave_one_out_baseline():
    # A_i = r_i - mean of the others
    a = group_advantages([1.0, 0.0, 0.0, 0.0], AdvantageConfig(baseline="loo", std_normalize=False))
    assert approx(a, [1.0, -1 / 3, -1 / 3, -1 / 3])
    # equals G/(G-1) * (r_i - mean)
    rs = [0.3, 0.9, 0.1, 0.5, 0.7]
    loo = group_advantages(rs, AdvantageConfig(baseline="loo", std_normalize=False))
    m = sum(rs) / 5
    assert approx(loo, [5 / 4 * (r - m) for r in rs])
    # with the std division as well
    s = math.sqrt(sum((r - m) ** 2 for r in rs) / 4)
    both = group_advantages(rs, AdvantageConfig(baseline="loo", eps=0.0))
    assert approx(both, [5 / 4 * (r - m) / s for r in rs])
    with pytest.raises(ValueError):
        AdvantageConfig(baseline="median")  # type: ignore[arg-type]


def test_infra_failures_are_left_out_of_the_group_statistics():
    # the None reward does not count as 0: statistics over [1, 0] only (mean 0.5, std sqrt(0.5))
    a = group_advantages([1.0, None, 0.0])
    assert approx(a, [0.5 / math.sqrt(0.5), None, -0.5 / math.sqrt(0.5)], 1e-5)
    # as a 0 it would have changed the others' advantages
    assert not approx(a, [x if x is not None else None for x in group_advantages([1.0, 0.0, 0.0])], 1e-3)


def test_equal_rewards_give_zero_and_singletons_have_no_baseline():
    assert group_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]
    assert group_advantages([0.7]) == [0.0]
    assert group_advantages([0.7, None]) == [0.0, None]
    assert group_advantages([None, None]) == [None, None]


def test_grpo_advantages_groups_counts_and_drops():
    rng = random.Random(0)
    eps = ([make_traj(rng, "a", i, r) for i, r in enumerate([1.0, 0.0, 0.0, 1.0])]
           + [make_traj(rng, "b", i, r) for i, r in enumerate([1.0, 1.0, 1.0])]
           + [make_traj(rng, "c", 0, 1.0), make_traj(rng, "c", 1, None, finish="env_error"),
              make_traj(rng, "c", 2, 0.0)]
           + [make_traj(rng, "d", 0, 0.0), make_traj(rng, "d", 1, None, finish="policy_error")])
    out = grpo_advantages(eps)
    assert out.stats["infra_errors"] == 2 and out.stats["groups"] == 4
    assert len(out.kept) == 4 + 3 + 2 + 1                      # every episode but the two failures
    assert all(e.reward is not None for e in out.kept)
    assert out.values[eps[4].episode_id] == 0.0                # an all-equal group: zero advantage
    assert out.stats["groups_singleton"] == 1                  # group d has one usable episode

    dropped = grpo_advantages(eps, AdvantageConfig(drop_all_equal=True))
    assert dropped.stats["groups_dropped"] == 2                # b (all 1) and d (one usable episode)
    assert dropped.stats["episodes_dropped"] == 4
    assert {e.group_id for e in dropped.kept} == {"a", "c"}
    assert len(dropped.kept) == 6


def test_an_episode_without_group_is_its_own_group():
    rng = random.Random(1)
    eps = [make_traj(rng, "", 0, 1.0), make_traj(rng, "", 0, 0.0)]
    out = grpo_advantages(eps)
    assert out.stats["groups"] == 2 and list(out.values.values()) == [0.0, 0.0]


def test_rl_batch_keeps_failures_out_of_the_loss_and_reports_them():
    rng = random.Random(2)
    eps = ([make_traj(rng, "g", i, r, version=3) for i, r in enumerate([1.0, 0.0, 1.0])]
           + [make_traj(rng, "g", 3, None, finish="env_error", version=1)])
    b = rl_batch(eps, current_version=4)
    assert len(b.samples) == 3 and b.kind == "rl"
    assert b.stats["infra_errors"] == 1
    assert b.stats["reward/train"] == pytest.approx(2 / 3) and b.stats["pass_rate/train"] == pytest.approx(2 / 3)
    assert b.stats["staleness/max"] == 3 and b.stats["staleness/mean"] == pytest.approx((1 + 1 + 1 + 3) / 4)
    m, s = 2 / 3, math.sqrt((2 * (1 / 3) ** 2 + (2 / 3) ** 2) / 2)
    assert [x.advantage for x in b.samples] == pytest.approx([(1 - m) / s, (0 - m) / s, (1 - m) / s], abs=1e-5)
