"""Our verdict modes against the official ``swebench`` package itself, 4.1.0 and 5.0.2, each in its own process.

The same status maps go to ``swebench``'s ``get_eval_tests_report`` + ``get_resolution_status`` (through
``envs.grading.runners.official``) and to ``envs.grading.runners.verdicts.verdict``: the success and failure
lists and the resolution must be equal, case by case — the cases of SWE-bench's own grading tests (skipped
tests, truncated parametrized ids, ambiguous prefixes, surplus brackets) and a few hundred random maps. The same
pytest logs go to its parsers and to ours: equal verdicts. Needs the pinned folders scripts/bootstrap.sh installs.
"""

from __future__ import annotations

import random

import pytest

from envs.grading.results import parse_pytest
from envs.grading.runners import official
from envs.grading.runners.judge import combine
from envs.grading.runners.spec import Runner
from envs.grading.runners.verdicts import Mode, verdict

STATUSES = ("PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL")
T = "astropy/units/tests/test_format.py::test_ogip_grammar_fail[log(photon"
A = "tests/test_a.py::test_x[args1-No"

# (status map, FAIL_TO_PASS, PASS_TO_PASS): SWE-bench's grading tests' situations, and ours
CASES: list[tuple[dict[str, str], list[str], list[str]]] = [
    ({"t_a": "SKIPPED", "t_b": "SKIPPED", "t_c": "PASSED"}, ["t_a", "t_b"], ["t_c"]),   # every F2P skipped
    ({"t_a": "PASSED", "t_c": "SKIPPED"}, ["t_a"], ["t_c"]),                            # a skipped P2P
    ({T + " / m**2 s)]": "PASSED"}, [T], []),                                          # a truncated id
    ({T + " / m**2 s)]": "FAILED"}, [T], []),
    ({"tests/test_b.py::test_y[other]": "PASSED"}, [T], []),                            # truncated, no match
    ({A[:-2] + "None]": "PASSED", A + "-value]": "PASSED"}, [A], []),                   # ambiguous, one outcome
    ({A[:-2] + "None]": "PASSED", A + "-value]": "FAILED"}, [A], []),                   # ambiguous, mixed
    ({A[:-2] + "None]": "PASSED", A + "-value]": "XFAIL"}, [A], []),                    # PASSED and XFAIL agree
    ({"tests/test_a.py::test_x[case-1-extended]": "PASSED"}, ["tests/test_a.py::test_x[case-1]"], []),
    ({"handles foo] gracefully and more": "PASSED"}, ["handles foo] gracefully"], []),  # a surplus ']'
    ({}, ["t_a"], ["t_b"]),                                                              # nothing ran
    ({"t_a": "ERROR", "t_b": "PASSED"}, ["t_a"], ["t_b"]),
    ({"t_a": "PASSED", "t_b": "PASSED", "t_c": "FAILED"}, ["t_a", "t_b"], ["t_c"]),
    ({"t_a": "PASSED", "t_b": "FAILED"}, ["t_a", "t_b"], ["t_c"]),                     # PARTIAL, P2P missing
    ({"t_a": "PASSED", "t_b": "FAILED"}, ["t_a", "t_b"], []),                          # PARTIAL
    ({"t_a": "XFAIL"}, ["t_a"], []),
    ({"t_a": "PASSED"}, [], []),                                                         # empty lists count 1
]


def _random_cases(n: int) -> list[tuple[dict[str, str], list[str], list[str]]]:
    rng = random.Random(41)
    out = []
    for _ in range(n):
        names = [f"t.py::test_{i}" + rng.choice(["", "[a-1]", "[a-2]", "[b"]) for i in range(rng.randint(1, 8))]
        sm = {x: rng.choice(STATUSES) for x in names if rng.random() < 0.8}
        f2p = [x for x in names if rng.random() < 0.5] + (["t.py::test_0[a"] if rng.random() < 0.3 else [])
        p2p = [x for x in names if x not in f2p and rng.random() < 0.5]
        out.append((sm, f2p, p2p))
    return out


ALL = CASES + _random_cases(300)


def _official(version: str, eval_type: str) -> list[dict[str, object]]:
    h = official.Harness(version)
    try:
        h.check()
    except official.OfficialHarnessError as e:
        pytest.skip(str(e))
    return h.call([{"op": "verdict", "statuses": sm, "FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p, "eval_type": eval_type}
                   for sm, f2p, p2p in ALL])


@pytest.mark.parametrize(("mode", "version", "eval_type"), [
    ("swebench-4", official.SWEBENCH_4, "pass_and_fail"), ("swebench-5", official.SWEBENCH_5, "pass_and_fail"),
    ("fail-only", official.SWEBENCH_4, "fail_only"), ("fail-only", official.SWEBENCH_5, "fail_only")])
def test_our_verdicts_equal_swebench_on_every_status_map(mode: Mode, version: str, eval_type: str):
    answers = _official(version, eval_type)
    for (sm, f2p, p2p), ans in zip(ALL, answers, strict=True):
        ours = verdict(mode, sm, f2p, p2p)
        theirs = ans["tests_status"]
        assert isinstance(theirs, dict)
        assert ours.tests_status() == {k: theirs[k] for k in ("FAIL_TO_PASS", "PASS_TO_PASS")}, (sm, f2p, p2p)
        assert ours.resolution == ans["resolution"], (sm, f2p, p2p)


def test_the_versions_differ_where_the_issue_says():
    """4.1 ignores a skipped test (all-skipped FAIL_TO_PASS resolves); 5.0 fails it and prefix-matches."""
    four = _official(official.SWEBENCH_4, "pass_and_fail")
    five = _official(official.SWEBENCH_5, "pass_and_fail")
    assert (four[0]["resolution"], five[0]["resolution"]) == ("RESOLVED_FULL", "RESOLVED_NO")
    assert (four[2]["resolution"], five[2]["resolution"]) == ("RESOLVED_NO", "RESOLVED_FULL")


LOG = """\
============================= test session starts ==============================
collected 6 items

t.py ..F.sx                                                              [100%]
=========================== short test summary info ============================
PASSED t.py::test_a
PASSED t.py::test_p[1-2]
FAILED t.py::test_b - AssertionError: assert 1 == 2
ERROR t.py::test_d - RuntimeError: setup
SKIPPED [1] t.py:40: no network
XFAIL t.py::test_x[1] - upstream bug
==================== 1 failed, 2 passed, 1 error in 0.10s ======================
"""


@pytest.mark.parametrize(("mode", "version", "parser"), [
    ("swebench-4", official.SWEBENCH_4, "parse_log_pytest"), ("swebench-5", official.SWEBENCH_5, "parse_log_pytest"),
    ("swebench-4", official.SWEBENCH_4, "parse_log_pytest_v2"),
    ("swebench-5", official.SWEBENCH_5, "parse_log_pytest_v2")])
def test_the_same_log_gives_equal_verdicts_through_its_parsers_and_ours(mode: Mode, version: str, parser: str):
    h = official.Harness(version)
    try:
        h.check()
    except official.OfficialHarnessError as e:
        pytest.skip(str(e))
    theirs = h.call([{"op": "parse", "parser": parser, "log": LOG}])[0]["statuses"]
    ours = parse_pytest(LOG)
    # 4.1's parsers keep an ERROR or XFAIL line's message in the id (``t.py::test_d - RuntimeError: setup``),
    # and pytest_v2 reads ``SKIPPED [1] t.py:40: ...`` as a test named ``[1]``
    assert {k: v for k, v in ours.items() if v != "XPASS"} == {
        k.split(" - ")[0]: v for k, v in theirs.items() if not k.startswith("[")}
    ids = ["t.py::test_a", "t.py::test_p[1-2]", "t.py::test_b", "t.py::test_gone"]
    for f2p in ([ids[0]], [ids[0], ids[2]], [ids[3]], [ids[0], ids[1]]):
        p2p = [i for i in ids if i not in f2p][:2]
        assert verdict(mode, ours, f2p, p2p).resolution == verdict(mode, theirs, f2p, p2p).resolution


def test_where_its_parser_misses_a_test_the_reward_follows_the_official_verdict():
    """swebench's pytest parser cuts an id at its first space (``t.py::test_s[a b]`` becomes ``t.py::test_s[a``):
    the official verdict fails that test where ours passes it, and a dataset's record then scores 0, as its
    harness would say; agentenv's own tasks go by ours."""
    log = "PASSED t.py::test_s[a b]\nPASSED t.py::test_a\n"
    for version, mode in ((official.SWEBENCH_4, "swebench-4"), (official.SWEBENCH_5, "swebench-5")):
        h = official.Harness(version)
        try:
            h.check()
        except official.OfficialHarnessError as e:
            pytest.skip(str(e))
        theirs = h.call([{"op": "parse", "parser": "parse_log_pytest", "log": log}])[0]["statuses"]
        f2p = ["t.py::test_s[a b]"]
        ours, off = verdict(mode, parse_pytest(log, f2p), f2p, ["t.py::test_a"]), verdict(mode, theirs, f2p, [])
        assert ours.resolved and not off.resolved
        assert combine(Runner("swebench", mode), ours, off)[0] is False
        assert combine(Runner("agentenv", "strict"), ours, off) == (True, "")
