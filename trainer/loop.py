"""The RL loop of ``agentenv train``: warm start, GRPO iterations with bounded staleness and partial rollouts,
held-out evaluation, one SWE iteration, and what a run leaves in ``runs/<name>/``.

A run, in order (``Loop.run``)::

    pre-flight (trainer/services.py)        every part reachable, before anything starts
    SFT warm start (trainer/sft.py)         scripted demonstrations through the real env path -> run_sft -> weights
    trainer + policy server                 Trainer(weights) in this process; `agentenv policy serve --ep 2` started
                                            with the same weights (or an existing endpoint), health-waited, checked
    rollout workers (trainer/rollouts.py)   a local Ray (or an existing cluster) with LoopWorkers; 0: in-process
    eval before RL                          held-out tasks (trainer/tasks.py), greedy unless eval.temperature
    iterations                              rollouts -> staleness filter -> rl_batch -> Trainer.step -> WeightSync.push
                                            -> checkpoint -> metrics (-> eval every N)
    eval after RL, SWE iteration            the same path on SWE-v0 tasks: a group forked from one state, SWE grading
    summary (trainer/report.py)             table, summary.json, reward.png, metrics.png

**Bounded staleness** (``rl.max_staleness = k``, trainer/schedule.py). ``k = 0`` is synchronous and on-policy: an iteration's rollouts
run under the current weights, then the step trains on them, strictly alternating. With ``k >= 1`` a producer task
collects batches ahead of the trainer — the batch of step ``t + 1`` (up to ``t + k``) is played while step ``t``
trains (the training step and the weight push run in a thread) — and puts them on a queue; each trajectory's
staleness is the current weight version minus the version of its oldest turn, and a trajectory more than ``k``
versions old (plus the versions that passed while it was paused, trainer/partial.py) is dropped and counted
(``staleness/dropped``), as AReaL and prime-rl do. Versions are the policy server's: each push bumps it, and every
turn records the version that generated it; for servers that report none (vLLM, SGLang) the loop's own count of
pushes is stamped on each turn instead (trainer/rollouts.py).

**Partial rollouts** (``rl.partial_rollouts``, trainer/rollouts.py). An iteration launches ``groups_per_iteration
+ extra_groups`` groups (groups paused earlier first) and its rollouts end as soon as ``groups_per_iteration`` are
complete: the episodes still running are paused after their current turn to the snapshot store and resumed in the
next iteration under the new weights, instead of holding the iteration back or being thrown away. A resumed
episode's turns keep their own weight versions; its staleness bound grows by the versions pushed while it was
paused; one paused more than ``max_resumes`` times is dropped (counted). Paused groups and the task cursor are part
of a checkpoint (trainer/partial.py).

Everything a run writes, under ``out_dir/name``: ``config.toml`` (the effective settings), ``demos/`` and ``sft/``
(the warm start: demonstrations, checkpoints, metrics, ``weights.safetensors``), ``trajectories/`` (every episode
of every phase as msgpack shards, ``metadata.phase`` = train / eval / swe), ``checkpoints/`` (trainer state per
iteration; ``--resume`` continues from the newest), ``weights/`` (the pushed safetensors), ``metrics.jsonl``,
``reward.png``, ``metrics.png``, ``rl_health.png`` (trainer/health.py), ``summary.json``, ``policy-server.log``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

from rich.console import Console

from agentenv.config import write_json
from agentenv.terminal import markup
from rollout.driver import init_ray
from trainer.batch import filter_stale, pass_rate
from trainer.config import RunConfig, describe
from trainer.partial import PAUSED_FILE, PartialRollouts
from trainer.report import iteration_line, plan, reward_plot, summary_table
from trainer.rollouts import Collected
from trainer.services import (
    PolicyServer,
    check_endpoint,
    preflight,
    read_token,
    swe_task_records,
)
from trainer.tasks import TaskRef, TaskSource, step_limit
from trainer.trackers import for_run
from trainer.typed_toml import to_dict

log = logging.getLogger(__name__)


# --- the loop -----------------------------------------------------------------------------------------------------


class Loop:
    """One ``agentenv train`` run (see the module docstring)."""

    def __init__(self, cfg: RunConfig, *, resume: bool = False, console: Console | None = None) -> None:
        self.cfg, self.resume = cfg, resume
        self.console = console or Console()
        self.dir = cfg.run_dir
        self.times: dict[str, float] = {}
        self.summary: dict[str, Any] = {"name": cfg.name, "seed": cfg.seed}
        self.server: PolicyServer | None = None
        self.trainer: Any = None
        self.sync: Any = None
        self.rollout: Any = None
        self.url, self.token = cfg.policy.url, read_token(cfg.policy.token_file)
        self.version = 0                      # the policy server's weight version now
        self.version_base = 0                 # trainer steps taken before this server's version 0 (resume)
        self.iteration = 0                    # RL iterations done
        self.task_cursor = cfg.sft.demonstrations if cfg.sft.enabled else 0   # training tasks handed out (demos first)
        self.counts: Counter[str] = Counter()
        remote = cfg.ray.env_url or ("fleet" if cfg.ray.env_fleet else "")   # paused groups (remote: swept)
        self.partial = PartialRollouts(cfg.rl.max_resumes, remote, counts=self.counts)
        self._own_ray = False  # this run joined Ray for its trainer's ranks (trainer.placement "ray")
        self.trained_cursor: int | None = None   # the task cursor as the newest trained batch left it
        self.evals: dict[str, dict[str, Any]] = {}
        self.train_src = TaskSource(cfg.env.train_tasks, cfg.seed)
        self.heldout_src = TaskSource(cfg.env.heldout_tasks, cfg.seed)
        self.validation_src = TaskSource(cfg.env.validation_tasks, cfg.seed) if cfg.env.validation_tasks.strip() \
            else None
        self._group_seq = 0
        self.metrics: Any = None
        self.bar: Any = None
        self.on_sigterm: Any = None           # the command's SIGTERM handler (installed again after Ray starts)

    # -- output --
    def say(self, text: str) -> None:
        """A progress line; its text (task ids, an endpoint's answer) is printed as text (``agentenv.terminal``)."""
        (self.bar.console if self.bar is not None and self.bar.enabled else self.console).log(markup(text))

    @contextlib.contextmanager
    def timed(self, key: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add_time(key, time.perf_counter() - t0)

    def add_time(self, key: str, seconds: float) -> None:
        self.times[key] = self.times.get(key, 0.0) + seconds

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
            self._start_trainer(weights)
            self._start_policy()
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
                                                  add_time=self.add_time)
        return weights

    def _progress_on(self) -> bool | None:
        return {"auto": None, "on": True, "off": False}[self.cfg.progress]

    # -- 2. trainer and policy server --
    def _start_trainer(self, weights: str | None) -> None:
        cfg = self.cfg
        from policy.config import model_config
        from trainer.losses import LossConfig
        from trainer.train import TrainConfig, Trainer

        loss = LossConfig(eps_low=cfg.rl.eps_low, eps_high=cfg.rl.eps_high,
                          tis_cap=cfg.rl.tis_cap if cfg.rl.tis_cap > 0 else None, kl_coef=cfg.rl.kl_coef,
                          temperature=cfg.env.temperature, dual_clip=cfg.rl.dual_clip)
        tcfg = TrainConfig(lr=cfg.rl.lr, warmup_steps=cfg.rl.warmup_steps, grad_clip=cfg.rl.grad_clip,
                           micro_batch_tokens=cfg.rl.micro_batch_tokens, mini_batches=cfg.rl.mini_batches,
                           routing_replay=cfg.rl.routing_replay, router_bias_rate=cfg.rl.router_bias_rate,
                           dtype=cfg.trainer.dtype, loss=loss, seed=cfg.seed)
        with self.timed("trainer_start"):
            self.trainer = Trainer(model_config(cfg.policy.preset), tcfg, world=cfg.trainer.world,
                                   ep_size=cfg.trainer.ep, weights=weights, device=cfg.trainer.device,
                                   placement=cfg.trainer.placement)
        self.start_weights = weights
        meta = self.trainer.resume(self.dir / "checkpoints") if self.resume else None
        if meta is not None:
            from trainer.checkpoint import latest
            from trainer.partial import restore_data

            restore_data(self, meta.get("data", {}), latest(self.dir / "checkpoints"))
            self.version_base = self.trainer.step_count
            path = self.dir / "weights" / f"resume-{self.trainer.step_count:08d}.safetensors"
            self.start_weights = str(self.trainer.save_weights(path))
            self.say(f"resumed at iteration {self.iteration} (trainer step {self.trainer.step_count})")

    def _start_policy(self) -> None:
        cfg = self.cfg
        from trainer.sync import Endpoint, WeightSync

        if not cfg.policy.url:
            self.server = PolicyServer(cfg, self.dir, self.start_weights)
            self.say(f"starting the policy server: {' '.join(self.server.command()[1:])}")
            with self.timed("policy_start"):
                self.server.start()
                self.server.wait(cfg.policy.startup_timeout_s)
            self.url, self.token = self.server.url, self.server.token
        with self.timed("policy_check"):
            info = check_endpoint(self.url, self.token, cfg.policy.model, cfg.policy.verify)
        self.say(f"policy endpoint {self.url}: {json.dumps(info)[:200]}")
        self.sync = WeightSync([Endpoint(self.url, cfg.policy.kind, self.token)], str(self.dir / "weights"),
                               mode=cfg.policy.sync_mode)
        if isinstance(info.get("weight_version"), int):
            self.version = int(info["weight_version"])
        if cfg.policy.url and self.start_weights and cfg.policy.kind == "agentenv":
            self.say(f"loading {self.start_weights} into {cfg.policy.url}")
            with self.timed("sync"):   # an existing server of ours: give it the trainer's starting weights
                res = self.sync.load(self.start_weights, self.trainer.step_count)
            self.version = res.version if res.version is not None else self.version
            self.version_base = self.trainer.step_count - self.version
        elif cfg.policy.url and cfg.policy.kind != "agentenv":
            self.say(f"{cfg.policy.url} ({cfg.policy.kind}) keeps the weights it serves until the first push")

    @property
    def logical_version(self) -> int:
        return self.version_base + self.version

    # -- 3. rollouts --
    def _rollout(self) -> Any:
        cfg = self.cfg
        from rollout.agent import AgentConfig
        from rollout.workers import RolloutConfig
        from trainer.rollouts import LoopRollout

        rc = RolloutConfig(cfg.env.id, self.url, policy_token=self.token, policy_model=cfg.policy.model or None,
                           agent=AgentConfig(), env_urls={"*": cfg.ray.env_url} if cfg.ray.env_url else None,
                           env_fleet=cfg.ray.env_fleet,
                           groups_per_worker=cfg.ray.groups_per_worker, worker_cpus=cfg.ray.worker_cpus,
                           memory_fork=cfg.ray.memory_fork, seed=cfg.seed)
        return LoopRollout(rc, workers=cfg.ray.workers, out=self.dir / "trajectories",
                           ray_address=cfg.ray.address or None, run_id=f"{cfg.name}-{time.strftime('%H%M%S')}")

    def agent_config(self, phase: str) -> Any:
        from rollout.agent import AgentConfig

        e = self.cfg.env
        route = self.cfg.rl.routing_replay and phase != "eval"   # trained episodes record every position's experts
        if phase == "swe":
            s = self.cfg.swe
            return AgentConfig(max_turns=s.max_turns, max_new_tokens=s.max_new_tokens,
                               max_total_tokens=s.max_total_tokens, context_limit=s.context_limit,
                               temperature=e.temperature, top_p=e.top_p, return_routed_experts=route)
        return AgentConfig(max_turns=e.max_turns, max_new_tokens=e.max_new_tokens, max_total_tokens=e.max_total_tokens,
                           context_limit=e.context_limit,
                           temperature=self.cfg.eval.temperature if phase == "eval" else e.temperature,
                           top_p=1.0 if phase == "eval" else e.top_p, system_prompt=e.system_prompt or None,
                           return_routed_experts=route)

    def _job(self, ref: TaskRef, phase: str, env_id: str | None = None) -> Any:
        from trainer.rollouts import Job

        env_id = env_id or self.cfg.env.id
        turns = self.cfg.swe.max_turns if phase == "swe" else self.cfg.env.max_turns
        kwargs = dict(self.cfg.swe.env_kwargs if phase == "swe" else self.cfg.env.kwargs)
        return Job(env_id, ref.task, {**step_limit(env_id, turns), **kwargs}, self.agent_config(phase), phase,
                   self.iteration, self.cfg.ray.memory_fork, weight_version=self.version)

    def _spec(self, ref: TaskRef, phase: str, group_size: int, env_id: str | None = None) -> Any:
        from rollout.groups import GroupSpec

        self._group_seq += 1
        gid = f"{self.cfg.name}-{phase}-i{self.iteration:04d}-g{self._group_seq:05d}"
        return GroupSpec(gid, self._job(ref, phase, env_id), ref.task_id, group_size, ref.seed, self._group_seq)

    async def collect(self, specs: list[Any], need: int | None = None) -> Collected:
        """Play ``specs`` on the workers; with ``need``, stop once ``need`` groups are complete and pause the rest
        (partial rollouts, trainer/partial.py). Paused groups go to ``self.partial``."""
        from trainer.partial import collect

        return await collect(self, specs, need)

    def _train_specs(self, n_new: int) -> list[Any]:
        specs = []
        for _ in range(n_new):
            ref = self.train_src.at(self.task_cursor)
            self.task_cursor += 1
            specs.append(self._spec(ref, "train", self.cfg.rl.group_size))
        return specs

    async def rollout_batch(self) -> Collected:
        """One iteration's groups: paused ones resumed first, then new ones; partial rollouts cut the tail."""
        from trainer.partial import rollout_batch

        return await rollout_batch(self)

    # -- 4. evaluation --
    async def evaluate(self, tag: str, split: str = "heldout") -> dict[str, Any]:
        """``eval.samples`` samples of each of the first ``eval.episodes`` tasks of ``split`` (trainer/evaluation.py)."""
        from trainer.evaluation import evaluate

        return await evaluate(self, tag, split)

    def _eval_row(self, res: dict[str, Any]) -> dict[str, Any]:
        """The metrics row of an evaluation: ``pass_rate/<split>`` is its mean@k, with the interval's ends."""
        split = res["split"]
        lo, hi = res["mean_at_k_ci"]
        return {f"pass_rate/{split}": res["mean_at_k"], f"pass_rate/{split}_lo": lo, f"pass_rate/{split}_hi": hi,
                f"pass_at_k/{split}": res["pass_at_k"], f"reward/{split}": res["reward_mean"]}

    # -- 5. the iterations --
    async def _rl(self) -> None:
        from trainer.metrics import MetricsLog

        cfg = self.cfg
        self.rollout = self._rollout()
        self.rollout.keep_snapshots = set(self.partial.referenced)   # a resumed checkpoint's paused episodes
        self.metrics = MetricsLog(self.dir / "metrics.jsonl", resume_step=self.iteration if self.resume else None,
                                  tracker=for_run(cfg, self.dir))
        try:
            with self.timed("workers_start"):
                await self.rollout.start()
            if self.on_sigterm is not None:   # Ray's driver installs its own SIGTERM handler: ours again
                import signal
                signal.signal(signal.SIGTERM, self.on_sigterm)
            self.say(f"rollout workers: {cfg.ray.workers} ({'Ray at ' + cfg.ray.address if cfg.ray.address else 'local Ray' if cfg.ray.workers else 'in-process'})")
            if cfg.eval.enabled and "before" not in self.evals:
                res = await self.evaluate("before")
                self.metrics.write(self.iteration, {**self._eval_row(res), "eval": "before"})
            await self.iterations()
            self.partial.finish()    # partial episodes the last iteration left: kept for --resume or dropped, counted
            if cfg.eval.enabled and cfg.rl.iterations > 0:
                res = await self.evaluate("after")
                self.metrics.write(self.iteration, {**self._eval_row(res), "eval": "after"})
            if cfg.swe.enabled:
                await self._swe()
        finally:
            with contextlib.suppress(Exception):
                await self.rollout.aclose()
            self.summary["rollout"] = self.rollout.summary()
            self.metrics.close()

    async def iterations(self) -> None:
        """The RL iterations, synchronous (max_staleness 0) or with a producer ahead of the trainer."""
        from trainer import schedule
        from trainer.metrics import Progress

        with Progress(self.cfg.rl.iterations, "GRPO", enabled=self._progress_on()) as bar:
            self.bar = bar
            bar.update(self.iteration, {})
            try:
                await schedule.run(self.cfg.rl.iterations, self.cfg.rl.max_staleness, lambda: self.iteration,
                                   lambda: self.version, self.rollout_batch,
                                   lambda batch, v: self._train_iteration(batch, produced_at=v))
            finally:
                self.bar = None

    async def _train_iteration(self, got: Collected, produced_at: int, phase: str = "train") -> dict[str, Any]:
        from trainer.advantages import AdvantageConfig
        from trainer.batch import rl_batch

        cfg = self.cfg
        trajs = got.trajectories
        current = self.version
        kept, dropped = filter_stale(trajs, current, cfg.rl.max_staleness)
        self.counts["stale_dropped"] += len(dropped)
        adv = AdvantageConfig(cfg.rl.baseline, cfg.rl.std_normalize, drop_all_equal=cfg.rl.drop_all_equal)  # type: ignore[arg-type]
        batch = rl_batch(kept, adv, current_version=current, pass_threshold=cfg.rl.pass_threshold)
        m: dict[str, Any] = dict(batch.stats)
        m.update(got.split())
        m.update({"staleness/bound": float(cfg.rl.max_staleness), "staleness/dropped": float(len(dropped)),
                  "partial/paused": float(got.paused), "partial/resumed": float(got.resumed),
                  "groups": float(len(got.groups)), "episodes": float(len(trajs)),
                  "version/rollout": float(self.version_base + produced_at)})
        m["pass_rate/train_all"], _, _ = pass_rate(trajs, cfg.rl.pass_threshold)
        if batch.samples:
            t0 = time.perf_counter()
            m.update(await asyncio.to_thread(self.trainer.step, batch))
            self.add_time("train", time.perf_counter() - t0)
            t0 = time.perf_counter()
            res = await asyncio.to_thread(self.sync.push, self.trainer)
            self.version = res.version if res.version is not None else self.version + 1
            await self.rollout.set_version(self.version)   # turns the server does not version are stamped with it
            m.update(res.metrics())
            self.add_time("sync", time.perf_counter() - t0)
        else:
            self.counts["empty_batches"] += 1
            m.update({"time/train": 0.0, "time/sync": 0.0})
        self.add_time("rollout_env", m["time/env"])
        self.add_time("rollout_policy", m["time/policy"])
        if phase == "train":
            self.iteration += 1
        m["version"] = float(self.logical_version)
        m["iteration"] = float(self.iteration)
        every = cfg.eval.every
        if phase == "train" and cfg.eval.enabled and every > 0 and self.iteration % every == 0 \
                and self.iteration < cfg.rl.iterations:
            res = await self.evaluate(f"iter{self.iteration}", split="validation")
            m.update(self._eval_row(res))
        last = self.iteration >= cfg.rl.iterations or phase != "train"
        if got.cursor is not None:
            self.trained_cursor = got.cursor
        checkpointed = False
        if cfg.rl.ckpt_every > 0 and (self.iteration % cfg.rl.ckpt_every == 0 or last) and batch.samples:
            t0 = time.perf_counter()
            files = {PAUSED_FILE: got.pending} if got.pending is not None else None
            await asyncio.to_thread(self.trainer.checkpoint, self.dir / "checkpoints", self._data_state(),
                                    cfg.rl.keep_checkpoints, files=files)
            checkpointed = True
            self.add_time("checkpoint", time.perf_counter() - t0)
        self.rollout.keep_snapshots = set(self.partial.trained(got.consumed, checkpointed, got.pending,
                                                               cfg.rl.ckpt_every > 0))
        step = self.iteration if phase == "train" else self.iteration + 1
        row = self.metrics.write(step, {f"{phase}/{k}" if phase != "train" else k: v for k, v in m.items()})
        self._report(m, phase)
        if self.bar is not None and phase == "train":
            self.bar.update(self.iteration, m)
        return row

    def _data_state(self) -> dict[str, Any]:
        from trainer.partial import data_state

        return data_state(self)

    def _report(self, m: dict[str, Any], phase: str) -> None:
        label = f"iter {self.iteration}/{self.cfg.rl.iterations}" if phase == "train" else phase.upper()
        self.say(iteration_line(label, m, self.logical_version))

    # -- 6. one SWE iteration --
    async def _swe(self) -> None:
        cfg = self.cfg
        records = swe_task_records(cfg)
        self.say(f"SWE iteration: {len(records)} group(s) of {cfg.swe.group_size} on {cfg.swe.env_id} "
                 f"({', '.join(str(r.get('instance_id')) for r in records)}), {cfg.swe.max_turns} turns each")
        t0 = time.perf_counter()
        specs = [self._spec(TaskRef(r, cfg.seed + i), "swe", cfg.swe.group_size, cfg.swe.env_id)
                 for i, r in enumerate(records)]
        got = await self.collect(specs)
        trajs = got.trajectories
        rate, reward, _ = pass_rate(trajs, 1.0)
        res: dict[str, Any] = {"groups": len(got.groups), "episodes": len(trajs), "resolved": rate,
                               "reward_mean": reward, "finish_reasons": dict(Counter(t.finish_reason for t in trajs)),
                               "graded": sum(1 for t in trajs if t.grade),
                               "group_ids": sorted({t.group_id for t in trajs}),
                               "shared_prompt": all(t.token_ids[:t.prompt_len] == trajs[0].token_ids[:trajs[0].prompt_len]
                                                    for t in trajs if t.group_id == trajs[0].group_id and t.prompt_len)
                               if trajs else None}
        if cfg.swe.train and trajs:
            row = await self._train_iteration(got, produced_at=self.version, phase="swe")
            res["trained"] = "swe/loss" in row
            res["weight_version_after"] = self.logical_version
        res["time_s"] = time.perf_counter() - t0
        self.add_time("swe", res["time_s"])
        self.summary["swe"] = res
        self.say(f"SWE iteration: resolved {res['resolved']:.2f}, reward {reward:.3f}, graded {res['graded']}/"
                 f"{len(trajs)}, finish {res['finish_reasons']}")

    # -- 7. the summary --
    def _finish(self) -> None:
        cfg = self.cfg
        from trainer.evaluation import paired_gain
        from trainer.health import plot_health
        from trainer.metrics import plot, read_jsonl

        rows = read_jsonl(self.dir / "metrics.jsonl") if (self.dir / "metrics.jsonl").is_file() else []
        before, after = self.evals.get("before"), self.evals.get("after")
        gain = paired_gain(before["per_task"], after["per_task"], seed=cfg.seed) if before and after else None
        times = {k: round(v, 2) for k, v in sorted(self.times.items())}
        self.summary.update({
            "iterations": self.iteration, "weight_version": self.logical_version,
            "heldout": {"after_sft": before, "after_rl": after, "gain": gain},
            "validation": {k: v for k, v in self.evals.items() if k not in ("before", "after")},
            "pass_rate_after_sft": before["mean_at_k"] if before else None,
            "pass_rate_after_sft_ci": before["mean_at_k_ci"] if before else None,
            "pass_rate_after_rl": after["mean_at_k"] if after else None,
            "pass_rate_after_rl_ci": after["mean_at_k_ci"] if after else None,
            "rl_gain": gain["gain"] if gain else None, "rl_gain_ci": gain["gain_ci"] if gain else None,
            "counts": dict(self.counts), "time_s": times,
            "config": to_dict(cfg), "run_dir": str(self.dir),
        })
        write_json(self.dir / "summary.json", self.summary, indent=1, default=str)
        with contextlib.suppress(Exception):
            plot(rows, self.dir / "metrics.png", title=f"{cfg.name}: RL metrics")
        with contextlib.suppress(Exception):
            plot_health(rows, self.dir / "rl_health.png", title=f"{cfg.name}: RL health")
        with contextlib.suppress(Exception):
            reward_plot(rows, self.evals, self.dir / "reward.png", title=f"{cfg.name} (seed {cfg.seed})")
        self.console.print(summary_table(self.summary))

    def plan(self) -> str:
        """What the run would do (``--dry-run``)."""
        return plan(self.cfg, self.dir, self.resume)
