"""What a run shows of itself: the plan (``--dry-run``), the reward figure and the summary table.

``reward.png`` is the figure a reader looks at first: training reward and pass rate per iteration, and the
held-out pass rate after the warm start, during and after RL on the same axis, so that a training curve that rises
without the held-out one is seen at once. The other metrics are plotted by ``trainer.metrics.plot``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from trainer.config import RunConfig
from trainer.metrics import save_figure
from trainer.services import PolicyServer


def plan(cfg: RunConfig, run_dir: Path, resume: bool = False) -> str:
    """What a run would do, step by step (``agentenv train --dry-run``)."""
    rl = cfg.rl
    server = PolicyServer(cfg, run_dir, str(run_dir / "sft" / "weights.safetensors") if cfg.sft.enabled
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
    lines.append(f"4. held-out eval before RL: {cfg.eval.episodes} tasks of {cfg.env.heldout_tasks}, "
                 f"temperature {cfg.eval.temperature:g}" if cfg.eval.enabled else "4. no held-out eval")
    mode = "synchronous (on-policy)" if rl.max_staleness == 0 else f"max staleness {rl.max_staleness}"
    partial = (f", partial rollouts (+{rl.extra_groups} groups, max {rl.max_resumes} resumes)"
               if rl.partial_rollouts else "")
    lines.append(f"5. GRPO: {rl.iterations} iterations x {rl.groups_per_iteration} groups x {rl.group_size} "
                 f"episodes of {cfg.env.train_tasks}, {mode}{partial}; lr {rl.lr:g}, clip "
                 f"[{rl.eps_low}, {rl.eps_high}], TIS {rl.tis_cap:g}, KL {rl.kl_coef:g}")
    if cfg.eval.enabled:
        lines.append("6. held-out eval after RL" + (f" (and every {cfg.eval.every} iterations)"
                                                    if cfg.eval.every else ""))
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
    for key, label in (("reward/train", "train reward"), ("pass_rate/train", "train pass rate")):
        xs, ys = series(key)
        if xs:
            ax.plot(xs, ys, marker=".", label=label)
    ev = sorted((v["iteration"], v["pass_rate"]) for v in evals.values()
                if isinstance(v.get("pass_rate"), int | float) and math.isfinite(v["pass_rate"]))
    if ev:
        ax.plot([e[0] for e in ev], [e[1] for e in ev], marker="o", linestyle="--", color="black",
                label="held-out pass rate")
    if not ax.lines:
        plt.close(fig)
        return None
    ax.set_xlabel("RL iteration (0: after the SFT warm start)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.legend(fontsize=8)
    return save_figure(fig, out)


def _fmt(v: Any, fmt: str = ".3f") -> str:
    return format(v, fmt) if isinstance(v, int | float) and math.isfinite(v) else "-"


def iteration_line(label: str, m: dict[str, Any], version: int) -> str:
    """One iteration's metrics as the line the run logs."""
    def f(k: str, fmt: str = ".3f") -> str:
        return _fmt(m.get(k), fmt)
    return (f"{label}: reward {f('reward/train')} pass {f('pass_rate/train')} | loss {f('loss', '.4f')} "
            f"entropy {f('entropy')} clip {f('clip_frac')} grad {f('grad_norm')} | staleness "
            f"{f('staleness/mean', '.2f')} dropped {int(m.get('staleness/dropped', 0))} paused "
            f"{int(m.get('partial/paused', 0))} | env {f('time/env', '.1f')}s policy {f('time/policy', '.1f')}s "
            f"train {f('time/train', '.1f')}s sync {f('time/sync', '.2f')}s | weights v{version}")


def summary_table(s: dict[str, Any]) -> Table:
    t = Table(title=f"agentenv train: {s.get('name')} (seed {s.get('seed')})", show_header=False)
    t.add_column("what", no_wrap=True)
    t.add_column("value")
    h = s.get("heldout", {})
    for tag, label in (("after_sft", "held-out pass rate after SFT (before RL)"), ("after_rl", "held-out pass "
                                                                                              "rate after RL")):
        e = h.get(tag)
        if e:
            t.add_row(label, f"{_fmt(e['pass_rate'])} ({e['passed']}/{e['episodes']}), reward "
                             f"{_fmt(e['reward_mean'])}, weights v{e['weight_version']}")
    for tag, e in (h.get("during") or {}).items():
        t.add_row(f"held-out pass rate at {tag}", f"{_fmt(e['pass_rate'])} ({e['passed']}/{e['episodes']})")
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
