"""What the trajectory viewer shows, read from run folders: runs, their episodes (filtered), one episode as its
conversation with every token's loss mask and logprob, a GRPO group with its advantages, saved search trees and
the metrics a train run logged. The pages and their routes are ``trainer.viewer_web``; this module never serves.

A run is a folder under the viewer's root (the root itself, or one of its sub-folders): a rollout run's shards
folder, or a train run (``metrics.jsonl``, ``config.toml``, ``trajectories/``). Runs are found by listing the
root, never by joining a path the browser sent: a name that is not listed (``..``, an absolute path, a symlink
out of the root) is refused with ``RunNotFound`` / ``BadViewerRequest``.

A run folder may come from someone else, so every file of it is read as the run's own (``_own``): a regular file
reached without a symlink at its end (opened with O_NOFOLLOW, then read through that very descriptor, so nothing
can swap it in between), in a folder of the run. summary.json, run.json or the index linked elsewhere are read as
absent; a shard, metrics.jsonl or config.toml linked elsewhere, or a shard the index names outside the run, makes
the run ``RunNotFound`` (the viewer never shows a file of the host for a run's).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import stat
import threading
import tomllib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentenv.errors import AgentEnvError
from rollout import trajectory as tj
from rollout.export import run_folder
from trainer.advantages import AdvantageConfig, group_advantages
from trainer.metrics import read_jsonl

SEARCHES = "searches"  # a run's saved search trees (rollout.search.SearchResult.save), beside its shards
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+-]{0,199}")
MAX_ROWS = 500  # episodes per page of the episode list
FILTERS = ("reward_min", "reward_max", "finish", "task", "group", "weight_version", "malformed", "tampering",
           "phase")


class BadViewerRequest(AgentEnvError, ValueError):
    """A filter, an id or a run name the viewer does not take (HTTP 400)."""


class RunNotFound(AgentEnvError, LookupError):
    """No run, episode, group or search of that name under the viewer's folder (HTTP 404)."""


def checked_name(name: str, what: str) -> str:
    """``name`` if it is a plain id (letters, digits, ``._:+-``, not starting with a dot): never a path."""
    if not NAME.fullmatch(name):
        raise BadViewerRequest(f"{what} {name[:80]!r} is not a plain name",
                               fix="use the names the viewer lists (no '/', no '..', no leading dot)")
    return name


# --- runs -------------------------------------------------------------------------------------------------------


def _is_run(p: Path) -> bool:
    shards = run_folder(p)
    return (shards / "index.json").is_file() or any(shards.glob(tj.SHARD_GLOB)) or (p / "metrics.jsonl").is_file()


def _inside(root: Path, p: Path) -> bool:
    """``p`` is a real folder (no symlink on the way) inside ``root``."""
    return not p.is_symlink() and p.is_dir() and p.resolve().is_relative_to(root.resolve())


def list_runs(root: Path) -> dict[str, Path]:
    """The runs under ``root`` by name: the root itself (named by its folder) when it is a run, else its
    sub-folders that are runs (symlinks left out, and runs whose trajectories are a symlink)."""
    if not root.is_dir():
        raise RunNotFound(f"no runs folder at {root}", fix="give the folder of a run, or a folder of runs")
    if _is_run(root):
        name = root.resolve().name
        return {name if NAME.fullmatch(name) else "run": root}
    found: dict[str, Path] = {}
    for p in sorted(root.iterdir()):
        if NAME.fullmatch(p.name) and _inside(root, p) and _is_run(p) and _inside(root, run_folder(p)):
            found[p.name] = p
    return found


@dataclass
class Run:
    """One run's data, read once per change of its index (``load`` caches it)."""

    name: str
    path: Path
    episodes: list[tj.Trajectory] = field(default_factory=list)
    by_id: dict[str, tj.Trajectory] = field(default_factory=dict)

    @property
    def shards(self) -> Path:
        return run_folder(self.path)

    @property
    def kind(self) -> str:
        return _kind(self.path)

    def summary(self) -> dict[str, Any]:
        """``brief``'s line with the figures counted from the episodes themselves."""
        rewards = [t.reward for t in self.episodes if t.reward is not None]
        return {**brief(self.name, self.path), "episodes": len(self.episodes),
                "groups": len({t.group_id for t in self.episodes}),
                "reward_mean": sum(rewards) / len(rewards) if rewards else None}


def _kind(path: Path) -> str:
    return "train" if (path / "metrics.jsonl").is_file() or (path / "config.toml").is_file() else "rollout"


def _open_own(path: Path) -> int:
    """A descriptor of ``path`` if it is a regular file with no symlink at its end (O_NOFOLLOW; O_NONBLOCK: a FIFO
    does not hang the viewer); OSError otherwise (ELOOP for a symlink)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file")
    return fd


@contextlib.contextmanager
def _own(path: Path, run: str | None = None) -> Iterator[Path]:
    """A name that reads ``path`` (``_open_own``) through its very descriptor (/proc/self/fd), so that nothing swaps
    the file meanwhile. OSError if it is not the run's own; with ``run`` given, that run's ``RunNotFound``."""
    try:
        fd = _open_own(path)
    except OSError as e:
        if run is None:
            raise
        why = "a symlink, which could lead outside the run" if e.errno == errno.ELOOP else e.strerror
        raise RunNotFound(f"run {run!r}: {path.name} is {why}: the viewer reads a run's own files only",
                          fix="replace the link with the file itself, or view the folder it leads to") from None
    try:
        yield Path(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)


def _json_dict(path: Path) -> dict[str, Any]:
    """A JSON object of the run (``_own``); {} for anything else (missing, malformed, linked out of the run)."""
    try:
        with _own(path) as own:
            found = json.loads(own.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def brief(name: str, path: Path) -> dict[str, Any]:
    """A run's line on the runs page, read from its index, run.json and summary.json: no shard is read."""
    shards = run_folder(path)
    listed = _json_dict(shards / "index.json").get("shards")
    summary = _json_dict(path / "summary.json")
    rollout = summary["rollout"] if isinstance(summary.get("rollout"), dict) else summary  # a train run's
    searches = shards / SEARCHES
    return {"name": name, "kind": _kind(path),
            "episodes": sum(int(s.get("records", 0)) for s in listed if isinstance(s, dict))
            if isinstance(listed, list) else 0,
            "groups": rollout.get("groups"), "reward_mean": rollout.get("reward_mean"),
            "metrics": (path / "metrics.jsonl").is_file(),
            "searches": len(list(searches.glob("*.json"))) if searches.is_dir() else 0,
            "started_at": _json_dict(shards / "run.json").get("started_at")}


_CACHE: dict[Path, tuple[tuple[int, int], Run]] = {}
_LOCK = threading.Lock()


def load(root: Path, name: str) -> Run:
    """The run ``name`` under ``root``, its episodes read (again only when its index changed)."""
    path = list_runs(root).get(checked_name(name, "run"))
    if path is None:
        raise RunNotFound(f"no run {name!r} under the viewer's folder", fix="pick one from the runs page")
    shards = run_folder(path)
    if shards.is_symlink() or not shards.resolve().is_relative_to(root.resolve()):
        raise RunNotFound(f"run {name!r} keeps its trajectories outside the viewer's folder",
                          fix="view that folder itself (agentenv view FOLDER)")
    index = shards / "index.json"
    if index.is_symlink():
        raise RunNotFound(f"run {name!r}: index.json is a symlink, which could lead outside the run: the viewer "
                          "reads a run's own files only", fix="replace the link with the file itself")
    # the index changes with every shard published; without one (a writer killed before writing it), the shards
    stamp = (index.stat().st_mtime_ns, index.stat().st_size) if index.is_file() else \
        (len(found := list(shards.glob(tj.SHARD_GLOB))), sum(p.stat().st_size for p in found))
    key = path.resolve()
    with _LOCK:
        cached = _CACHE.get(key)
        if cached is not None and cached[0] == stamp:
            return cached[1]
    episodes = _episodes(name, shards) if shards.is_dir() else []
    run = Run(name, path, episodes, {t.episode_id: t for t in episodes})
    with _LOCK:
        if len(_CACHE) >= 8:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = (stamp, run)
    return run


def _episodes(name: str, shards: Path) -> list[tj.Trajectory]:
    """The run's trajectories, from the shards its index lists (and those it missed) in its own folder only."""
    for shard in shards.glob(tj.SHARD_GLOB):  # before the index is read, which counts the records of unlisted ones
        with _own(shard, name):
            pass
    found: list[tj.Trajectory] = []
    for shard in tj.shard_paths(shards):
        if shard.parent != shards:
            raise RunNotFound(f"run {name!r}: its index names a shard outside the run ({str(shard)[-120:]!r})",
                              fix="an index names the shards beside it by their file names only")
        with _own(shard, name) as own:
            found.extend(tj.read(own))
    return found


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
            "error": t.error, "metadata": t.metadata, "grade": grade_view(t.grade),
            "time": {"policy_s": sum(x.policy_s for x in t.turns), "env_s": sum(x.env_s for x in t.turns),
                     "reset_s": float(t.metadata.get("reset_s") or 0.0), "fork_s": t.fork_s},
            "prompt": _tokens(t, texts, 0, prompt_end), "turns_detail": turns, "tail": tail}


# --- groups and advantages --------------------------------------------------------------------------------------


def advantage_config(run: Run) -> tuple[AdvantageConfig, str]:
    """How the run computed advantages: a train run's ``[rl]`` settings (config.toml), else GRPO's defaults."""
    cfg = run.path / "config.toml"
    if cfg.is_file():
        with _own(cfg, run.name) as own:
            rl = tomllib.loads(own.read_text()).get("rl", {})
        chosen = AdvantageConfig(rl.get("baseline", "mean"), bool(rl.get("std_normalize", True)),
                                 drop_all_equal=bool(rl.get("drop_all_equal", False)))
        return chosen, "the run's config.toml [rl]"
    return AdvantageConfig(), "GRPO's defaults (a rollout run names no advantage settings)"


def group(run: Run, group_id: str, decode: Callable[[list[int]], str],
          tool_calls: Callable[[str], tuple[str, list[str]]]) -> dict[str, Any]:
    """Every member of a group, side by side: reward, advantage (as the trainer computes it from the group's
    rewards, ``trainer.advantages``) and each turn's text and tool calls."""
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
            with _own(p) as own:
                saved = json.loads(own.read_text())
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
        with _own(path, run.name) as own:
            rows = read_jsonl(own)
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
