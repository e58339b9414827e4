"""What an evaluation's numbers mean: mean@k and pass@k over tasks, with 95% intervals, and a paired RL gain.

Each evaluated task is sampled ``k`` times. ``mean@k`` is the mean over tasks of the fraction of a task's samples
that pass; ``pass@k`` the mean over tasks of "at least one of k passes" (the unbiased estimator of Chen et al. 2021
when a task has more samples than ``k``). Both get a percentile-bootstrap 95% interval over tasks (the tasks are the
sample: a new draw of tasks is what a reader's next run would see). The gain of RL is a *paired* difference: the same
tasks after RL minus after the warm start, bootstrapped over tasks, so the task-to-task spread cancels out. The
bootstrap generator is seeded, so a run's figures repeat. ``evaluate`` plays an evaluation on the workers it is
given (the loop's), and ``swe_iteration`` the run's SWE iteration.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from rollout.trajectory import Trajectory

if TYPE_CHECKING:
    from rollout.groups import GroupSpec
    from trainer.loop.config import RunConfig
    from trainer.loop.rollouts import Collected
    from trainer.loop.tasks import TaskRef
    from trainer.trackers import Tracker

BOOTSTRAP = 2000
LEVEL = 0.95


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that at least one of ``k`` samples drawn from ``n`` (``c`` of them passing) passes."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _interval(stats: np.ndarray) -> list[float]:
    lo, hi = np.quantile(stats, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    return [float(lo), float(hi)]


def _boot(values: np.ndarray, seed: int) -> list[float]:
    """The percentile-bootstrap interval of the mean of ``values`` (one per task)."""
    if len(values) < 2:
        return [float(values.mean()), float(values.mean())] if len(values) else [math.nan, math.nan]
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(values), size=(BOOTSTRAP, len(values)))
    return _interval(values[picks].mean(axis=1))


def summarize(per_task: Mapping[str, Sequence[bool]], k: int, seed: int = 0) -> dict[str, Any]:
    """mean@k and pass@k of ``{task: [passed, ...]}`` with their 95% intervals (tasks with no scored sample are
    left out, and counted)."""
    scored = {t: list(per_task[t]) for t in sorted(per_task) if per_task[t]}  # in one order: the bootstrap repeats
    means = np.array([sum(v) / len(v) for v in scored.values()], dtype=float)
    kk = min([k, *(len(v) for v in scored.values())]) if scored else k
    passes = np.array([pass_at_k(len(v), sum(v), kk) for v in scored.values()], dtype=float)
    return {"tasks": len(scored), "unscored_tasks": len(per_task) - len(scored), "k": kk,
            "samples": int(sum(len(v) for v in scored.values())),
            "mean_at_k": float(means.mean()) if len(means) else math.nan, "mean_at_k_ci": _boot(means, seed),
            "pass_at_k": float(passes.mean()) if len(passes) else math.nan, "pass_at_k_ci": _boot(passes, seed + 1)}


def paired_gain(before: Mapping[str, Sequence[bool]], after: Mapping[str, Sequence[bool]],
                seed: int = 0) -> dict[str, Any]:
    """mean@k after minus before on the tasks both scored, with a paired-bootstrap 95% interval."""
    common = sorted(t for t in before if before[t] and after.get(t))
    diff = np.array([sum(after[t]) / len(after[t]) - sum(before[t]) / len(before[t]) for t in common], dtype=float)
    return {"tasks": len(common), "gain": float(diff.mean()) if len(diff) else math.nan,
            "gain_ci": _boot(diff, seed)}


def per_task_passes(trajectories: Sequence[Trajectory], threshold: float) -> dict[str, list[bool]]:
    """``{task_id: [passed, ...]}`` of evaluation trajectories (an unscored one, an infra error, adds nothing)."""
    out: dict[str, list[bool]] = {}
    for t in trajectories:
        got = out.setdefault(str(t.task_id), [])
        if t.reward is not None and not t.infra_error:
            got.append(t.reward >= threshold)
    return out


def tool_use(trajectories: Sequence[Trajectory], threshold: float) -> dict[str, Any]:
    """What the policy did, beside whether it passed: the share of episodes that called a tool before answering
    (on Lookup-v0: looked before answering, what RL should teach), and the pass rate of those that did and did not."""
    used = [t for t in trajectories if t.tool_calls > 0]
    not_used = [t for t in trajectories if t.tool_calls == 0]

    def rate(ts: Sequence[Trajectory]) -> float:
        return sum(1 for t in ts if t.reward is not None and t.reward >= threshold) / len(ts) if ts else math.nan
    return {"used_tools": len(used) / len(trajectories) if trajectories else math.nan,
            "pass_rate_with_tools": rate(used), "pass_rate_without_tools": rate(not_used),
            "malformed_calls": sum(t.malformed_calls for t in trajectories)}


def swe_stats(groups: int, trajectories: Sequence[Trajectory]) -> dict[str, Any]:
    """What the SWE iteration's episodes (of ``groups`` groups) show: the share resolved, the mean reward, how they
    finished, how many were graded, the groups' ids and whether the first group's episodes share their prompt (were
    forked from one state)."""
    from trainer.algorithm.batch import pass_rate

    trajs = list(trajectories)
    rate, reward, _ = pass_rate(trajs, 1.0)
    return {"groups": groups, "episodes": len(trajs), "resolved": rate, "reward_mean": reward,
            "finish_reasons": dict(Counter(t.finish_reason for t in trajs)), "graded": sum(1 for t in trajs if t.grade),
            "group_ids": sorted({t.group_id for t in trajs}),
            "shared_prompt": all(t.token_ids[:t.prompt_len] == trajs[0].token_ids[:trajs[0].prompt_len]
                                 for t in trajs if t.group_id == trajs[0].group_id and t.prompt_len) if trajs else None}


async def swe_iteration(cfg: RunConfig, records: Sequence[dict[str, Any]], group: Callable[[TaskRef], GroupSpec],
                        play: Callable[[list[GroupSpec]], Awaitable[Collected]],
                        train: Callable[[Collected], Awaitable[tuple[dict[str, Any], int]]],
                        say: Callable[[str], None]) -> dict[str, Any]:
    """The SWE iteration (``swe.*``): a group of each task of ``records`` (``group(ref)``, forked from one state),
    played by ``play`` and graded by the SWE grader, then, with ``swe.train``, one step on them (``train`` returns
    the step's metrics row and the weight version after it). Returns ``swe_stats`` with ``time_s``."""
    say(f"SWE iteration: {len(records)} group(s) of {cfg.swe.group_size} on {cfg.swe.env_id} "
        f"({', '.join(str(r.get('instance_id')) for r in records)}), {cfg.swe.max_turns} turns each")
    from trainer.loop.tasks import TaskRef

    t0 = time.perf_counter()
    got = await play([group(TaskRef(r, cfg.seed + i)) for i, r in enumerate(records)])
    trajs = got.trajectories
    res = swe_stats(len(got.groups), trajs)
    if cfg.swe.train and trajs:
        row, version = await train(got)
        res["trained"] = "swe/loss" in row
        res["weight_version_after"] = version
    res["time_s"] = time.perf_counter() - t0
    say(f"SWE iteration: resolved {res['resolved']:.2f}, reward {res['reward_mean']:.3f}, graded "
        f"{res['graded']}/{len(trajs)}, finish {res['finish_reasons']}")
    return res


async def evaluate(refs: Sequence[TaskRef], group: Callable[[TaskRef], GroupSpec],
                   play: Callable[[list[GroupSpec]], Awaitable[Collected]], cfg: RunConfig, *, tag: str, split: str,
                   version: int, iteration: int, say: Callable[[str], None],
                   tracker: Tracker | None = None) -> dict[str, Any]:
    """``eval.samples`` samples of each task of ``refs`` (of ``split``): ``group(ref)`` is a task's group (forked
    from one reset), ``play`` plays groups (``Loop.collect``) with the current weights, of logical ``version``
    after ``iteration`` iterations. Returns mean@k and pass@k with 95% intervals, the tool use and ``time_s`` (the
    caller keeps it); ``say`` reports it, and ``tracker`` gets a sample table."""
    t0 = time.perf_counter()
    got = await play([group(r) for r in refs])
    trajs = got.trajectories
    per_task = per_task_passes(trajs, cfg.rl.pass_threshold)
    stats = summarize(per_task, cfg.eval.samples, seed=cfg.seed)
    from trainer.algorithm.batch import pass_rate

    _, reward, scored = pass_rate(trajs, cfg.rl.pass_threshold)
    elapsed = time.perf_counter() - t0
    res: dict[str, Any] = {"tag": tag, "split": split, **stats, "pass_rate": stats["mean_at_k"],
           "reward_mean": reward, "episodes": len(trajs),
           "passed": sum(1 for t in trajs if t.reward is not None and t.reward >= cfg.rl.pass_threshold),
           "infra_errors": len(trajs) - scored, "weight_version": version,
           "iteration": iteration, "time_s": elapsed,
           "finish_reasons": dict(Counter(t.finish_reason for t in trajs)), **tool_use(trajs, cfg.rl.pass_threshold),
           "per_task": per_task}
    if tracker is not None:   # a sample table per evaluation
        from trainer.trackers import episode_table

        tracker.table(iteration, f"samples/{split}", *episode_table(trajs))
    lo, hi = stats["mean_at_k_ci"]
    say(f"{split} eval ({tag}): mean@{stats['k']} {stats['mean_at_k']:.3f} [{lo:.3f}, {hi:.3f}], "
        f"pass@{stats['k']} {stats['pass_at_k']:.3f} on {stats['tasks']} tasks, weights v{version}")
    return res
