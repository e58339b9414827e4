"""Benchmark rollouts: where an episode's time goes, group start by fork against resets, a burst of episodes,
throughput against the number of Ray workers, and a beam-search step against its width.

What, in one run:

- (a) ``a_env_share``: SWE-v0 episodes driven by the k3-mini policy (random weights, served by ``agentenv policy
  serve`` started here, short generations) through one Ray worker: the environment's share of episode time
  (reset + fork + tool steps) against the policy's (waiting for generations), summed over the episodes; the
  samples are per-episode wall times. Goal: environment < 5%.
- (b) ``b_group_start_fork8`` against ``b_group_start_resets8``: the time until 8 envs of one SWE task are ready
  — one reset then ``fork(8)`` (filesystem fork; ``b_group_start_fork8_memory``: processes too) against 8 fresh
  resets run at once (threads), as frameworks that start G independent containers do. One sample per round per
  task.
- (b') ``b_burst64_first_tool_call``: 64 SWE episodes started at once (8 groups of 8 on 2 workers, a scripted
  policy whose first answer is a bash call): per episode, the seconds from the burst's start to its first tool
  call (reset, fork, queueing, the first policy answer); p50 and p99.
- (c) ``c_workers_<N>``: Tool-v0 episodes with k3-mini through 1, 2 and 4 workers: episodes/min and generated
  tokens/s (fields), per-episode wall times (samples).
- (d) ``d_beam_width_<W>``: one step of ``rollout.search.beam`` (depth 1) from a reset SWE task with k3-mini, for
  widths 1, 2, 4, 8 (scorer 0, so the tests inside each fork do not dominate; the reset is included).

A model is not the point of (b) and (b'): they use a scripted policy (``rollout.scripted``). Ray is started once
here (local, sized to the machine) and shared by every phase. Results go to ``bench/results/rollout.json``.

    .venv/bin/python -m bench.rollout [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.harness import Report, Row, Timer, add_output_arg, console, percentile, print_table, recording

K3_TOKEN = "bench-token"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def k3_mini(max_model_len: int) -> Iterator[str]:
    """``agentenv policy serve`` of k3-mini (random weights, EP=1) on a free port; yields its URL."""
    from policy.engines import EngineSpec, start, wait_healthy

    spec = EngineSpec("agentenv", "k3-mini", port=_port(), data_parallel_size=1, api_key=K3_TOKEN,
                      max_model_len=max_model_len)
    proc = start(spec)
    try:
        wait_healthy(spec.base_url, timeout=600, interval=0.5)
        yield spec.base_url
    finally:
        proc.terminate()
        proc.wait(60)


@contextmanager
def scripted_policy(script: Any) -> Iterator[str]:
    import uvicorn

    from rollout import scripted
    from rollout.agent import LocalTokenizer

    port = _port()
    server = uvicorn.Server(uvicorn.Config(scripted.create_app(script, LocalTokenizer()), host="127.0.0.1",
                                           port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def _episode_wall(t: Any) -> float:
    return sum(x.policy_s + x.env_s for x in t.turns) + t.fork_s + float(t.metadata.get("reset_s") or 0.0)


def _play(cfg: Any, tasks: list[Any], workers: int) -> Any:
    """Play ``tasks`` through ``workers`` Ray workers; raises when every episode hit an infrastructure error."""
    from rollout.driver import Rollout

    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as out:
        r = Rollout(cfg, workers=workers, out=Path(out) / "run")
        results = list(r.groups(tasks))
    trajs = [t for g in results for t in g.trajectories]
    failed = [t for t in trajs if t.infra_error]
    if failed and len(failed) == len(trajs):
        raise RuntimeError(f"every episode failed: {failed[0].finish_reason}: {failed[0].error}")
    return r, [t for t in trajs if not t.infra_error]


def env_share(report: Report, url: str, tasks: list[str], turns: int, group_size: int) -> None:
    from rollout.agent import AgentConfig
    from rollout.workers import RolloutConfig

    res = report.result("a_env_share", note=f"SWE-v0 x k3-mini (random weights), {len(tasks)} groups of "
                                            f"{group_size}, {turns} turns of <= 32 tokens, 1 worker; samples: "
                                            "episode wall times")
    with recording(res, "(a) env share"):
        cfg = RolloutConfig("agentenv/SWE-v0", url, policy_token=K3_TOKEN, group_size=group_size,
                            agent=AgentConfig(max_turns=turns, max_new_tokens=32, context_limit=4096))
        r, trajs = _play(cfg, tasks, workers=1)
        res.samples += [_episode_wall(t) for t in trajs]
        s = r.stats
        res.fields.update(env_share=s.env_share, policy_s=round(s.policy_s, 3), env_step_s=round(s.env_s, 3),
                          reset_s=round(s.reset_s, 3), fork_s=round(s.fork_s, 3), episodes=s.episodes,
                          finish_reasons=dict(s.finish), goal="env_share < 0.05")


def group_start(report: Report, tasks: list[Any], runs: int) -> None:
    from envs.swe_env import SWEEnv
    from rollout.groups import branch

    fork = report.result("b_group_start_fork8", note="SWEEnv reset, then fork(8) (files)")
    mem = report.result("b_group_start_fork8_memory", note="SWEEnv reset, then fork(8, memory=True)")
    resets = report.result("b_group_start_resets8", note="8 fresh SWEEnv resets at once (threads)")

    def close(envs: list[Any]) -> None:
        for e in envs:
            e.close()

    for _ in range(runs):
        for task in tasks:
            make = functools.partial(SWEEnv, task=task)
            for res, memory in ((fork, False), (mem, True)):
                with recording(res, f"(b) fork(8) memory={memory}"):
                    parent = SWEEnv(task=task)
                    kids: list[Any] = []
                    try:
                        with Timer() as t:
                            parent.reset()
                            kids = branch(parent, 8, memory=memory, make_env=make, seed=None)
                        res.add(t.s)
                    finally:
                        close([*kids, parent])
            with recording(resets, "(b) 8 resets"):
                envs = [SWEEnv(task=task) for _ in range(8)]
                try:
                    with Timer() as t, ThreadPoolExecutor(8) as pool:
                        list(pool.map(lambda e: e.reset(), envs))
                    resets.add(t.s)
                finally:
                    close(envs)


def burst(report: Report, tasks: list[str]) -> None:
    from rollout import scripted
    from rollout.agent import AgentConfig
    from rollout.driver import Rollout
    from rollout.workers import RolloutConfig

    res = report.result("b_burst64_first_tool_call", note=f"{len(tasks)} SWE groups of 8 started at once on 2 "
                                                          "workers (scripted policy): seconds from the start to "
                                                          "each episode's first tool call")

    def script(prompt: str, turn: int) -> str:
        return scripted.tool_call("bash", {"command": "git status --short"})

    with recording(res, "(b') burst"), scripted_policy(script) as url, \
            tempfile.TemporaryDirectory(prefix="bench-burst-") as out:
        cfg = RolloutConfig("agentenv/SWE-v0", url, group_size=8, agent=AgentConfig(max_turns=1),
                            groups_per_worker=len(tasks) // 2 + 1, worker_cpus=0.5)
        r = Rollout(cfg, workers=2, out=Path(out) / "run")
        asyncio.run(r.start())
        t0 = time.time()
        trajs = [t for g in r.groups(tasks) for t in g.trajectories]
        firsts = [t.metadata["first_step_at"] - t0 for t in trajs if t.metadata.get("first_step_at")]
        res.samples += firsts
        res.fields.update(episodes=len(trajs), with_tool_call=len(firsts), p50_s=percentile(firsts, 0.5),
                          p99_s=percentile(firsts, 0.99), wall_s=round(r.stats.elapsed, 3),
                          finish_reasons=dict(r.stats.finish))


def by_workers(report: Report, url: str, episodes: int, counts: list[int]) -> None:
    from rollout.agent import AgentConfig
    from rollout.workers import RolloutConfig

    for n in counts:
        res = report.result(f"c_workers_{n}", note=f"Tool-v0 x k3-mini, {episodes} episodes (groups of 2), "
                                                   f"{n} workers x 4 groups in flight; samples: episode wall times")
        with recording(res, f"(c) {n} workers"):
            cfg = RolloutConfig("agentenv/Tool-v0", url, policy_token=K3_TOKEN, group_size=2,
                                agent=AgentConfig(max_turns=3, max_new_tokens=32, context_limit=2048))
            r, trajs = _play(cfg, [f"calc-00{1 + i % 8}" for i in range(episodes // 2)], workers=n)
            res.samples += [_episode_wall(t) for t in trajs]
            res.fields.update(episodes_per_min=round(r.stats.episodes_per_min, 2),
                              tokens_per_s=round(r.stats.tokens_per_s, 2), wall_s=round(r.stats.elapsed, 3),
                              env_share=r.stats.env_share)


def beam_widths(report: Report, url: str, task: Any, widths: list[int]) -> None:
    try:
        from rollout import search
    except ImportError as e:
        report.notes.append(f"(d) skipped: rollout.search is not there ({e})")
        return
    from envs.swe_env import SWEEnv
    from policy.client import PolicyClient
    from rollout.agent import AgentConfig, LocalTokenizer

    tok = LocalTokenizer()
    for w in widths:
        res = report.result(f"d_beam_width_{w}", note=f"rollout.search.beam(width={w}, depth=1) from a reset "
                                                      "SWE task, k3-mini, scorer 0 (reset included)")
        with recording(res, f"(d) width {w}"):
            env = SWEEnv(task=task)

            async def step(env: Any = env, w: int = w) -> Any:
                async with PolicyClient(url, K3_TOKEN) as policy:
                    return await search.beam(env, policy, tok, width=w, depth=1, scorer=lambda e, s: 0.0,
                                             config=AgentConfig(max_new_tokens=32, context_limit=4096))

            try:
                with Timer() as t:
                    result = asyncio.run(step())
                if result.best.infra_error:
                    raise RuntimeError(f"the search ended in {result.best.finish_reason}: {result.best.error}")
                res.add(t.s)
                res.fields["nodes"] = len(result.nodes)
            finally:
                env.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="fewer episodes and rounds")
    add_output_arg(ap, "rollout", "--out")
    args = ap.parse_args(argv)
    report = Report("rollout", {k: v for k, v in vars(args).items() if k != "output"})

    import ray

    from envs.images import build_image
    from envs.task import shipped_tasks
    from envs.tasks.libraries import load_libraries

    by_lib: dict[str, Any] = {}
    for t in shipped_tasks():
        by_lib.setdefault(t.metadata["library"], t)
    for library in load_libraries():
        build_image(library.recipe, log=console.log)
    swe = list(by_lib.values())
    report.info.update(swe_tasks=[t.instance_id for t in swe], cpus=os.cpu_count())
    t0 = time.perf_counter()
    ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False, log_to_driver=False,
             logging_level=logging.WARNING, configure_logging=False, object_store_memory=256 << 20)
    report.info["ray_init_s"] = round(time.perf_counter() - t0, 3)
    try:
        console.log("(b) group start: fork(8) against 8 resets")
        group_start(report, swe[:2], runs=1 if args.quick else 2)
        console.log("(b') a burst of 64 episodes")
        burst(report, [t.instance_id for t in (swe * 2)[:8]])
        with k3_mini(4096) as url:
            console.log("(a) env share with k3-mini")
            env_share(report, url, [t.instance_id for t in swe[: 2 if args.quick else 4]], turns=3, group_size=2)
            console.log("(c) workers 1, 2, 4")
            by_workers(report, url, 8 if args.quick else 16, [1, 2, 4])
            console.log("(d) beam step against width")
            beam_widths(report, url, swe[0], [1, 2, 4] if args.quick else [1, 2, 4, 8])
    except Exception as e:  # noqa: BLE001 - recorded, the report is still written
        report.fatal = f"{type(e).__name__}: {e}"
    finally:
        ray.shutdown()

    report.add_ratio("resets8/fork8", "b_group_start_resets8", "b_group_start_fork8")
    g = report.results
    rows = [Row("(b) reset + fork(8)", [g.get("b_group_start_fork8")]),
            Row("(b) reset + fork(8, memory)", [g.get("b_group_start_fork8_memory")]),
            Row("(b) 8 resets at once", [g.get("b_group_start_resets8")], report.ratios["resets8/fork8"]["value"]),
            Row("(b') burst 64: first tool call", [g.get("b_burst64_first_tool_call")])]
    a = g.get("a_env_share")
    if a is not None:
        share = a.fields.get("env_share")
        rows.append(Row("(a) SWE episode x k3-mini", [a], cells={"note": "env share " + (
            f"{share:.1%}" if share is not None else "-")}))
    for key, r in g.items():
        if key.startswith("c_workers_"):
            rows.append(Row(f"(c) {key[10:]} workers: episode", [r], cells={
                "note": f"{r.fields.get('episodes_per_min', '-')} ep/min, {r.fields.get('tokens_per_s', '-')} tok/s"}))
        if key.startswith("d_beam_width_"):
            rows.append(Row(f"(d) beam step, width {key[13:]}", [r]))
    print_table("rollouts", rows, p99=True)
    report.print_errors()
    report.write(args.output)
    return 1 if report.fatal else 0


if __name__ == "__main__":
    raise SystemExit(main())
