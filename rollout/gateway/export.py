"""A session's calls as ``rollout.trajectory`` records: one per branch, the tree kept in the metadata.

A branch whose calls each extended the one before (an append-only harness) is one record: the first call's prompt,
then each call's sampled ids (mask 1, the engine's logprobs), the end-of-turn token where the engine stopped before
it, and the next call's new tail (mask 0). The record's ids are the last call's prompt and sampled ids exactly:
``check_merge`` proves it on every export.

A branch that starts elsewhere (a sibling, a compaction, a subagent) is its own record, with its own mask: the ids it
shares with an earlier branch are its prompt (mask 0), so every sampled token is trained once, in the branch that
sampled it. Loss weights are per token (docs/harnesses.md): a long branch weighs as its tokens do.

Every record of a session shares the episode's reward, ``group_id`` and ``group_index``; ``metadata["gateway"]``
holds the session, the branch, its cause, its tree parent (branch and call) with the shared prefix length, the
calls' sampling settings and template hash, and the session's counts (calls, branches, causes, retries, errors).
"""

from __future__ import annotations

from typing import Any

from rollout.gateway.sessions import Session
from rollout.gateway.tape import Node
from rollout.trajectory import Trajectory, TrajectoryError, Turn


def branch_record(nodes: list[Node], eos_id: int, traj: Trajectory) -> Trajectory:
    """Fill ``traj`` (task, group, reward set by the caller) with one branch's calls."""
    first = nodes[0]
    traj.append(list(first.prompt_ids), generated=False)
    traj.prompt_len = len(first.prompt_ids)
    for i, node in enumerate(nodes):
        if i > 0:
            have = len(traj.token_ids)
            if node.prompt_ids[:have] != traj.token_ids:
                raise TrajectoryError(f"call {node.index} does not extend call {nodes[i - 1].index} verbatim")
            traj.append(node.prompt_ids[have:], generated=False)
        start = len(traj.token_ids)
        traj.append(node.output_ids, generated=True, logprobs=node.logprobs)
        if not node.output_ids or node.output_ids[-1] != eos_id:
            traj.append([eos_id], generated=False)
        traj.turns.append(Turn(start=start, generated=len(node.output_ids), weight_version=node.weight_version or 0,
                               tool_calls=len(node.answer.get("tool_calls") or []), malformed=node.malformed,
                               policy_s=node.seconds, finish=node.finish))
        traj.tool_calls += traj.turns[-1].tool_calls
        traj.malformed_calls += int(node.malformed)
    check_merge(nodes, traj, eos_id)
    return traj


def check_merge(nodes: list[Node], traj: Trajectory, eos_id: int) -> None:
    """The merged record is exactly the last call's prompt and sampled ids (with the end-of-turn token)."""
    if traj.token_ids != nodes[-1].full_ids(eos_id):
        raise TrajectoryError("a merged branch's ids are not its last call's prompt and sampled ids")


def session_summary(session: Session) -> dict[str, Any]:
    """The session's counts, for the run's report and the viewer."""
    tape = session.tape
    calls = [n for n in tape.nodes if n.done]
    extends = sum(1 for n in calls if n.cause == "extend")
    return {"session": session.id[:12], "calls": len(calls), "branches": len(tape.branches()),
            "causes": tape.causes(), "merge_rate": extends / (len(calls) - 1) if len(calls) > 1 else 1.0,
            "retries": session.retries, "lost_retries": session.lost_retries, "errors": session.errors,
            "generated": session.generated, "stopped": session.stopped, "models_asked": sorted(session.asked_models)}


def trajectories(session: Session, *, task_id: str = "", env_id: str = "", reward: float | None = None,
                 finish_reason: str = "submitted", group_id: str = "", group_index: int = 0,
                 grade: dict[str, Any] | None = None, error: str = "") -> list[Trajectory]:
    """The session's branches as checked records (see the module docstring)."""
    eos = session.tape.tokenizer.eos_id
    summary = session_summary(session)
    branch_of = {n.index: n.branch for n in session.tape.nodes}
    out = []
    for nodes in session.tape.branches():
        first = nodes[0]
        traj = Trajectory(task_id=task_id, env_id=env_id, group_id=group_id, group_index=group_index,
                          reward=reward, finish_reason=finish_reason, grade=dict(grade or {}), error=error)
        branch_record(nodes, eos, traj)
        traj.metadata["gateway"] = {
            **summary, "branch": first.branch, "cause": first.cause,
            "parent_branch": None if first.parent is None else branch_of[first.parent],
            "parent_call": first.parent, "fork_at": first.fork_at, "calls_in_branch": [n.index for n in nodes],
            "sampling": [n.sampling for n in nodes], "template": sorted({n.template for n in nodes}),
            "weight_versions": [n.weight_versions for n in nodes]}
        out.append(traj.check())
    return out
