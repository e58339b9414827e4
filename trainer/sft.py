"""SFT warm start: supervised fine-tuning on demonstration trajectories, in the same trajectory format.

The loss is the negative log-likelihood of the tokens the demonstrator generated (``loss_mask`` 1), averaged over
those tokens (token mean over the whole batch, like the policy loss):

    loss = - sum_t m_t * log pi_theta(y_t | y_<t) / sum_t m_t

Prompts, templates and tool outputs (mask 0) are context only. ``run_sft`` is a complete, resumable run: the data
order is a seeded permutation per epoch, and the position in it (epoch, index) is checkpointed with the model, so a
run killed at any point and resumed takes exactly the steps, on exactly the batches, that an uninterrupted run takes.
"""

from __future__ import annotations

import inspect
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainer.algorithm.batch import Batch, Sample
from trainer.metrics import MetricsLog, Progress, plot
from trainer.trackers import open_tracker

if TYPE_CHECKING:
    from trainer.loop.config import RunConfig
    from trainer.train import Trainer


def sft_samples(trajectories: Sequence[Any], min_reward: float | None = None) -> list[Sample]:
    """Demonstrations as samples: infrastructure failures left out, and (with ``min_reward``) episodes that scored
    less; samples without a generated token after the first position are skipped."""
    out = []
    for t in trajectories:
        if t.reward is None or getattr(t, "infra_error", False):
            continue
        if min_reward is not None and t.reward < min_reward:
            continue
        s = Sample.from_trajectory(t)
        if s.loss_tokens:
            out.append(s)
    return out


@dataclass
class DataCursor:
    """A position in an endless stream of epochs, each a seeded permutation of ``n`` items."""

    n: int
    seed: int = 0
    epoch: int = 0
    index: int = 0

    def order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def take(self, k: int) -> list[int]:
        """The next ``k`` items (crossing into the next epoch when this one runs out)."""
        if self.n == 0:
            raise ValueError("no data")
        out: list[int] = []
        while len(out) < k:
            order = self.order(self.epoch)
            need = k - len(out)
            out += order[self.index:self.index + need]
            self.index += need
            if self.index >= self.n:
                self.epoch, self.index = self.epoch + 1, 0
        return out

    def state(self) -> dict[str, int]:
        return {"n": self.n, "seed": self.seed, "epoch": self.epoch, "index": self.index}

    def load(self, state: dict[str, Any]) -> None:
        if state.get("n", self.n) != self.n:
            raise ValueError(f"the checkpoint's data has {state['n']} items, this run has {self.n}")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def run_sft(trainer: Trainer, samples: Sequence[Sample], *, steps: int, batch_size: int,
            out: str | os.PathLike[str], ckpt_every: int = 1, keep: int = 2, resume: bool = True, seed: int = 0,
            progress: bool | None = None, plot_every: int = 10, tracker: str = "") -> list[dict[str, Any]]:
    """Train ``steps`` SFT steps of ``batch_size`` samples; under ``out``: ``checkpoints/``, ``metrics.jsonl``,
    ``metrics.png`` (and the ``tracker``'s files: ``trainer.trackers``). With ``resume``, continue from the newest checkpoint. Returns the
    metrics rows of the steps this call ran."""
    out = Path(out)
    ckpt_dir = out / "checkpoints"
    cursor = DataCursor(len(samples), seed)
    meta = trainer.resume(ckpt_dir) if resume else None
    if meta is not None:
        cursor.load(meta["data"])
    log = MetricsLog(out / "metrics.jsonl", resume_step=trainer.step_count if meta is not None else None,
                     tracker=open_tracker(tracker, out, "sft", {"steps": steps, "batch_size": batch_size})
                     if tracker else None)
    rows = []
    with Progress(steps, "SFT", enabled=progress) as bar:
        bar.update(trainer.step_count, {})
        while trainer.step_count < steps:
            position = cursor.state()
            batch = Batch([samples[i] for i in cursor.take(batch_size)], "sft")
            m = trainer.step(batch)
            step = trainer.step_count
            m.update({"data/epoch": float(position["epoch"]), "data/index": float(position["index"])})
            rows.append(log.write(step, m))
            if ckpt_every > 0 and (step % ckpt_every == 0 or step == steps):
                trainer.checkpoint(ckpt_dir, cursor.state(), keep=keep)
            if plot_every > 0 and (step % plot_every == 0 or step == steps):
                plot(log.rows(), out / "metrics.png", title="SFT")
            bar.update(step, m)
    log.close()
    return rows


def warm_start(cfg: RunConfig, run_dir: Path, tasks: Sequence[Any], *, resume: bool = False,
               progress: bool | None = None, say: Callable[[str], None] = print,
               add_time: Callable[[str, float], None] | None = None) -> tuple[str, dict[str, Any]]:
    """The loop's warm start: the config's scripted expert plays ``tasks`` through the real env path into
    ``run_dir/demos``, then ``run_sft`` trains on them; returns the weights (``run_dir/sft/weights``, a Kimi checkpoint folder)
    and a summary. Weights already there are kept (a resumed run). It takes ``sft.threads`` torch threads, by
    default the cores no other process keeps busy (``idle_cores``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.sft.threads or idle_cores())
    say(f"warm start: {torch.get_num_threads()} torch thread(s)")
    try:
        return _warm_start(cfg, run_dir, tasks, resume=resume, progress=progress, say=say, add_time=add_time)
    finally:
        torch.set_num_threads(threads)


def _warm_start(cfg: RunConfig, run_dir: Path, tasks: Sequence[Any], *, resume: bool, progress: bool | None,
                say: Callable[[str], None], add_time: Callable[[str, float], None] | None) -> tuple[str, dict[str, Any]]:
    from agentenv.config import write_json
    from policy.config import model_config
    from rollout.trajectory import read
    from trainer.loop.tasks import resolve_function
    from trainer.train import TrainConfig, Trainer

    final = run_dir / "sft" / "weights"
    summary_file = run_dir / "sft" / "summary.json"
    if (final / "config.json").is_file():
        say(f"warm start: {final} exists, kept")
        return str(final), json.loads(summary_file.read_text()) if summary_file.is_file() else {}

    def timed(key: str, t0: float) -> None:
        if add_time is not None:
            add_time(key, time.perf_counter() - t0)

    demos, n = run_dir / "demos", cfg.sft.demonstrations
    if not (demos / "index.json").is_file():
        say(f"warm start: {n} demonstrations of a scripted expert on {cfg.env.id} ({cfg.sft.expert})")
        t0 = time.perf_counter()
        extra: dict[str, Any] = {"env_kwargs": dict(cfg.env.kwargs)} if cfg.env.kwargs else {}
        expert = resolve_function(cfg.sft.expert)
        if "seed" in inspect.signature(expert).parameters and "seed" not in cfg.sft.expert_kwargs:
            extra["seed"] = cfg.seed     # which demonstrations guess: from the run's seed, like everything else
        if cfg.env.harness and "harness_agent" in inspect.signature(expert).parameters:
            extra["harness_agent"] = dict(cfg.env.harness_agent)   # demonstrations in the trained harness's format
        expert(cfg.env.id, list(tasks), str(demos), n, **extra, **cfg.sft.expert_kwargs)
        timed("sft_demos", t0)
    trajs = sorted(read(demos), key=lambda t: (t.task_id, t.seed or 0))   # shards fill in finishing order
    samples = sft_samples(trajs)
    solved = sum(1 for t in trajs if t.reward is not None and t.reward >= cfg.rl.pass_threshold)
    if not samples:
        raise RuntimeError(f"the expert wrote no usable demonstration in {demos} (its demos.json may say why: "
                           "infra errors mean the sandboxes or the engine failed: is dockerd up? scripts/bootstrap.sh starts it)")
    say(f"warm start: SFT on {len(samples)} demonstrations ({solved}/{len(trajs)} solved), "
        f"{cfg.sft.steps} steps of {cfg.sft.batch_size}")
    tcfg = TrainConfig(lr=cfg.sft.lr, warmup_steps=cfg.sft.warmup_steps, seed=cfg.seed, dtype=cfg.trainer.dtype,
                       micro_batch_tokens=cfg.rl.micro_batch_tokens)
    t0 = time.perf_counter()
    with Trainer(model_config(cfg.policy.preset), tcfg, world=cfg.trainer.world, ep_size=cfg.trainer.ep,
                 weights=cfg.sft.init_weights or None, device=cfg.trainer.device,
                 placement=cfg.trainer.placement) as t:
        rows = run_sft(t, samples, steps=cfg.sft.steps, batch_size=cfg.sft.batch_size, out=run_dir / "sft",
                       ckpt_every=0, resume=resume, seed=cfg.seed, progress=progress,
                       plot_every=max(1, cfg.sft.steps))
        t.save_weights(final)
    timed("sft_train", t0)
    nll = [r["nll"] for r in rows if isinstance(r.get("nll"), int | float)]
    summary = {"demonstrations": len(trajs), "demonstrations_solved": solved, "samples": len(samples),
               "steps": cfg.sft.steps, "loss_first": rows[0].get("loss") if rows else None,
               "loss_last": rows[-1].get("loss") if rows else None, "nll_last": nll[-1] if nll else None}
    write_json(summary_file, summary, indent=1, default=str)
    return str(final), summary


def idle_cores(window: float = 1.0) -> int:
    """The cores no other process keeps busy now (measured over ``window`` seconds from /proc/stat, less this
    process's own time), at least one; where /proc/stat is missing, all of them."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

    def sample() -> tuple[float, float, float]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        busy = sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)   # all but idle and iowait
        own = os.times()
        return busy / os.sysconf("SC_CLK_TCK"), own.user + own.system, time.monotonic()

    try:
        b0, o0, t0 = sample()
        time.sleep(window)
        b1, o1, t1 = sample()
    except (OSError, ValueError):
        return cores
    others = max(0.0, (b1 - b0) - (o1 - o0)) / max(t1 - t0, 1e-6)
    return max(1, min(cores, round(cores - others)))
