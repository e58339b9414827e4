"""Our pytest parsers against the official SWE-bench package's ``parse_log_pytest`` (a test-only dependency:
``pip install --no-deps swebench``; skipped without it). Its parser splits lines on whitespace, so it
can only name ids without spaces; on those, a test passes for it exactly when it passes for us. The
integration test ``test_envs_grading_swebench.py`` does the same on the logs of every shipped task."""

from __future__ import annotations

import pytest

from envs.grading import PASSING, parse_pytest

from .swebench_official import SWEBENCH_PASSING, load_swebench_parser
from .test_envs_grading import LOG


def disagreements(log: str, ours: dict[str, str], theirs: dict[str, str]) -> list[str]:
    """Ids whose passing/not passing differs, or that one parser names and the other misses (ids without
    whitespace: swebench cuts the others at their first space; it knows no XPASS, which it leaves out)."""
    out = []
    for tid, status in theirs.items():
        if tid in ours and (status in SWEBENCH_PASSING) != (ours[tid] in PASSING):
            out.append(f"{tid}: ours {ours[tid]}, swebench {status}")
        elif tid not in ours and not any(t.startswith(tid + " ") for t in ours):  # else: an id it cut at a space
            out.append(f"{tid}: swebench {status}, ours missing")
    for tid, status in ours.items():
        if tid not in theirs and not any(c.isspace() for c in tid) and status != "XPASS":
            out.append(f"{tid}: ours {status}, swebench missing")
    return out


SPACELESS_LOG = """\
PASSED t.py::test_a
PASSED t.py::test_p[1-2]
FAILED t.py::test_b - AssertionError: assert 1 == 2
FAILED t.py::T::test_c[x] - KeyError: ['k'] - see [1]
ERROR t.py::test_d - RuntimeError: setup
XFAIL t.py::test_x[1] - upstream bug [#12]
XPASS t.py::test_l
SKIPPED [2] t.py:40: no network
PASSED t.py::test_td
ERROR t.py::test_td - OSError: teardown
"""


@pytest.mark.parametrize("log", [SPACELESS_LOG, LOG])
def test_our_text_parser_agrees_with_swebench(log):
    parse, _version = load_swebench_parser()
    assert disagreements(log, parse_pytest(log), parse(log, None)) == []
