"""Fork-based search: best-of-N and step-level beam search over environments that fork.

Beam search: at each agent step, every node on the beam asks the policy for ``width`` continuations in
one request (``n=width``: the server prefills the conversation once and forks its state), forks its
environment ``width`` ways (a filesystem fork by default), plays each continuation in its own fork,
scores the children and keeps the best ``beam`` of them. A child whose step ended the episode is a
leaf with its reward. The result is the best leaf's trajectory and the whole tree (nodes, parent links,
actions, scores, and with ``keep_snapshots`` a snapshot id per node to come back to).

Scores steer the search only; a reward is always the env's own grading. The default score of an
unfinished node is the fraction of the task's FAIL_TO_PASS tests that pass inside its fork (SWE tasks),
else 0; pass ``scorer`` for anything else.

    result = await rollout.search.beam(env, policy, tokenizer, width=4, depth=8)
    result.best            # a Trajectory
    print(result.render()) # the tree
    result.save("runs/NAME")  # searches/<id>.json beside the run's shards: the trajectory viewer shows it
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shlex
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agentenv.config import write_json
from envs.protocol import GymEnv, unwrap
from envs.task import Task
from policy.client import PolicyClient, PolicyError
from rollout.agent import DEFAULT_CONFIG, AgentConfig, EnvFailed, Episode, Step, Tokenizer, begin, play
from rollout.trajectory import Trajectory

Scorer = Callable[[GymEnv, Step], float]  # (the child's env, the step it just took) -> higher is better


@dataclass
class Node:
    """One node of the search tree: the step that led to it and how good it looked."""

    id: int
    parent: int | None
    depth: int
    action: str = ""
    score: float = 0.0
    reward: float | None = None
    done: bool = False
    kept: bool = False
    finish: str = ""
    snapshot_id: str | None = None


@dataclass
class SearchResult:
    """The best trajectory found and the tree that found it."""

    best: Trajectory
    nodes: list[Node] = field(default_factory=list)
    leaves: list[Trajectory] = field(default_factory=list)
    kind: str = ""  # "beam" or "best_of_n"

    def to_dict(self) -> dict[str, Any]:
        return {"best": self.best.to_dict(), "nodes": [asdict(n) for n in self.nodes]}

    def save(self, folder: str | os.PathLike[str], name: str | None = None) -> Path:
        """Write the tree (nodes with their scores and snapshot ids, the best leaf) to ``folder/searches/NAME.json``
        (a new file made whole, then renamed into place); ``folder`` is a run's shards folder."""
        name = name or time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
        out = Path(folder) / "searches" / f"{name}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        write_json(out, {**self.to_dict(), "kind": self.kind, "task_id": self.best.task_id,
                         "env_id": self.best.env_id, "created_at": time.time()}, indent=1)
        return out

    def render(self, width: int = 60) -> str:
        """The tree as indented text: score, reward and the start of each node's action."""
        kids: dict[int | None, list[Node]] = {}
        for n in self.nodes:
            kids.setdefault(n.parent, []).append(n)
        lines: list[str] = []

        def walk(n: Node, indent: int) -> None:
            mark = "*" if n.kept else ("=" if n.done else " ")
            reward = "" if n.reward is None else f" reward={n.reward:g}"
            action = " ".join(n.action.split())[:width]
            lines.append(f"{'  ' * indent}{mark} #{n.id} score={n.score:.3g}{reward} {n.finish} {action}".rstrip())
            for k in kids.get(n.id, []):
                walk(k, indent + 1)

        for root in kids.get(None, []):
            walk(root, 0)
        return "\n".join(lines)


def default_score(env: GymEnv, step: Step) -> float:
    """The fraction of the task's FAIL_TO_PASS tests that pass in this fork (SWE tasks), else 0.0."""
    if step.done:
        return step.reward
    base = unwrap(env)
    task, sandbox = base.task, base.sandbox
    if not isinstance(task, Task) or not task.FAIL_TO_PASS or sandbox is None or not task.test_command:
        return 0.0
    tests = list(task.FAIL_TO_PASS)
    from envs.grading import PASSING, parse_pytest

    command = task.test_command.replace("{tests}", " ".join(shlex.quote(t) for t in tests))
    r = sandbox.exec(command, timeout=300, cwd="/testbed")
    statuses = parse_pytest(r.stdout + r.stderr)
    return sum(statuses.get(t) in PASSING for t in tests) / len(tests)


async def beam(env: GymEnv, policy: PolicyClient, tokenizer: Tokenizer, *, width: int = 4, depth: int = 8,
               beam_size: int | None = None, config: AgentConfig = DEFAULT_CONFIG, scorer: Scorer = default_score,
               reset_options: dict[str, Any] | None = None, memory: bool = False, keep_snapshots: bool = False,
               task_id: str = "", env_id: str = "") -> SearchResult:
    """Step-level beam search from a reset of ``env`` (see the module docstring). ``env`` itself is reset and
    left at its reset state; every fork made here is closed before returning."""
    if width < 1 or depth < 1:
        raise ValueError(f"width and depth must be at least 1, got {width} and {depth}")
    keep = beam_size or width
    ids = itertools.count()
    root = Node(next(ids), None, 0, kept=True)
    nodes: list[Node] = [root]
    leaves: list[Trajectory] = []
    traj = Trajectory(task_id=task_id, env_id=env_id)
    try:
        root_episode = await begin(env, tokenizer, config, traj, None, reset_options)
    except EnvFailed as failure:
        traj.finish_reason, traj.reward, traj.error = "env_error", None, str(failure)
        return SearchResult(traj.check(), nodes, [traj])
    frontier: list[tuple[Node, GymEnv, Episode]] = [(root, env, root_episode)]
    open_forks: dict[int, GymEnv] = {}  # forks made here, by id(env): each closed as soon as it is not needed
    try:
        for _ in range(depth):
            expanded = await asyncio.gather(*(_expand(node, e, ep, policy, config, width, memory, scorer, ids,
                                                      open_forks) for node, e, ep in frontier))
            children = [c for group in expanded for c in group]
            nodes.extend(c[0] for c in children)
            leaves.extend(ep.traj for node, _e, ep in children if node.done)
            alive = sorted((c for c in children if not c[0].done), key=lambda c: c[0].score, reverse=True)[:keep]
            for node, e, _ep in alive:
                node.kept = True
                if keep_snapshots:
                    node.snapshot_id = (await asyncio.to_thread(unwrap(e).snapshot)).id
            needed = {id(e) for _n, e, _ep in alive}
            await _close(open_forks, [k for k in open_forks if k not in needed])
            frontier = alive
            if not frontier:
                break
        leaves.extend(ep.stop("max_turns") for node, _e, ep in frontier if node.id != root.id)  # out of depth
        if not leaves:
            leaves.append(root_episode.stop("max_turns"))
    finally:
        await _close(open_forks, list(open_forks))
    best = max(leaves, key=lambda t: (t.reward is not None, t.reward or 0.0, -len(t.token_ids)))
    return SearchResult(best.check(), nodes, [t.check() for t in leaves], "beam")


async def _close(forks: dict[int, GymEnv], keys: list[int]) -> None:
    envs = [forks.pop(k) for k in keys]
    await asyncio.gather(*(asyncio.to_thread(e.close) for e in envs), return_exceptions=True)


async def _expand(node: Node, env: GymEnv, episode: Episode, policy: PolicyClient, config: AgentConfig, width: int,
                  memory: bool, scorer: Scorer, ids: itertools.count[int], open_forks: dict[int, GymEnv],
                  ) -> list[tuple[Node, GymEnv, Episode]]:
    """``width`` children of a node: one request with n=width, one fork per sample, each stepped and scored."""
    if episode.room(config) <= 0:
        leaf = Node(next(ids), node.id, node.depth + 1, done=True, reward=0.0, finish=episode.limit_reached(config))
        return [(leaf, env, episode.copy())]
    try:
        completion, policy_s = await episode.ask(policy, config, n=width)
    except PolicyError as e:
        failed = episode.copy()
        failed.fail("policy_error", e)
        return [(Node(next(ids), node.id, node.depth + 1, done=True, finish="policy_error"), env, failed)]
    forks = await asyncio.to_thread(unwrap(env).fork, width, memory)
    open_forks.update((id(f), f) for f in forks)

    async def child(sample_index: int) -> tuple[Node, GymEnv, Episode]:
        kid_env, ep = forks[sample_index], episode.copy()
        text, turn = ep.take(completion.samples[sample_index], completion.weight_version, policy_s,
                             completion.prompt_routed_experts)
        n = Node(next(ids), node.id, node.depth + 1, action=text)
        try:
            step = await ep.act(kid_env, text, turn)
        except EnvFailed as e:
            ep.fail("env_error", e)
            n.done, n.finish = True, "env_error"
            return n, kid_env, ep
        n.score = await asyncio.to_thread(scorer, kid_env, step)
        if step.done:
            n.done, n.reward, n.finish = True, step.reward, ep.traj.finish_reason
        return n, kid_env, ep

    return list(await asyncio.gather(*(child(i) for i in range(len(completion.samples)))))


async def best_of_n(env: GymEnv, policy: PolicyClient, tokenizer: Tokenizer, n: int = 4, *,
                    config: AgentConfig = DEFAULT_CONFIG, reset_options: dict[str, Any] | None = None,
                    memory: bool = False, task_id: str = "", env_id: str = "") -> SearchResult:
    """``n`` whole episodes from ``n`` forks of one reset, the best by reward (the verifier is the env's grader)."""
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    traj = Trajectory(task_id=task_id, env_id=env_id)
    try:
        root = await begin(env, tokenizer, config, traj, None, reset_options)
    except EnvFailed as e:
        traj.finish_reason, traj.reward, traj.error = "env_error", None, str(e)
        return SearchResult(traj.check(), [Node(0, None, 0)], [traj])
    try:  # the first turn is one request for all n (the server prefills the prompt once)
        completion, policy_s = await root.ask(policy, config, n=n)
    except PolicyError as e:
        root.fail("policy_error", e)
        return SearchResult(root.traj.check(), [Node(0, None, 0)], [root.traj])
    forks = await asyncio.to_thread(unwrap(env).fork, n, memory)

    async def episode(i: int) -> Trajectory:
        ep = root.copy()
        text, turn = ep.take(completion.samples[i], completion.weight_version, policy_s,
                             completion.prompt_routed_experts)
        try:
            if (await ep.act(forks[i], text, turn)).done:
                return ep.traj
        except EnvFailed as e:
            return ep.fail("env_error", e)
        await play(ep, forks[i], policy, config)   # the turn taken counts toward max_turns
        return ep.traj

    try:
        leaves = [t.check() for t in await asyncio.gather(*(episode(i) for i in range(n)))]
    finally:
        await asyncio.gather(*(asyncio.to_thread(f.close) for f in forks), return_exceptions=True)
    nodes = [Node(0, None, 0, kept=True)] + [
        Node(i + 1, 0, 1, action=f"episode {i}", score=t.reward or 0.0, reward=t.reward, done=True,
             finish=t.finish_reason) for i, t in enumerate(leaves)]
    best = max(leaves, key=lambda t: (t.reward is not None, t.reward or 0.0))
    return SearchResult(best, nodes, leaves, "best_of_n")
