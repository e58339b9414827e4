"""What a run shows of itself: the plan (``--dry-run``), a line and a metrics row per iteration and evaluation,
the seconds per phase, ``summary.json`` with its figures, and the summary table.

``reward.png`` is the figure a reader looks at first: the training pass rate per iteration (and the reward where it
is not the same curve), the validation mean@k during RL and the held-out mean@k after the warm start and after RL,
each with its 95% interval, on the same axis, so that a training curve that rises without the held-out one is seen
at once and a rise inside the intervals is not mistaken for one. The other metrics: ``trainer.metrics.plot``.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Table

from agentenv.config import write_json
from trainer.loop.config import RunConfig
from trainer.loop.services import PolicyServer
from trainer.loop.typed_toml import to_dict
from trainer.metrics import save_figure

if TYPE_CHECKING:
    from trainer.loop.rollouts import Collected


def plan(cfg: RunConfig, run_dir: Path, resume: bool = False) -> str:
    """What a run would do, step by step (``agentenv train --dry-run``)."""
    rl = cfg.rl
    server = PolicyServer(cfg, run_dir, str(run_dir / "sft" / "weights") if cfg.sft.enabled
                          else (cfg.sft.init_weights or None))
    lines = [f"run folder: {run_dir}" + (" (resumed)" if resume else ""),
             "1. pre-flight: policy endpoint / port, Ray, env, tasks, expert, SWE image (nothing starts before)"]
    if cfg.sft.enabled:
        lines.append(f"2. SFT warm start: {cfg.sft.demonstrations} demonstrations of {cfg.sft.expert} on "
                     f"{cfg.env.id}, {cfg.sft.steps} steps x {cfg.sft.batch_size} episodes, lr {cfg.sft.lr:g}")
    else:
        lines.append(f"2. no warm start (weights: {cfg.sft.init_weights or 'seed ' + str(cfg.seed)})")
    lines.append("3. policy: " + (f"existing endpoint {cfg.policy.url} ({cfg.policy.kind})" if cfg.policy.url
                                  else f"start `{' '.join(['agentenv', *server.command()[3:]])}`")
                 + f"; check: {cfg.policy.verify}")
    lines.append(f"   trainer: world {cfg.trainer.world}, EP {cfg.trainer.ep}, {cfg.trainer.device}; rollout "
                 f"workers: {cfg.ray.workers} on " + (f"Ray at {cfg.ray.address}" if cfg.ray.address
                                                     else "a local Ray" if cfg.ray.workers else "this process"))
    lines.append(f"4. held-out eval before RL: {cfg.eval.episodes} tasks of {cfg.env.heldout_tasks} x "
                 f"{cfg.eval.samples} samples, temperature {cfg.eval.temperature:g}" if cfg.eval.enabled
                 else "4. no held-out eval")
    mode = "synchronous (on-policy)" if rl.max_staleness == 0 else f"max staleness {rl.max_staleness}"
    partial = (f", partial rollouts (+{rl.extra_groups} groups, max {rl.max_resumes} resumes)"
               if rl.partial_rollouts else "")
    lines.append(f"5. GRPO: {rl.iterations} iterations x {rl.groups_per_iteration} groups x {rl.group_size} "
                 f"episodes of {cfg.env.train_tasks}, {mode}{partial}; lr {rl.lr:g}, clip "
                 f"[{rl.eps_low}, {rl.eps_high}], TIS {rl.tis_cap:g}, KL {rl.kl_coef:g}")
    if cfg.eval.enabled:
        lines.append("6. held-out eval after RL, and the paired gain" +
                     (f" (validation eval every {cfg.eval.every} iterations)" if cfg.eval.every else ""))
    if cfg.swe.enabled:
        lines.append(f"7. one SWE iteration: {cfg.swe.groups} group(s) x {cfg.swe.group_size} on {cfg.swe.env_id} "
                     f"({cfg.swe.tasks}), {cfg.swe.max_turns} turns, graded" +
                     (", one training step" if cfg.swe.train else ""))
    lines.append("8. summary: summary.json, reward.png, metrics.png, metrics.jsonl, checkpoints/, trajectories/")
    return "\n".join(lines)


def reward_plot(rows: Sequence[dict[str, Any]], evals: dict[str, dict[str, Any]], out: Path,
                title: str = "reward") -> Path | None:
    """Training reward and pass rate per iteration, and the held-out pass rate (after SFT, during, after RL)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(key: str) -> tuple[list[float], list[float]]:
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float) and r.get("eval") is None]
        return [p[0] for p in pts], [float(p[1]) for p in pts]

    fig, ax = plt.subplots(figsize=(7, 4))
    xs, pass_ys = series("pass_rate/train")
    if xs:
        ax.plot(xs, pass_ys, marker=".", label="train pass rate")
    rxs, rys = series("reward/train")
    if rxs and (rxs != xs or any(abs(a - b) > 1e-9 for a, b in zip(rys, pass_ys, strict=False))):
        ax.plot(rxs, rys, marker=".", alpha=0.6, label="train reward")
    for split, color, label in (("validation", "tab:green", "validation"), ("heldout", "black", "held-out")):
        ev = sorted((v["iteration"], v["mean_at_k"], *v["mean_at_k_ci"], v.get("k", 1)) for v in evals.values()
                    if v.get("split", "heldout") == split and isinstance(v.get("mean_at_k"), int | float)
                    and math.isfinite(v["mean_at_k"]))
        if ev:
            ax.errorbar([e[0] for e in ev], [e[1] for e in ev], yerr=[[e[1] - e[2] for e in ev],
                        [e[3] - e[1] for e in ev]], marker="o", linestyle="--", color=color, capsize=4,
                        label=f"{label} mean@{ev[0][4]} (95% CI)")
    if not ax.lines and not ax.containers:
        plt.close(fig)
        return None
    ax.set_xlabel("RL iteration (0: after the SFT warm start)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.legend(fontsize=8)
    return save_figure(fig, out)


def _fmt(v: Any, fmt: str = ".3f") -> str:
    return format(v, fmt) if isinstance(v, int | float) and math.isfinite(v) else "-"


def _ci(v: Any, ci: Sequence[Any], fmt: str = ".3f") -> str:
    return f"{_fmt(v, fmt)} [{_fmt(ci[0], fmt)}, {_fmt(ci[1], fmt)}]"


def iteration_line(label: str, m: dict[str, Any], version: int) -> str:
    """One iteration's metrics as the line the run logs."""
    def f(k: str, fmt: str = ".3f") -> str:
        return _fmt(m.get(k), fmt)
    return (f"{label}: reward {f('reward/train')} pass {f('pass_rate/train')} | loss {f('loss', '.4f')} "
            f"entropy {f('entropy')} clip {f('clip_frac')} grad {f('grad_norm')} | staleness "
            f"{f('staleness/mean', '.2f')} dropped {int(m.get('staleness/dropped', 0))} paused "
            f"{int(m.get('partial/paused', 0))} | env {f('time/env', '.1f')}s policy {f('time/policy', '.1f')}s "
            f"train {f('time/train', '.1f')}s sync {f('time/sync', '.2f')}s | weights v{version}")


class Times(dict[str, float]):
    """Seconds per phase of a run (``summary.json``'s ``times``): ``add`` sums into a phase, ``timed`` times a
    block."""

    def add(self, key: str, seconds: float) -> None:
        self[key] = self.get(key, 0.0) + seconds

    @contextlib.contextmanager
    def timed(self, key: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(key, time.perf_counter() - t0)


def batch_row(stats: Mapping[str, float], got: Collected, dropped: int, cfg: RunConfig, rollout_version: int
              ) -> dict[str, Any]:
    """The metrics row of a training batch before its step: the batch's ``stats``, the rollouts' time split, the
    staleness filter (``dropped`` trajectories), partial rollouts, the counts, the weight version the batch was
    played from, and the pass rate of every trajectory played."""
    from trainer.algorithm.batch import pass_rate

    m: dict[str, Any] = dict(stats)
    m.update(got.split())
    m.update({"staleness/bound": float(cfg.rl.max_staleness), "staleness/dropped": float(dropped),
              "partial/paused": float(got.paused), "partial/resumed": float(got.resumed),
              "groups": float(len(got.groups)), "episodes": float(len(got.trajectories)),
              "version/rollout": float(rollout_version)})
    m["pass_rate/train_all"], _, _ = pass_rate(got.trajectories, cfg.rl.pass_threshold)
    return m


def eval_row(res: dict[str, Any]) -> dict[str, Any]:
    """The metrics row of an evaluation: ``pass_rate/<split>`` is its mean@k, with the interval's ends."""
    split = res["split"]
    lo, hi = res["mean_at_k_ci"]
    return {f"pass_rate/{split}": res["mean_at_k"], f"pass_rate/{split}_lo": lo, f"pass_rate/{split}_hi": hi,
            f"pass_at_k/{split}": res["pass_at_k"], f"reward/{split}": res["reward_mean"]}


def run_summary(cfg: RunConfig, run_dir: Path, evals: Mapping[str, dict[str, Any]], *, iterations: int, version: int,
                counts: Mapping[str, int], times: Mapping[str, float]) -> dict[str, Any]:
    """What ``summary.json`` holds of a finished run beside its phases' own entries: the held-out evaluations after
    the warm start and after RL with their paired gain, the validation ones, counts, times and the settings."""
    from trainer.loop.evaluation import paired_gain

    before, after = evals.get("before"), evals.get("after")
    gain = paired_gain(before["per_task"], after["per_task"], seed=cfg.seed) if before and after else None
    return {
        "iterations": iterations, "weight_version": version,
        "heldout": {"after_sft": before, "after_rl": after, "gain": gain},
        "validation": {k: v for k, v in evals.items() if k not in ("before", "after")},
        "pass_rate_after_sft": before["mean_at_k"] if before else None,
        "pass_rate_after_sft_ci": before["mean_at_k_ci"] if before else None,
        "pass_rate_after_rl": after["mean_at_k"] if after else None,
        "pass_rate_after_rl_ci": after["mean_at_k_ci"] if after else None,
        "rl_gain": gain["gain"] if gain else None, "rl_gain_ci": gain["gain_ci"] if gain else None,
        "counts": dict(counts), "time_s": {k: round(v, 2) for k, v in sorted(times.items())},
        "config": to_dict(cfg), "run_dir": str(run_dir),
    }


def write_summary(cfg: RunConfig, run_dir: Path, summary: dict[str, Any], evals: dict[str, dict[str, Any]]) -> None:
    """``summary.json``, and the figures of ``metrics.jsonl``: ``metrics.png``, ``rl_health.png`` (trainer/algorithm/health.py)
    and ``reward.png`` (a figure that cannot be drawn is left out)."""
    from trainer.algorithm.health import plot_health
    from trainer.metrics import plot, read_jsonl

    rows = read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
    write_json(run_dir / "summary.json", summary, indent=1, default=str)
    with contextlib.suppress(Exception):
        plot(rows, run_dir / "metrics.png", title=f"{cfg.name}: RL metrics")
    with contextlib.suppress(Exception):
        plot_health(rows, run_dir / "rl_health.png", title=f"{cfg.name}: RL health")
    with contextlib.suppress(Exception):
        reward_plot(rows, evals, run_dir / "reward.png", title=f"{cfg.name} (seed {cfg.seed})")


def summary_table(s: dict[str, Any]) -> Table:
    t = Table(title=f"agentenv train: {s.get('name')} (seed {s.get('seed')})", show_header=False)
    t.add_column("what", no_wrap=True)
    t.add_column("value")
    h = s.get("heldout", {})
    for tag, label in (("after_sft", "held-out after SFT (before RL)"), ("after_rl", "held-out after RL")):
        e = h.get(tag)
        if e:
            t.add_row(label, f"mean@{e['k']} {_ci(e['mean_at_k'], e['mean_at_k_ci'])}, pass@{e['k']} "
                             f"{_ci(e['pass_at_k'], e['pass_at_k_ci'])} on {e['tasks']} tasks; used a tool "
                             f"{_fmt(e.get('used_tools'), '.2f')} (pass {_fmt(e.get('pass_rate_with_tools'), '.2f')}), "
                             f"without {_fmt(e.get('pass_rate_without_tools'), '.2f')}; weights v{e['weight_version']}")
    g = h.get("gain")
    if g:
        t.add_row("RL gain on held-out (paired)", f"{_ci(g['gain'], g['gain_ci'], '+.3f')} on {g['tasks']} tasks")
    for tag, e in (s.get("validation") or {}).items():
        t.add_row(f"validation at {tag}", f"mean@{e['k']} {_ci(e['mean_at_k'], e['mean_at_k_ci'])}")
    sft = s.get("sft") or {}
    if sft:
        t.add_row("SFT warm start", f"{sft.get('samples')} demonstrations ({sft.get('demonstrations_solved')} solved), "
                                    f"{sft.get('steps')} steps, loss {_fmt(sft.get('loss_first'))} -> "
                                    f"{_fmt(sft.get('loss_last'))}")
    t.add_row("RL iterations / weight version", f"{s.get('iterations')} / v{s.get('weight_version')}")
    c = s.get("counts") or {}
    t.add_row("stale dropped / partial groups dropped / empty batches",
              f"{c.get('stale_dropped', 0)} / {c.get('partial_dropped_groups', 0)} / {c.get('empty_batches', 0)}")
    swe = s.get("swe")
    if swe:
        t.add_row("SWE iteration", f"{swe['episodes']} episodes in {swe['groups']} group(s), resolved "
                                   f"{_fmt(swe['resolved'], '.2f')}, graded {swe['graded']}, finish "
                                   f"{swe['finish_reasons']}")
    tm = s.get("time_s") or {}
    order = ["sft_demos", "sft_train", "trainer_start", "policy_start", "policy_check", "workers_start", "eval",
             "rollout_env", "rollout_policy", "train", "sync", "checkpoint", "swe", "total"]
    t.add_row("time (s)", ", ".join(f"{k} {tm[k]:.1f}" for k in order if k in tm))
    t.add_row("run folder", f"{s.get('run_dir')} (reward.png, metrics.jsonl, checkpoints/, trajectories/)")
    return t
