"""``Loop``: one ``agentenv train`` run. Its parts are typed at the top of the class; what a run does, in order, and
how bounded staleness and partial rollouts work, is the package's header (trainer/loop/__init__.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from rich.console import Console

from agentenv.terminal import markup
from rollout.agent import AgentConfig
from rollout.groups import GroupSpec
from rollout.raycluster import init_ray
from trainer.algorithm.batch import filter_stale
from trainer.loop import evaluation, parts, report
from trainer.loop.config import RunConfig, describe
from trainer.loop.partial import PAUSED_FILE, DataState, PartialRollouts, collect
from trainer.loop.rollouts import Collected, LoopRollout
from trainer.loop.services import PolicyServer, check_endpoint, preflight, read_token, swe_task_records
from trainer.loop.tasks import TaskRef, TaskSource
from trainer.metrics import MetricsLog, Progress
from trainer.trackers import for_run

log = logging.getLogger(__name__)


# --- the loop -----------------------------------------------------------------------------------------------------


class Loop:
    """One ``agentenv train`` run (trainer/loop/__init__.py). Its parts, in the order they are made: the task sources
    and the paused groups with the loop, the others by ``run`` from the settings (trainer/loop/parts.py; None until
    then, and a unit test sets its own)."""

    # -- the settings --
    cfg: RunConfig
    resume: bool                              # continue the run folder's newest checkpoint (--resume)
    dir: Path                                 # the run folder (cfg.run_dir)
    console: Console
    # -- the parts --
    train_src: TaskSource                     # the training tasks (trainer/loop/tasks.py)
    heldout_src: TaskSource                   # the tasks of the evaluations before and after RL
    validation_src: TaskSource | None         # the tasks of the evaluations every eval.every iterations
    partial: PartialRollouts                  # the paused groups between batches (trainer/loop/partial.py)
    trainer: parts.Steps | None = None        # trainer.train.Trainer
    server: PolicyServer | None = None        # the policy server this run started (None: policy.url's)
    sync: parts.Pushes | None = None          # trainer.distributed.sync.WeightSync, to the policy endpoint
    rollout: LoopRollout | None = None        # the rollout workers (trainer/loop/rollouts.py)
    metrics: MetricsLog | None = None         # metrics.jsonl, and a tracker (trainer/trackers.py)
    bar: Progress | None = None               # the live display, during the iterations
    # -- the policy's weights --
    url: str                                  # the policy endpoint, and its token
    token: str | None
    start_weights: str | None = None          # what the policy starts from (the warm start's, a resume's)
    version: int = 0                          # the policy server's weight version now
    version_base: int = 0                     # trainer steps taken before this server's version 0 (resume)
    # -- the data position (a checkpoint's: trainer/loop/partial.py, DataState) --
    iteration: int = 0                        # RL iterations done
    task_cursor: int                          # training tasks handed out (demonstrations first)
    trained_cursor: int | None = None         # the task cursor as the newest trained batch left it
    group_seq: int = 0                        # groups made (their ids stay unique)
    counts: Counter[str]                      # what was dropped, kept, left (shared with ``partial``)
    evals: dict[str, dict[str, Any]]          # the evaluations by tag (before, iter<N>, after)
    # -- the record --
    times: report.Times                       # seconds per phase
    summary: dict[str, Any]                   # summary.json
    on_sigterm: Callable[[int, FrameType | None], Any] | None = None   # the command's (installed again after Ray)
    _own_ray: bool = False                    # this run joined Ray for its trainer's ranks (trainer.placement "ray")

    def __init__(self, cfg: RunConfig, *, resume: bool = False, console: Console | None = None) -> None:
        self.cfg, self.resume, self.dir = cfg, resume, cfg.run_dir
        self.console = console or Console()
        self.times, self.summary = report.Times(), {"name": cfg.name, "seed": cfg.seed}
        self.url, self.token = cfg.policy.url, read_token(cfg.policy.token_file)
        self.task_cursor = cfg.sft.demonstrations if cfg.sft.enabled else 0
        self.counts = Counter()
        remote = cfg.ray.env_url or ("fleet" if cfg.ray.env_fleet else "")   # paused groups (remote: swept)
        self.partial = PartialRollouts(cfg.rl.max_resumes, remote, counts=self.counts)
        self.evals = {}
        self.train_src = TaskSource(cfg.env.train_tasks, cfg.seed)
        self.heldout_src = TaskSource(cfg.env.heldout_tasks, cfg.seed)
        self.validation_src = TaskSource(cfg.env.validation_tasks, cfg.seed) if cfg.env.validation_tasks.strip() \
            else None

    # -- output --
    def say(self, text: str) -> None:
        """A progress line; its text (task ids, an endpoint's answer) is printed as text (``agentenv.terminal``)."""
        (self.bar.console if self.bar is not None and self.bar.enabled else self.console).log(markup(text))

    # -- the run --
    def run(self) -> dict[str, Any]:
        """The whole run; returns the summary (also ``summary.json``)."""
        t0 = time.perf_counter()
        checked = preflight(self.cfg, resume=self.resume)
        self.say(f"pre-flight: {', '.join(checked)} ok")
        if self.cfg.trainer.threads > 0:
            import torch
            torch.set_num_threads(self.cfg.trainer.threads)
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "config.toml").write_text(describe(self.cfg))
        try:
            if self.cfg.trainer.placement == "ray" and self.cfg.trainer.world > 1:  # the ranks are Ray actors
                self._own_ray = init_ray(self.cfg.ray.address or None)
            weights = self._warm_start()
            self.start_trainer(weights)
            self.start_policy()
            asyncio.run(self._rl())
        finally:
            self._close()
            self.times["total"] = time.perf_counter() - t0
        self._finish()
        return self.summary

    def _close(self) -> None:
        if self.trainer is not None:
            with contextlib.suppress(Exception):
                self.trainer.close()
        if self.sync is not None:
            with contextlib.suppress(Exception):
                self.sync.close()
        if self.server is not None:
            self.say("stopping the policy server")
            self.server.stop()
        if self._own_ray:
            import ray

            ray.shutdown()

    # -- 1. SFT warm start --
    def _warm_start(self) -> str | None:
        cfg = self.cfg
        if not cfg.sft.enabled:
            return cfg.sft.init_weights or None
        from trainer.sft import warm_start

        weights, self.summary["sft"] = warm_start(cfg, self.dir, self.train_src.values(cfg.sft.demonstrations),
                                                  resume=self.resume, progress=self._progress_on(), say=self.say,
                                                  add_time=self.times.add)
        return weights

    def _progress_on(self) -> bool | None:
        return {"auto": None, "on": True, "off": False}[self.cfg.progress]

    # -- 2. trainer and policy server --
    def start_trainer(self, weights: str | None) -> None:
        """The trainer, on ``weights`` (None: the seed's); with ``--resume``, at the newest checkpoint."""
        with self.times.timed("trainer_start"):
            self.trainer = trainer = parts.build_trainer(self.cfg, weights)
        self.start_weights = weights
        meta = trainer.resume(self.dir / "checkpoints") if self.resume else None
        if meta is not None:
            from trainer.checkpoint import latest

            self.restore_data(meta.get("data", {}), latest(self.dir / "checkpoints"))
            self.version_base = trainer.step_count
            path = self.dir / "weights" / f"resume-{trainer.step_count:08d}"
            self.start_weights = str(trainer.save_weights(path))
            self.say(f"resumed at iteration {self.iteration} (trainer step {trainer.step_count})")

    def start_policy(self) -> None:
        """The policy server (or ``policy.url``'s), checked, and the weight sync to it."""
        cfg = self.cfg
        if not cfg.policy.url:
            self.server = PolicyServer(cfg, self.dir, self.start_weights)
            self.say(f"starting the policy server: {' '.join(self.server.command()[1:])}")
            with self.times.timed("policy_start"):
                self.server.start()
                self.server.wait(cfg.policy.startup_timeout_s)
            self.url, self.token = self.server.url, self.server.token
        with self.times.timed("policy_check"):
            info = check_endpoint(self.url, self.token, cfg.policy.model, cfg.policy.verify)
        self.say(f"policy endpoint {self.url}: {json.dumps(info)[:200]}")
        self.sync = sync = parts.build_weight_sync(cfg, self.url, self.token, self.dir)
        if isinstance(info.get("weight_version"), int):
            self.version = int(info["weight_version"])
        if cfg.policy.url and self.start_weights and cfg.policy.kind == "agentenv":
            self.say(f"loading {self.start_weights} into {cfg.policy.url}")
            steps = parts.started(self.trainer, "trainer").step_count
            with self.times.timed("sync"):   # an existing server of ours: give it the trainer's starting weights
                res = sync.load(self.start_weights, steps)
            self.version = res.version if res.version is not None else self.version
            self.version_base = steps - self.version
        elif cfg.policy.url and cfg.policy.kind != "agentenv":
            # its pushes carry the trainer's step as their version (policy/reload.py): count on from there, so that a
            # resumed run's first push is one version on, not a jump that makes every turn in flight stale
            self.version = parts.started(self.trainer, "trainer").step_count
            self.say(f"{cfg.policy.url} ({cfg.policy.kind}) keeps the weights it serves until the first push")

    @property
    def logical_version(self) -> int:
        return self.version_base + self.version

    # -- 3. rollouts --
    def agent_config(self, phase: str) -> AgentConfig:
        return parts.agent_config(self.cfg, phase)

    def _spec(self, ref: TaskRef, phase: str, group_size: int, env_id: str | None = None) -> GroupSpec:
        self.group_seq += 1
        gid = f"{self.cfg.name}-{phase}-i{self.iteration:04d}-g{self.group_seq:05d}"
        job = parts.job(self.cfg, ref, phase, self.iteration, self.version, env_id)
        return GroupSpec(gid, job, ref.task_id, group_size, ref.seed, self.group_seq)

    async def collect(self, specs: list[GroupSpec], need: int | None = None) -> Collected:
        """Play ``specs`` on the workers; with ``need``, stop once ``need`` groups are complete and pause the rest
        (partial rollouts, trainer/loop/partial.py). Paused groups go to ``self.partial``."""
        return await collect(parts.started(self.rollout, "rollout"), self.partial, specs, need, version=lambda: self.version)

    async def rollout_batch(self) -> Collected:
        """One iteration's groups: paused ones resumed first, then new ones; partial rollouts cut the tail. The batch
        records the task cursor, the groups paused at its end and the env states it resumed from (for the
        checkpoint of its step)."""
        rl = self.cfg.rl
        resumed, consumed = self.partial.resume_specs(self.version, self.iteration) if rl.partial_rollouts \
            else ([], [])
        launch = rl.groups_per_iteration + (rl.extra_groups if rl.partial_rollouts else 0)
        specs = resumed + self._train_specs(max(0, launch - len(resumed)))
        cursor = self.task_cursor
        got = await self.collect(specs, rl.groups_per_iteration if rl.partial_rollouts else None)
        got.cursor, got.consumed, got.pending = cursor, consumed, self.partial.dump()
        return got

    def _train_specs(self, n_new: int) -> list[GroupSpec]:
        specs = []
        for _ in range(n_new):
            ref = self.train_src.at(self.task_cursor)
            self.task_cursor += 1
            specs.append(self._spec(ref, "train", self.cfg.rl.group_size))
        return specs

    # -- 4. evaluation --
    async def evaluate(self, tag: str, split: str = "heldout") -> dict[str, Any]:
        """``eval.samples`` samples of each of the first ``eval.episodes`` tasks of ``split`` (trainer/loop/evaluation.py),
        kept in ``evals[tag]``."""
        cfg = self.cfg
        src = self.heldout_src if split == "heldout" else self.validation_src
        assert src is not None, "validation evaluations need env.validation_tasks (checked by validate)"
        res = await evaluation.evaluate(src.first(cfg.eval.episodes), lambda r: self._spec(r, "eval", cfg.eval.samples),
                                        self.collect, cfg, tag=tag, split=split, version=self.logical_version,
                                        iteration=self.iteration, say=self.say,
                                        tracker=self.metrics.tracker if self.metrics is not None else None)
        self.times.add("eval", res["time_s"])
        self.evals[tag] = res
        return res

    # -- 5. the iterations --
    async def _rl(self) -> None:
        cfg = self.cfg
        self.rollout = rollout = parts.build_rollout(cfg, self.url, self.token, self.dir)
        rollout.keep_snapshots = set(self.partial.referenced)   # a resumed checkpoint's paused episodes
        self.metrics = metrics = MetricsLog(self.dir / "metrics.jsonl",
                                            resume_step=self.iteration if self.resume else None,
                                            tracker=for_run(cfg, self.dir))
        try:
            with self.times.timed("workers_start"):
                await rollout.start()
            if self.on_sigterm is not None:   # Ray's driver installs its own SIGTERM handler: ours again
                import signal
                signal.signal(signal.SIGTERM, self.on_sigterm)
            self.say(f"rollout workers: {cfg.ray.workers} ({'Ray at ' + cfg.ray.address if cfg.ray.address else 'local Ray' if cfg.ray.workers else 'in-process'})")
            if cfg.eval.enabled and "before" not in self.evals:
                res = await self.evaluate("before")
                metrics.write(self.iteration, {**report.eval_row(res), "eval": "before"})
            await self.iterations()
            self.partial.finish()    # partial episodes the last iteration left: kept for --resume or dropped, counted
            if cfg.eval.enabled and cfg.rl.iterations > 0:
                res = await self.evaluate("after")
                metrics.write(self.iteration, {**report.eval_row(res), "eval": "after"})
            if cfg.swe.enabled:
                await self._swe()
        finally:
            with contextlib.suppress(Exception):
                await rollout.aclose()
            self.summary["rollout"] = rollout.summary()
            metrics.close()

    async def iterations(self) -> None:
        """The RL iterations, synchronous (max_staleness 0) or with a producer ahead of the trainer."""
        from trainer.loop import schedule

        with Progress(self.cfg.rl.iterations, "GRPO", enabled=self._progress_on()) as bar:
            self.bar = bar
            bar.update(self.iteration, {})
            try:
                await schedule.run(self.cfg.rl.iterations, self.cfg.rl.max_staleness, lambda: self.iteration,
                                   lambda: self.version, self.rollout_batch,
                                   lambda batch, v: self.train_iteration(batch, produced_at=v))
            finally:
                self.bar = None

    async def train_iteration(self, got: Collected, produced_at: int, phase: str = "train") -> dict[str, Any]:
        """One step on the batch ``got`` (played from weight version ``produced_at``): the staleness filter,
        advantages, the step, the push, a checkpoint, the metrics row (returned), an evaluation every
        ``eval.every`` iterations."""
        from trainer.algorithm.advantages import AdvantageConfig
        from trainer.algorithm.batch import rl_batch

        cfg = self.cfg
        trainer, sync = parts.started(self.trainer, "trainer"), parts.started(self.sync, "weight sync")
        rollout, metrics = parts.started(self.rollout, "rollout"), parts.started(self.metrics, "metrics")
        trajs = got.trajectories
        current = self.version
        kept, dropped = filter_stale(trajs, current, cfg.rl.max_staleness)
        self.counts["stale_dropped"] += len(dropped)
        adv = AdvantageConfig(cfg.rl.baseline, cfg.rl.std_normalize, drop_all_equal=cfg.rl.drop_all_equal)  # type: ignore[arg-type]
        batch = rl_batch(kept, adv, current_version=current, pass_threshold=cfg.rl.pass_threshold,
                         branches=got.branches)
        m = report.batch_row(batch.stats, got, len(dropped), cfg, self.version_base + produced_at)
        if batch.samples:
            t0 = time.perf_counter()
            m.update(await asyncio.to_thread(trainer.step, batch))
            self.times.add("train", time.perf_counter() - t0)
            t0 = time.perf_counter()
            res = await asyncio.to_thread(sync.push, trainer)
            self.version = res.version if res.version is not None else self.version + 1
            await rollout.set_version(self.version)   # turns the server does not version are stamped with it
            m.update(res.metrics())
            self.times.add("sync", time.perf_counter() - t0)
        else:
            self.counts["empty_batches"] += 1
            m.update({"time/train": 0.0, "time/sync": 0.0})
        self.times.add("rollout_env", m["time/env"])
        self.times.add("rollout_policy", m["time/policy"])
        if phase == "train":
            self.iteration += 1
        m["version"] = float(self.logical_version)
        m["iteration"] = float(self.iteration)
        every = cfg.eval.every
        if phase == "train" and cfg.eval.enabled and every > 0 and self.iteration % every == 0 \
                and self.iteration < cfg.rl.iterations:
            m.update(report.eval_row(await self.evaluate(f"iter{self.iteration}", split="validation")))
        last = self.iteration >= cfg.rl.iterations or phase != "train"
        if got.cursor is not None:
            self.trained_cursor = got.cursor
        checkpointed = False
        if cfg.rl.ckpt_every > 0 and (self.iteration % cfg.rl.ckpt_every == 0 or last) and batch.samples:
            t0 = time.perf_counter()
            files = {PAUSED_FILE: got.pending} if got.pending is not None else None
            await asyncio.to_thread(trainer.checkpoint, self.dir / "checkpoints", self._data_state().meta(),
                                    cfg.rl.keep_checkpoints, files=files)
            checkpointed = True
            self.times.add("checkpoint", time.perf_counter() - t0)
        rollout.keep_snapshots = set(self.partial.trained(got.consumed, checkpointed, got.pending,
                                                          cfg.rl.ckpt_every > 0))
        step = self.iteration if phase == "train" else self.iteration + 1
        row = metrics.write(step, {f"{phase}/{k}" if phase != "train" else k: v for k, v in m.items()})
        label = f"iter {self.iteration}/{cfg.rl.iterations}" if phase == "train" else phase.upper()
        self.say(report.iteration_line(label, m, self.logical_version))
        if self.bar is not None and phase == "train":
            self.bar.update(self.iteration, m)
        return row

    def _data_state(self) -> DataState:
        cursor = self.task_cursor if self.trained_cursor is None else self.trained_cursor
        return DataState(self.iteration, cursor, self.group_seq, dict(self.counts), self.evals, self.logical_version)

    def restore_data(self, data: dict[str, Any], folder: Path | None) -> None:
        """``--resume``: the data position ``data`` (a checkpoint's ``DataState``) and the paused groups of the
        checkpoint ``folder``."""
        state = DataState.read(data, self.iteration)
        self.iteration, self.task_cursor, self.group_seq = state.iteration, state.task_cursor, state.group_seq
        self.counts.update(state.counts)
        self.evals = state.evals
        if folder is not None and self.partial.restore(folder):
            self.say(f"resumed {len(self.partial.groups)} paused group(s) from {folder}")
        if self.rollout is not None:
            self.rollout.keep_snapshots = set(self.partial.referenced)

    # -- 6. one SWE iteration --
    async def _swe(self) -> None:
        cfg = self.cfg

        async def train(got: Collected) -> tuple[dict[str, Any], int]:
            return await self.train_iteration(got, produced_at=self.version, phase="swe"), self.logical_version

        self.summary["swe"] = res = await evaluation.swe_iteration(
            cfg, swe_task_records(cfg), lambda ref: self._spec(ref, "swe", cfg.swe.group_size, cfg.swe.env_id),
            self.collect, train, self.say)
        self.times.add("swe", res["time_s"])

    # -- 7. the summary --
    def _finish(self) -> None:
        self.summary.update(report.run_summary(self.cfg, self.dir, self.evals, iterations=self.iteration,
                                        version=self.logical_version, counts=self.counts, times=self.times))
        report.write_summary(self.cfg, self.dir, self.summary, self.evals)
        self.console.print(report.summary_table(self.summary))

    def plan(self) -> str:
        """What the run would do (``--dry-run``)."""
        return report.plan(self.cfg, self.dir, self.resume)
