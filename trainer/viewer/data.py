"""What the trajectory viewer shows of a run: its episodes (filtered), one episode as its conversation with every
token's loss mask and logprob, a GRPO group with its advantages, saved search trees and the metrics a train run
logged. Runs are found and loaded, from their own files only, by ``trainer.viewer.runs``; the pages and their
routes are ``trainer.viewer.web``; this module never serves.
"""

from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rollout import trajectory as tj
from trainer.algorithm.advantages import AdvantageConfig, group_advantages
from trainer.metrics import read_jsonl
from trainer.viewer.runs import NAME, SEARCHES, BadViewerRequest, Run, RunNotFound, checked_name, own

MAX_ROWS = 500  # episodes per page of the episode list
FILTERS = ("reward_min", "reward_max", "finish", "task", "group", "weight_version", "malformed", "tampering",
           "phase")


# --- the episode list -------------------------------------------------------------------------------------------


def tampering(t: tj.Trajectory) -> bool:
    grading = t.grade.get("grading")
    return bool(isinstance(grading, dict) and grading.get("tampering"))


def row(t: tj.Trajectory) -> dict[str, Any]:
    """An episode's line in the list."""
    return {"episode_id": t.episode_id, "task_id": t.task_id, "env_id": t.env_id, "group_id": t.group_id,
            "group_index": t.group_index, "reward": t.reward, "finish_reason": t.finish_reason,
            "weight_versions": sorted(set(t.weight_versions)), "turns": len(t.turns), "tokens": len(t.token_ids),
            "generated": t.generated_tokens, "tool_calls": t.tool_calls, "malformed_calls": t.malformed_calls,
            "tampering": tampering(t), "phase": t.metadata.get("phase"), "created_at": t.created_at}


def _number(params: Mapping[str, str], key: str, kind: Callable[[str], Any]) -> Any:
    if not params.get(key):
        return None
    try:
        return kind(params[key])
    except ValueError:
        raise BadViewerRequest(f"filter {key}={params[key][:40]!r} is not a number", fix=f"give {key} a number") \
            from None


def _flag(params: Mapping[str, str], key: str) -> bool | None:
    value = params.get(key, "")
    if value in ("", "any"):
        return None
    if value not in ("yes", "no"):
        raise BadViewerRequest(f"filter {key}={value[:40]!r} is not yes, no or any", fix=f"give {key}=yes or no")
    return value == "yes"


def episodes(run: Run, params: Mapping[str, str]) -> dict[str, Any]:
    """The run's episodes that pass the filters in ``params`` (``FILTERS``; an unknown one is refused), at most
    ``limit`` of them from ``offset``, with the values the filters can take."""
    unknown = sorted(set(params) - set(FILTERS) - {"limit", "offset"})
    if unknown:
        raise BadViewerRequest(f"the episode list has no filter {', '.join(unknown)}",
                               fix=f"filter by {', '.join(FILTERS)}")
    lo, hi = _number(params, "reward_min", float), _number(params, "reward_max", float)
    version = _number(params, "weight_version", int)
    malformed, tampered = _flag(params, "malformed"), _flag(params, "tampering")
    finish, phase = params.get("finish") or None, params.get("phase") or None
    if finish is not None and finish not in tj.FINISH_REASONS:
        raise BadViewerRequest(f"finish {finish[:40]!r} is not a finish reason",
                               fix=f"one of {', '.join(tj.FINISH_REASONS)}")
    task, group = params.get("task", ""), params.get("group", "")
    limit, offset = _number(params, "limit", int), _number(params, "offset", int)
    limit, offset = MAX_ROWS if limit is None else limit, offset or 0
    if not 0 < limit <= MAX_ROWS or offset < 0:
        raise BadViewerRequest(f"limit {limit} / offset {offset} out of range", fix=f"limit 1..{MAX_ROWS}, offset >= 0")

    def keep(t: tj.Trajectory) -> bool:
        r = t.reward
        return ((lo is None or (r is not None and r >= lo)) and (hi is None or (r is not None and r <= hi))
                and (finish is None or t.finish_reason == finish) and task in t.task_id and group in t.group_id
                and (version is None or version in t.weight_versions)
                and (malformed is None or (t.malformed_calls > 0) == malformed)
                and (tampered is None or tampering(t) == tampered)
                and (phase is None or t.metadata.get("phase") == phase))

    chosen = [t for t in run.episodes if keep(t)]
    return {"run": run.summary(), "total": len(chosen), "offset": offset, "limit": limit,
            "rows": [row(t) for t in chosen[offset:offset + limit]],
            "choices": {"finish": sorted({t.finish_reason for t in run.episodes}),
                        "phase": sorted({str(t.metadata["phase"]) for t in run.episodes if "phase" in t.metadata}),
                        "weight_version": sorted({v for t in run.episodes for v in t.weight_versions})}}


# --- one episode ------------------------------------------------------------------------------------------------


def token_texts(ids: Sequence[int], decode: Callable[[list[int]], str]) -> list[str]:
    """Each token's text. A character split over several byte-level tokens is given to the last of them (the
    others get ""), so that the texts joined are the decoded conversation."""
    out: list[str] = []
    pending: list[int] = []
    for i in ids:
        pending.append(i)
        text = decode(pending)
        if "\ufffd" in text and len(pending) < 4 and len(out) + 1 < len(ids):
            out.append("")
            continue
        out.append(text)
        pending = []
    return out


def _tokens(t: tj.Trajectory, texts: list[str], lo: int, hi: int) -> list[list[Any]]:
    """Tokens ``lo..hi`` as ``[position, text, mask, logprob]``."""
    return [[i, texts[i], t.loss_mask[i], t.logprobs[i]] for i in range(lo, hi)]


def grade_view(grade: Mapping[str, Any]) -> dict[str, Any]:
    """The grade as the page shows it: the tests' statuses, what the grader dropped and why, tampering."""
    grading = grade.get("grading") if isinstance(grade.get("grading"), dict) else {}
    assert isinstance(grading, dict)
    tests = {k: dict(grade[k]) for k in ("FAIL_TO_PASS", "PASS_TO_PASS") if isinstance(grade.get(k), dict)}
    shown = {"FAIL_TO_PASS", "PASS_TO_PASS", "grading", "patch"}
    return {"tests": tests, "dropped": list(grading.get("dropped") or []),
            "tampering": bool(grading.get("tampering")), "tampering_reasons": list(grading.get("tampering_reasons")
                                                                                  or []),
            "timings_ms": dict(grading.get("timings_ms") or {}), "patch": str(grade.get("patch") or ""),
            "other": {k: v for k, v in grade.items() if k not in shown}}


def episode(run: Run, episode_id: str, decode: Callable[[list[int]], str],
            tool_calls: Callable[[str], tuple[str, list[str]]],
            messages: Callable[[list[int]], list[tuple[str, str]]]) -> dict[str, Any]:
    """One episode as its conversation: the prompt's tokens, then each turn's generated tokens (with their tool
    calls as text) and the tokens that followed them (the tool outputs, by tool: ``messages`` splits ids at the
    template's control tokens, never decoded text, where a tool output could forge a message); every token with its
    mask and logprob; the turns' timings and the grade."""
    t = run.by_id.get(checked_name(episode_id, "episode"))
    if t is None:
        raise RunNotFound(f"run {run.name} has no episode {episode_id!r}", fix="pick one from the episode list")
    texts = token_texts(t.token_ids, decode)
    prompt_end = t.prompt_len or (t.turns[0].start if t.turns else len(t.token_ids))
    starts = [x.start for x in t.turns] + [len(t.token_ids)]
    turns = []
    for i, turn in enumerate(t.turns):
        gen_end = turn.start + turn.generated
        content, calls = tool_calls(decode(t.token_ids[turn.start:gen_end]).removesuffix("<|im_end|>"))
        turns.append({"index": i, "weight_version": turn.weight_version, "policy_s": turn.policy_s,
                      "env_s": turn.env_s, "finish": turn.finish, "malformed": turn.malformed,
                      "tool_calls": calls, "content": content,
                      "outputs": [{"name": n, "text": b} for n, b in messages(t.token_ids[gen_end:starts[i + 1]])
                                  if n != "assistant"],
                      "before": _tokens(t, texts, prompt_end if i == 0 else turn.start, turn.start),
                      "generated": _tokens(t, texts, turn.start, gen_end),
                      "after": _tokens(t, texts, gen_end, starts[i + 1])})
    tail = _tokens(t, texts, prompt_end, len(t.token_ids)) if not t.turns else []  # an episode with no turn
    return {"run": run.name, **row(t), "seed": t.seed, "prompt_len": t.prompt_len, "fork_s": t.fork_s,
            "harness": harness_view(run, t),
            "error": t.error, "metadata": t.metadata, "grade": grade_view(t.grade),
            "time": {"policy_s": sum(x.policy_s for x in t.turns), "env_s": sum(x.env_s for x in t.turns),
                     "reset_s": float(t.metadata.get("reset_s") or 0.0), "fork_s": t.fork_s},
            "prompt": _tokens(t, texts, 0, prompt_end), "turns_detail": turns, "tail": tail}


def harness_view(run: Run, t: tj.Trajectory) -> dict[str, Any] | None:
    """A harness episode's record (rollout.harnesses, docs/harnesses.md): the harness and how it ended, this
    branch of its gateway session (cause, parent, the shared prefix, the session's calls each turn was), the
    session's figures, and the records of the episode's other branches; None for an episode of the agent loop."""
    gw = t.metadata.get("gateway")
    if not isinstance(gw, dict):
        return None
    others = [o for o in run.episodes if o is not t and o.group_id == t.group_id and o.group_index == t.group_index
              and isinstance(o.metadata.get("gateway"), dict)]
    return {"name": t.metadata.get("harness"), "outcome": t.metadata.get("outcome"),
            "exit": t.metadata.get("harness_exit"), "branch": gw.get("branch"), "cause": gw.get("cause"),
            "parent_branch": gw.get("parent_branch"), "fork_at": gw.get("fork_at"),
            "calls": gw.get("calls_in_branch", []),
            "session": {k: gw.get(k) for k in ("calls", "branches", "causes", "merge_rate", "retries", "errors",
                                               "stopped")},
            "other_branches": [{"episode_id": o.episode_id, "branch": o.metadata["gateway"].get("branch"),
                                "cause": o.metadata["gateway"].get("cause")} for o in others]}


# --- groups and advantages --------------------------------------------------------------------------------------


def advantage_config(run: Run) -> tuple[AdvantageConfig, str]:
    """How the run computed advantages: a train run's ``[rl]`` settings (config.toml), else GRPO's defaults."""
    cfg = run.path / "config.toml"
    if cfg.is_file():
        with own(cfg, run.name) as file:
            rl = tomllib.loads(file.read_text()).get("rl", {})
        chosen = AdvantageConfig(rl.get("baseline", "mean"), bool(rl.get("std_normalize", True)),
                                 drop_all_equal=bool(rl.get("drop_all_equal", False)))
        return chosen, "the run's config.toml [rl]"
    return AdvantageConfig(), "GRPO's defaults (a rollout run names no advantage settings)"


def group(run: Run, group_id: str, decode: Callable[[list[int]], str],
          tool_calls: Callable[[str], tuple[str, list[str]]]) -> dict[str, Any]:
    """Every member of a group, side by side: reward, advantage (as the trainer computes it from the group's
    rewards, ``trainer.algorithm.advantages``) and each turn's text and tool calls."""
    members = sorted((t for t in run.episodes if t.group_id == checked_name(group_id, "group")),
                     key=lambda t: t.group_index)
    if not members:
        raise RunNotFound(f"run {run.name} has no group {group_id!r}", fix="pick one from the episode list")
    cfg, source = advantage_config(run)
    advantages = group_advantages([t.reward for t in members], cfg)
    usable = [t.reward for t in members if t.reward is not None]
    dropped = cfg.drop_all_equal and len(set(usable)) <= 1
    out = []
    for t, a in zip(members, advantages, strict=True):
        turns = []
        for turn in t.turns:
            content, calls = tool_calls(decode(t.token_ids[turn.start:turn.start + turn.generated])
                                        .removesuffix("<|im_end|>"))
            turns.append({"content": content, "tool_calls": calls})
        out.append({**row(t), "advantage": None if dropped else a, "turns_detail": turns})
    return {"run": run.name, "group_id": group_id, "members": out, "dropped": dropped,
            "advantages": {"baseline": cfg.baseline, "std_normalize": cfg.std_normalize,
                           "drop_all_equal": cfg.drop_all_equal, "source": source}}


# --- searches and metrics ---------------------------------------------------------------------------------------


def searches(run: Run) -> dict[str, Any]:
    """The run's saved search trees (``searches/*.json``), each with its nodes and best leaf."""
    folder = run.shards / SEARCHES
    trees = []
    for p in sorted(folder.glob("*.json")) if folder.is_dir() and not folder.is_symlink() else []:
        if not NAME.fullmatch(p.stem):
            continue
        try:
            with own(p) as file:
                saved = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError):
            continue  # as a broken file is: a symlink out of the run is never read
        best = saved.get("best") or {}
        trees.append({"id": p.stem, "kind": saved.get("kind", ""), "task_id": saved.get("task_id", ""),
                      "created_at": saved.get("created_at"), "nodes": saved.get("nodes", []),
                      "best": {"reward": best.get("reward"), "finish_reason": best.get("finish_reason"),
                               "episode_id": best.get("episode_id")}})
    return {"run": run.name, "searches": trees}


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def metrics(run: Run) -> dict[str, Any]:
    """``metrics.jsonl`` as series by key (``[step, value]``); a key with ``KEY_lo`` / ``KEY_hi`` beside it (the
    held-out pass rate's interval) as ``[step, value, lo, hi]`` points."""
    path = run.path / "metrics.jsonl"
    rows: list[dict[str, Any]] = []
    if path.is_file():
        with own(path, run.name) as file:
            rows = read_jsonl(file)
    series: dict[str, list[list[Any]]] = {}
    intervals: dict[str, list[list[Any]]] = {}
    for r in rows:
        step = r.get("step")
        if not _finite(step):
            continue
        for k, v in r.items():
            if k in ("step", "time") or not _finite(v) or k.endswith(("_lo", "_hi")):
                continue
            lo, hi = r.get(f"{k}_lo"), r.get(f"{k}_hi")
            if _finite(lo) and _finite(hi):
                intervals.setdefault(k, []).append([step, v, lo, hi])
            else:
                series.setdefault(k, []).append([step, v])
    return {"run": run.name, "rows": len(rows), "series": series, "intervals": intervals}
