"""Records of real upstream fixes, in SWE-bench's image layout, graded by their runners (issue 41, "Real runners, real
fixes"): for each record the gold patch resolves, an empty patch does not, a no-op edit of the files the gold patch
touches does not, and the official ``swebench`` 5.0.2 ``get_eval_report`` on the log the grading captured agrees
with our verdict each time.

Records: ``envs/tasks/fixes_tasks.jsonl`` (``agentenv tasks fixes`` builds them): three Django 5.0.2 -> 5.0.3
fixes (``tests/runtests.py``), a SymPy 1.13.0 -> 1.13.1 fix (``bin/test``) and a requests 2.32.3 -> 2.32.4 fix
(pytest, ``parse_log_requests``). The second SymPy record (``sympy__sympy-26821``: its test file takes a minute and a
half a run) is checked by ``bench/fixes_grading.py`` only.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from envs.tasks.fixes import RECORDS_FILE
from envs.tasks.validate import noop_edit

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fixes_records import applying, build_images, graded, record  # noqa: E402

pytestmark = pytest.mark.integration
SLOW = {"sympy__sympy-26821"}
IDS = [line.split('"instance_id": "', 1)[1].split('"', 1)[0] for line in RECORDS_FILE.read_text().splitlines()]


@pytest.fixture(scope="module", autouse=True)
def images() -> None:
    build_images()


def test_the_records_are_real_fixes_of_three_runners_named_by_swebenchs_rules():
    tasks = [record(i) for i in IDS]
    assert {t.repo for t in tasks} == {"django/django", "sympy/sympy", "psf/requests"}
    assert sum(t.repo == "django/django" for t in tasks) >= 3 and sum(t.repo == "sympy/sympy" for t in tasks) >= 2
    for t in tasks:
        assert t.image == f"swebench/sweb.eval.x86_64.{t.instance_id.replace('__', '_1776_')}:latest"
        assert t.patch and t.test_patch and t.FAIL_TO_PASS and t.PASS_TO_PASS


@pytest.mark.parametrize("instance_id", [i for i in IDS if i not in SLOW])
def test_gold_resolves_empty_and_noop_do_not_and_the_official_verdict_agrees(instance_id):
    task = record(instance_id)
    noop = noop_edit(task)

    def edit_noop(sb):  # noqa: ANN001, ANN202
        r = sb.exec(noop, cwd="/testbed")
        assert r.exit_code == 0, r.stdout + r.stderr

    for label, edit, want in (("gold", applying(task.patch), True), ("empty", None, False),
                              ("no-op edit", edit_noop, False)):
        r = graded(task, edit)
        assert r.resolved is want, (label, r.error, r.tampering_reasons, r.fail_to_pass)
        assert r.official is not None and r.official.resolved is want, (label, r.official_error)
        assert r.agree and not r.tampering, (label, r.tampering_reasons)
        assert r.canaries and all(s in ("FAILED", "ERROR") for s in r.canaries.values()), r.canaries
