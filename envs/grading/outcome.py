"""What one grading found: ``GradeResult``, the reward it gives, and what ``info`` shows of it.

Beside the verdict that sets the reward, a result carries the dataset's verdict mode, the per-test status
map, both verdicts in the official report's shape (``verdict``: ours from the hardened channel, the official
harness's from the log, with whether they agree) and what set the reward (``reward_source``):
``"hardened"`` — a channel the code under test cannot reach (pytest's JUnit file in the grading folder, the
guard, the isolated run, the canaries) — and, for a dataset's record, the official verdict as well; or
``"official-log"`` — only the official parser's reading of the run's output, which a patch can forge
(``forgeable``), for a runner no hardened channel runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from envs.grading.patch import Dropped
from envs.grading.runners.verdicts import Report
from envs.task import Task


@dataclass(frozen=True)
class GradeResult:
    resolved: bool
    fail_to_pass: dict[str, str]
    pass_to_pass: dict[str, str]
    patch: str                      # the agent's change, as extracted: `git diff` against the base commit
    exit_code: int = 0
    timed_out: bool = False
    error: str = ""                 # why the grade is 0 besides the tests (the patch, the run, tampering)
    log_tail: str = field(default="", repr=False)
    dropped: tuple[Dropped, ...] = ()   # files of the patch that were not graded, and why
    tampering: bool = False         # a drop for a reason but `test`, a mismatched patch, or a tripped canary
    graded_patch: str = field(default="", repr=False)  # what was applied (the patch less `dropped`)
    canary: str = ""                # the canaries' status (FAILED or ERROR when they held); "" when none ran
    timings: Mapping[str, float] = field(default_factory=dict)  # seconds per phase
    canaries: Mapping[str, str] = field(default_factory=dict)   # each canary's node id -> its status
    tampering_reasons: tuple[str, ...] = ()   # what the canaries, the audit hook and the isolated run saw
    solo: Mapping[str, str] = field(default_factory=dict)       # the isolated run's verdicts
    audit_events: tuple[Mapping[str, str], ...] = ()            # what the audit hook refused
    runner: str = "agentenv"        # the dataset family whose harness ran the tests
    mode: str = "strict"            # the verdict mode (envs.grading.runners.verdicts)
    reward_source: str = "hardened"  # "hardened" or "official-log" (see the module doc)
    ours: Report | None = None      # the mode's verdict on the hardened channel's statuses
    official: Report | None = None  # the official harness's verdict on the run's log
    official_error: str = ""        # why there is no official verdict

    @property
    def reward(self) -> float:
        return 1.0 if self.resolved else 0.0

    @property
    def forgeable(self) -> bool:
        return self.reward_source == "official-log"

    @property
    def agree(self) -> bool | None:
        """Whether our verdict and the official one agree (None: one of them is missing)."""
        if self.ours is None or self.official is None:
            return None
        return self.ours.resolved == self.official.resolved

    def verdict_info(self) -> dict[str, Any]:
        """``info["grading"]["verdict"]``: the mode, what set the reward, both verdicts and whether they agree."""
        return {"runner": self.runner, "mode": self.mode, "reward_source": self.reward_source,
                "forgeable": self.forgeable, "agree": self.agree,
                "ours": self.ours.to_info() if self.ours else None,
                "official": self.official.to_info() if self.official else None,
                "official_error": self.official_error}

    def grading_info(self) -> dict[str, Any]:
        """``info["grading"]``: what was dropped from the patch and why, tampering and why, the canaries, the
        isolated run, what the audit hook refused, both verdicts, timings."""
        reasons = [f"{d.path}: dropped ({d.reason})" for d in self.dropped if d.tampering]
        out: dict[str, Any] = {"dropped": [d.to_info() for d in self.dropped], "tampering": self.tampering,
                               "tampering_reasons": [*reasons, *self.tampering_reasons], "canary": self.canary,
                               "canaries": dict(self.canaries), "solo": dict(self.solo),
                               "audit_events": [dict(e) for e in self.audit_events],
                               "verdict": self.verdict_info(),
                               "timings_ms": {k: round(v * 1000, 1) for k, v in self.timings.items()}}
        if self.dropped:
            out["graded_patch"] = self.graded_patch
        return out

    def to_info(self) -> dict[str, Any]:
        return {"resolved": self.resolved, "FAIL_TO_PASS": dict(self.fail_to_pass),
                "PASS_TO_PASS": dict(self.pass_to_pass), "patch": self.patch, "grade_error": self.error,
                "tests_timed_out": self.timed_out, "grading": self.grading_info()}

    def summary(self) -> str:
        """One line for the observation: the verdict, and what was dropped from the patch."""
        verdict = "resolved" if self.resolved else "not resolved"
        notes = []
        if self.dropped:
            notes.append("not graded: " + ", ".join(f"{d.path} ({d.reason})" for d in self.dropped[:5])
                         + (f" and {len(self.dropped) - 5} more" if len(self.dropped) > 5 else ""))
        return f"Graded: {verdict}." + (f" [{'; '.join(notes)}]" if notes else "")


def failed(task: Task, patch: str = "", why: str = "", *, dropped: Sequence[Dropped] = (), tampering: bool = False,
           reasons: tuple[str, ...] = (), graded_patch: str = "", exit_code: int = -1, timed_out: bool = False,
           log_tail: str = "", timings: Mapping[str, float] | None = None) -> GradeResult:
    """A result that scores 0 for ``why``, every test MISSING."""
    return GradeResult(resolved=False, fail_to_pass={t: "MISSING" for t in task.FAIL_TO_PASS},
                       pass_to_pass={t: "MISSING" for t in task.PASS_TO_PASS}, patch=patch, exit_code=exit_code,
                       timed_out=timed_out, error=why, log_tail=log_tail, dropped=tuple(dropped),
                       tampering=tampering, graded_patch=graded_patch, timings=dict(timings or {}),
                       tampering_reasons=reasons)
