"""One record of each dataset (tests/unit/envs/data/datasets), loaded as published, runs end to end on a local image
named by its dataset's rule and in its dataset's layout, and is graded by its dataset's runner: toolz 0.12.1 with one
real bug, built once and `docker tag`ged for each record. The gold fix resolves it and the unchanged repository does
not, with the official verdict beside ours; SWE-smith's bug is applied at reset with no history that shows it and
its gold fix is the bug's reverse; R2E-Gym's hidden tests are gone from the agent's sandbox and come back, from the
image, for grading only, where no patch can touch them.

The layouts: SWE-bench's (/testbed, and /opt/miniconda3/bin/activate: a stand-in for conda whose `conda activate
testbed` keeps the image's Python, which is the environment) for every dataset but R2E-Gym, whose image adds
R2E-Gym's own: a virtualenv at /testbed/.venv, the tests in /r2e_tests (the record's three tests, taken from toolz's
own test file) and /testbed/run_tests.sh.

SWE-bench 4.x rows exist only for swebench's own repositories, whose eval script its harness builds from its tables
(a row of another repository is refused, naming the field: tests/unit/envs/test_envs_runners_dispatch.py): the
4.x record is run as a row of pytest-dev/pytest 8.0, whose specs are plain `pytest -rA`, over the toolz image.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.host import images
from envs.grading import grade
from envs.images import build_image
from envs.swe_env import SWEEnv
from envs.task import Task
from envs.task_sandbox import start_task
from envs.tasks.libraries import load_libraries

pytestmark = pytest.mark.integration
DATA = Path(__file__).parents[2] / "unit" / "envs" / "data" / "datasets"
LAYOUT = "agentenv-test/toolz-swebench-layout:1"
BUGGED = "agentenv-test/toolz-isdistinct:1"
R2E = "agentenv-test/toolz-r2e:1"
BASE = "26f76044a35d608215086f5604d50713be4044ea"
AS_SWE_BENCH_4 = {"repo": "pytest-dev/pytest", "version": "8.0"}  # see the module doc
RUNNER = {"swe-bench-4": ("swebench", "swebench-4"), "swe-bench-5": ("swebench", "swebench-5"),
          "swe-gym": ("swe-gym", "swebench-4"), "swe-smith": ("swe-smith", "swesmith"),
          "swe-rebench": ("swe-rebench", "swebench-4"), "swe-bench-extra": ("agentenv", "strict"),
          "r2e-gym": ("r2e-gym", "r2e-exact")}
# R2E-Gym's tests: the record's expected tests, taken from the image's own test file by name
R2E_TESTS = """import ast, pathlib
src = pathlib.Path("/testbed/toolz/tests/test_itertoolz.py").read_text()
tree = ast.parse(src)
keep = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
        or getattr(n, "name", "") in ("test_isdistinct", "test_take", "test_drop")]
pathlib.Path("/r2e_tests").mkdir()
pathlib.Path("/r2e_tests/test_1.py").write_text("\\n\\n".join(ast.get_source_segment(src, n) for n in keep) + "\\n")
"""


def record(name: str) -> tuple[str, dict]:
    f = json.loads((DATA / f"{name}.json").read_text())
    return f["dataset"], {**f["record"], **(AS_SWE_BENCH_4 if name == "swe-bench-4" else {})}


def fixture(name: str) -> Task:
    dataset, rec = record(name)
    return Task.from_json(rec, dataset=dataset if name == "swe-gym" else None)


def _build(ctx: Path, image: str, dockerfile: str, **files: str) -> None:
    ctx.mkdir()
    for name, text in {"Dockerfile": dockerfile, **files}.items():
        (ctx / name).write_text(text)
    images.build(str(ctx), image)


@pytest.fixture(scope="module")
def tagged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Task]]:
    """Every record's task, its image tagged locally (toolz in SWE-bench's layout for SWE-smith, with the bug
    committed for the others, R2E-Gym's in its own layout); the tags removed after."""
    [toolz] = [lib for lib in load_libraries() if lib.name == "toolz"]
    pristine = build_image(toolz.recipe)
    ctx = tmp_path_factory.mktemp("layouts")
    _build(ctx / "layout", LAYOUT, f"FROM {pristine}\nRUN mkdir -p /opt/miniconda3/bin && printf '%s\\n' "
           "'conda() { :; }  # a stand-in: the image'\"'\"'s python is the testbed environment' "
           "> /opt/miniconda3/bin/activate\n")
    bug = json.loads((DATA / "swe-smith.json").read_text())["record"]["patch"]
    _build(ctx / "bugged", BUGGED, f"FROM {LAYOUT}\nCOPY bug.patch /tmp/bug.patch\n"
           "RUN cd /testbed && git apply /tmp/bug.patch && git commit -qam isdistinct && rm /tmp/bug.patch\n",
           **{"bug.patch": bug})
    from envs.grading.runners.spec import R2E_TEST_CMD

    _build(ctx / "r2e", R2E, f"FROM {BUGGED}\nCOPY tests.py run_tests.sh /tmp/\n"
           "RUN python3 /tmp/tests.py && rm /tmp/tests.py && mv /tmp/run_tests.sh /testbed/run_tests.sh \\\n"
           " && cd /testbed && python3 -m venv --without-pip --system-site-packages .venv\n",
           **{"tests.py": R2E_TESTS, "run_tests.sh": R2E_TEST_CMD + "\n"})
    tasks = {p.stem: fixture(p.stem) for p in sorted(DATA.glob("*.json"))}
    made = []
    for name, t in tasks.items():
        images.tag({"swe-smith": LAYOUT, "r2e-gym": R2E}.get(name, BUGGED), t.image)
        made.append(t.image)
    try:
        yield tasks
    finally:
        for image in [*made, R2E, BUGGED, LAYOUT]:
            images.remove(image)


def _apply(sb, patch: str) -> None:  # noqa: ANN001 - a sandbox
    sb.write_file("/tmp/gold.patch", patch)
    r = sb.exec("git apply /tmp/gold.patch && rm /tmp/gold.patch", cwd="/testbed")
    assert r.exit_code == 0, r.stdout + r.stderr


def _by_its_runner(result, name: str) -> None:  # noqa: ANN001 - a GradeResult
    assert (result.runner, result.mode) == RUNNER[name], result.error
    if result.runner != "agentenv":  # a dataset's record: the official verdict beside ours, agreeing
        assert result.official is not None and result.agree is True, (result.official, result.official_error)


@pytest.mark.parametrize("name", ["swe-bench-4", "swe-bench-5", "swe-gym", "swe-smith", "swe-rebench",
                                  "swe-bench-extra"])
def test_a_record_runs_on_its_datasets_image_and_its_runner_grades_it(tagged, name):
    task = tagged[name]
    sb, started = start_task(task)
    try:
        if name == "swe-smith":  # the bug applied at reset, one commit that shows nothing of it
            assert started.base_commit != task.base_commit and len(started.base_commit) == 40
            assert sb.exec("git rev-list --all | wc -l", cwd="/testbed").stdout.strip() == "1"
            assert "!= len(set(seq))" in sb.exec("grep -n 'len(seq)' toolz/itertoolz.py", cwd="/testbed").stdout
        else:
            assert started.base_commit == BASE
        unchanged = grade(sb, started, timeout=600)  # the bug is there: the unchanged repository fails
        assert not unchanged.resolved and unchanged.fail_to_pass == dict.fromkeys(task.FAIL_TO_PASS, "FAILED")
        _by_its_runner(unchanged, name)
        _apply(sb, task.patch)  # SWE-smith's: the reverse of its published patch
        result = grade(sb, started, timeout=600)
        assert result.resolved, (result.error, result.fail_to_pass, result.pass_to_pass, result.log_tail[-1500:])
        _by_its_runner(result, name)
    finally:
        sb.close()


def _hidden_count(sb, task: Task) -> str:  # noqa: ANN001 - a sandbox
    gone = " ".join(shlex.quote(p) for p in task.hidden_paths)
    return sb.exec(f"ls -d {gone} 2>/dev/null | wc -l").stdout.strip()


def test_r2e_gym_hides_its_tests_from_the_agent_and_grades_with_them(tagged):
    """Every sandbox the agent gets (a reset, a reset to the same task from its pristine state) lacks the hidden
    paths; grading (from that pristine state) has them back, from the image, and judges by the exact map."""
    task = tagged["r2e-gym"]
    assert images.present("namanjain12/toolz_final:" + task.instance_id.rpartition("__")[2])
    with SWEEnv(task=task) as env:
        env.reset()
        sb = env.sandbox
        assert sb is not None and _hidden_count(sb, task) == "0"
        assert sb.exec("git status --porcelain", cwd="/testbed").stdout == ""  # nothing untracked shows
        empty = env.grade()
        assert not empty.resolved and (empty.runner, empty.mode) == RUNNER["r2e-gym"]
        assert empty.ours is not None and "test_isdistinct: FAILED, expected PASSED" in empty.ours.why
        _apply(sb, task.patch)  # the gold patch, made from parsed_commit_content, applies at the base commit
        gold = env.grade()
        assert gold.resolved, (gold.error, gold.ours, gold.log_tail[-1500:])
        assert gold.ours is not None and dict(gold.ours.statuses) == task.expected_output  # R2E-Gym's keys
        assert gold.agree is True
        env.reset()  # the same task again: restored from its pristine state, which never held them
        assert env.sandbox is not None and _hidden_count(env.sandbox, task) == "0"


def test_a_patch_cannot_touch_r2e_gyms_hidden_tests(tagged):
    """The agent writes its own passing tests where the hidden ones go and its own run_tests.sh, makes git see
    them, and reads for the real ones during the run: the tests that run are the image's, and the bug fails them."""
    task = tagged["r2e-gym"]
    with SWEEnv(task=task) as env:
        env.reset()
        sb = env.sandbox
        assert sb is not None
        fake = "".join(f"def {k}():\n    pass\n\n" for k in task.expected_output)
        sb.exec("mkdir -p /testbed/r2e_tests")
        sb.write_file("/testbed/r2e_tests/test_1.py", fake)
        sb.write_file("/testbed/run_tests.sh", "echo PASSED\n")
        sb.write_file("/testbed/toolz/peek.py", "import os\ntry:\n    LEAK = os.listdir('/r2e_tests')\n"
                      "except Exception:\n    LEAK = []\n")
        sb.exec("sed -i '/r2e_tests\\|run_tests.sh/d' .git/info/exclude && "
                "sed -i '1i from toolz import peek  # noqa' toolz/__init__.py", cwd="/testbed")
        result = env.grade()
        assert not result.resolved and result.tampering
        assert "run_tests.sh" in [d.path for d in result.dropped]
        assert "r2e_tests/test_1.py" in result.patch  # taken in the patch, replaced by the image's tests
        assert result.ours is not None and result.ours.statuses == {**task.expected_output, "test_isdistinct": "FAILED"}, result.log_tail[-3000:]
        assert any(e.get("detail") == "/r2e_tests" for e in result.audit_events), result.audit_events


def test_validate_runs_each_datasets_records_and_prints_the_tables(tagged, tmp_path, capsys):
    """`agentenv tasks validate` on the records as published (SWE-Gym's, which its fields cannot tell apart,
    from a Parquet folder with --dataset): every gold resolves and nothing else does, each by its runner."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from envs.tasks.__main__ import main

    detected = [n for n in RUNNER if n != "swe-gym"]
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(record(n)[1]) + "\n" for n in detected))
    assert main(["validate", "--tasks", str(tmp_path / "records.jsonl"), "--no-images", "--workers", "2"]) == 0, \
        capsys.readouterr().out
    out = capsys.readouterr().out.splitlines()
    rows = {r.split()[0]: r.split() for r in out if r.split() and r.split()[0] in {t.instance_id for t in tagged.values()}}
    for name in detected:
        row = rows[tagged[name].instance_id]
        family, mode = RUNNER[name]
        assert row[2] == f"{family}/{mode}" and row[3:7] == ["yes", "no", "no", "no" if name != "r2e-gym" else "-"]
        assert row[7] == "agrees" and row[-1] == "ok", row  # (agentenv's: our own -rA reading of the log)
    assert "6/6 tasks valid" in out[-1]
    gym = tmp_path / "swe-gym"
    gym.mkdir()
    pq.write_table(pa.Table.from_pylist([record("swe-gym")[1]]), gym / "train-00000-of-00001.parquet")
    assert main(["validate", "--tasks", str(gym), "--no-images", "--dataset", "swe-gym"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out.splitlines()
    assert any(r.split()[:3] == [tagged["swe-gym"].instance_id, "swe-gym", "swe-gym/swebench-4"] for r in out), out
    assert "1/1 tasks valid" in out[-1]
