"""Verdict modes: how a status map becomes "resolved", dataset by dataset, version by version.

The datasets decide alike in outline (every FAIL_TO_PASS test must now pass, every PASS_TO_PASS test must
still pass) and differ in the details that decide rewards:

- ``swebench-4`` (``swebench`` 4.1's ``get_eval_tests_report``): a test passes when it is PASSED or XFAIL,
  fails when it is FAILED, ERROR or missing; anything else (SKIPPED) is in neither list and so ignored — a
  patch that makes every FAIL_TO_PASS test skip scores RESOLVED_FULL;
- ``swebench-5`` (5.0's): a skipped FAIL_TO_PASS test fails, a skipped PASS_TO_PASS test passes, and an
  expected id truncated mid-parameter (``test_x[log(photon``, more ``[`` than ``]``) matches the ids it
  prefixes when they agree on pass versus fail;
- ``fail-only`` (``EvalType.FAIL_ONLY``, either version): only a FAILED status fails; missing, ERROR and
  SKIPPED pass;
- ``swesmith`` (SWE-smith's ``get_eval_report``): a missing test passes (its runs cover a subset), only
  FAILED and ERROR fail, and the expected tests are first narrowed to the files its command ran;
- ``r2e-exact`` (R2E-Gym's ``_calculate_reward_r2e``): the parsed map, keys cut at `` - `` and stripped of
  ANSI colours, must equal ``expected_output_json`` exactly: same keys, same statuses;
- ``strict`` (agentenv's own tasks): every FAIL_TO_PASS and PASS_TO_PASS test PASSED or XFAIL; skipped,
  XPASS and missing fail.

``verdict`` returns the official report's shape (``Report``): the FAIL_TO_PASS / PASS_TO_PASS success and
failure lists and RESOLVED_FULL / PARTIAL / NO by ``get_resolution_status``'s rule. The unit tests feed the
same maps to ``swebench`` 4.1 and 5.0's own functions (``tests/unit/envs/test_envs_runners_differential.py``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Mode = Literal["swebench-4", "swebench-5", "fail-only", "swesmith", "r2e-exact", "strict"]
MODES: tuple[Mode, ...] = ("swebench-4", "swebench-5", "fail-only", "swesmith", "r2e-exact", "strict")
FULL, PARTIAL, NO = "RESOLVED_FULL", "RESOLVED_PARTIAL", "RESOLVED_NO"
PASSING = frozenset({"PASSED", "XFAIL"})
# the statuses swebench's TestStatus knows: a parser never reports another (XPASS is ours, from JUnit)
SWEBENCH_STATUSES = frozenset({"PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL"})
_ANSI = re.compile(r"\x1b\[\d+m")


@dataclass(frozen=True)
class Report:
    """One verdict, in the official report's terms, with the mode that made it and the map it read."""

    mode: Mode
    resolution: str                                  # RESOLVED_FULL / RESOLVED_PARTIAL / RESOLVED_NO
    f2p_success: tuple[str, ...] = ()
    f2p_failure: tuple[str, ...] = ()
    p2p_success: tuple[str, ...] = ()
    p2p_failure: tuple[str, ...] = ()
    statuses: Mapping[str, str] = field(default_factory=dict)  # the status map the verdict read
    found: bool = True                               # False: no result could be read (the official "not applied")
    why: str = ""                                    # why found is False, or what the exact map missed

    @property
    def resolved(self) -> bool:
        return self.found and self.resolution == FULL

    def tests_status(self) -> dict[str, dict[str, list[str]]]:
        """The official report's ``tests_status`` field."""
        return {"FAIL_TO_PASS": {"success": list(self.f2p_success), "failure": list(self.f2p_failure)},
                "PASS_TO_PASS": {"success": list(self.p2p_success), "failure": list(self.p2p_failure)}}

    def to_info(self, *, with_statuses: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": self.mode, "resolved": self.resolved, "resolution": self.resolution,
                               "found": self.found, "tests_status": self.tests_status()}
        if self.why:
            out["why"] = self.why
        if with_statuses:
            out["statuses"] = dict(self.statuses)
        return out


def not_found(mode: Mode, why: str, f2p: Sequence[str] = (), p2p: Sequence[str] = ()) -> Report:
    """No status map could be read (no markers, a bad code in the log, a timeout): not resolved."""
    return Report(mode, NO, (), tuple(f2p), (), tuple(p2p), {}, found=False, why=why)


def resolution(f2p_ok: int, f2p_bad: int, p2p_ok: int, p2p_bad: int) -> str:
    """``get_resolution_status``: FULL when both rates are 1 (an empty list counts 1), PARTIAL when some
    but not all FAIL_TO_PASS tests pass and every PASS_TO_PASS test does, else NO."""
    f2p = f2p_ok / (f2p_ok + f2p_bad) if f2p_ok + f2p_bad else 1.0
    p2p = p2p_ok / (p2p_ok + p2p_bad) if p2p_ok + p2p_bad else 1.0
    if f2p == 1 and p2p == 1:
        return FULL
    return PARTIAL if 0 < f2p < 1 and p2p == 1 else NO


def _key5(case: str, sm: Mapping[str, str]) -> str | None:
    """swebench 5's ``_resolve_case``: the id itself, or for an id truncated inside its brackets the first id
    it prefixes, when all those agree on pass versus fail."""
    if case in sm:
        return case
    if case.count("[") > case.count("]"):
        matches = [k for k in sm if k.startswith(case)]
        if matches and len({sm[k] in PASSING for k in matches}) == 1:
            return matches[0]
    return None


def _judge(mode: Mode, case: str, sm: Mapping[str, str], *, f2p: bool) -> bool | None:
    """True: success; False: failure; None: in neither list (counted by neither rate)."""
    if mode == "fail-only":
        return sm.get(case) != "FAILED"
    if mode == "swesmith":
        status = sm.get(case)
        if status is None or status in PASSING:
            return True
        return False if status in ("FAILED", "ERROR") else None
    if mode == "swebench-5":
        key = _key5(case, sm)
        status = sm[key] if key is not None else None
        if status in PASSING or (not f2p and status == "SKIPPED"):
            return True
        return False if status is None or status in ("FAILED", "ERROR", "SKIPPED") else None
    status = sm.get(case)
    if mode == "strict":
        return status in PASSING
    if status in PASSING:       # swebench-4
        return True
    return False if status is None or status in ("FAILED", "ERROR") else None


def verdict(mode: Mode, statuses: Mapping[str, str], fail_to_pass: Sequence[str], pass_to_pass: Sequence[str], *,
            expected: Mapping[str, str] | None = None, test_files: Sequence[str] = ()) -> Report:
    """The ``mode``'s verdict on ``statuses`` (test id -> status) for the task's tests (see the module doc).

    ``expected``: R2E-Gym's ``expected_output_json`` (``r2e-exact``). ``test_files``: the files SWE-smith's
    command ran (``swesmith``: the expected tests are narrowed to those under them; empty: no narrowing).
    """
    if mode == "r2e-exact":
        return _r2e_exact(statuses, expected or {}, fail_to_pass, pass_to_pass)
    sm = dict(statuses)
    if mode in ("swebench-4", "swebench-5", "fail-only", "swesmith"):
        sm = {k: v for k, v in sm.items() if v in SWEBENCH_STATUSES}  # its parsers never name the others
    if mode == "swesmith" and test_files:
        fail_to_pass = [t for t in fail_to_pass if any(t.startswith(f) for f in test_files)]
        pass_to_pass = [t for t in pass_to_pass if any(t.startswith(f) for f in test_files)]
    lists: list[tuple[list[str], list[str]]] = []
    for tests, f2p in ((fail_to_pass, True), (pass_to_pass, False)):
        ok: list[str] = []
        bad: list[str] = []
        for t in tests:
            judged = _judge(mode, t, sm, f2p=f2p)
            if judged is not None:
                (ok if judged else bad).append(t)
        lists.append((ok, bad))
    (fo, fb), (po, pb) = lists
    return Report(mode, resolution(len(fo), len(fb), len(po), len(pb)), tuple(fo), tuple(fb), tuple(po), tuple(pb),
                  dict(statuses))


def r2e_keys(statuses: Mapping[str, str]) -> dict[str, str]:
    """R2E-Gym's normalisation of a map: ANSI colours stripped, keys cut at `` - ``."""
    clean = {_ANSI.sub("", k): v for k, v in statuses.items()}
    return {k.split(" - ")[0]: clean[k] for k in sorted(clean)}


def r2e_key(test_id: str) -> str:
    """The key R2E-Gym's parser gives a pytest node id: its parts after the file, joined by dots
    (``r2e_tests/test_1.py::TestX::test_y[1]`` -> ``TestX.test_y[1]``); an id without ``::`` is kept."""
    return ".".join(test_id.split("::")[1:]) if "::" in test_id else test_id


def _r2e_exact(statuses: Mapping[str, str], expected: Mapping[str, str], f2p: Sequence[str],
               p2p: Sequence[str]) -> Report:
    got, want = r2e_keys(statuses), r2e_keys(expected)
    bad = tuple(k for k in want if got.get(k) != want[k])
    extra = [k for k in got if k not in want]
    match = not bad and not extra
    why = "" if match else "; ".join(
        [f"{k}: {got.get(k, 'missing')}, expected {want[k]}" for k in bad[:5]]
        + [f"{k}: {got[k]}, not expected" for k in extra[:5]])
    # the report's lists: the task's own FAIL_TO_PASS / PASS_TO_PASS as the exact map judged them
    f_ok = tuple(t for t in f2p if got.get(r2e_key(t)) == want.get(r2e_key(t), "PASSED"))
    p_ok = tuple(t for t in p2p if got.get(r2e_key(t)) == want.get(r2e_key(t), "PASSED"))
    return Report("r2e-exact", FULL if match else NO, f_ok, tuple(t for t in f2p if t not in f_ok),
                  p_ok, tuple(t for t in p2p if t not in p_ok), dict(statuses), why=why)
