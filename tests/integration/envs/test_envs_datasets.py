"""One record of each dataset (tests/unit/envs/data/datasets), loaded as published, runs end to end on a local image
named by its dataset's rule: toolz 0.12.1 with one real bug, built once and `docker tag`ged for each record. The gold
fix resolves it and the unchanged repository does not; SWE-smith's bug is applied at reset with no history that
shows it; R2E-Gym's hidden tests are gone from the agent's sandbox."""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.host import images
from envs.grading import grade
from envs.images import build_image
from envs.task import Task
from envs.task_sandbox import start_task
from envs.tasks.libraries import load_libraries

pytestmark = pytest.mark.integration
DATA = Path(__file__).parents[2] / "unit" / "envs" / "data" / "datasets"
BUGGED = "agentenv-test/toolz-isdistinct:1"
BASE = "26f76044a35d608215086f5604d50713be4044ea"


def fixture(name: str) -> Task:
    f = json.loads((DATA / f"{name}.json").read_text())
    return Task.from_json(f["record"], dataset=f["dataset"] if name == "swe-gym" else None)


@pytest.fixture(scope="module")
def tagged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Task]]:
    """Every record's task, its image tagged locally (pristine toolz for SWE-smith, toolz with the bug committed for
    the others, plus R2E-Gym's hidden tests and runner); the tags removed after."""
    [toolz] = [lib for lib in load_libraries() if lib.name == "toolz"]
    pristine = build_image(toolz.recipe)
    ctx = tmp_path_factory.mktemp("bugged")
    bug = json.loads((DATA / "swe-smith.json").read_text())["record"]["patch"]
    (ctx / "bug.patch").write_text(bug)
    (ctx / "Dockerfile").write_text(
        f"FROM {pristine}\nCOPY bug.patch /tmp/bug.patch\n"
        "RUN cd /testbed && git apply /tmp/bug.patch && git commit -qam isdistinct && rm /tmp/bug.patch \\\n"
        " && mkdir /r2e_tests && cp toolz/tests/test_itertoolz.py /r2e_tests/ \\\n"
        " && printf 'python3 -m pytest -rA /r2e_tests\\n' > /testbed/run_tests.sh\n")
    images.build(str(ctx), BUGGED)
    tasks = {p.stem: fixture(p.stem) for p in sorted(DATA.glob("*.json"))}
    made = []
    for name, t in tasks.items():
        images.tag(pristine if name == "swe-smith" else BUGGED, t.image)
        made.append(t.image)
    try:
        yield tasks
    finally:
        for image in [*made, BUGGED]:
            images.remove(image)


def _apply(sb, patch: str) -> None:  # noqa: ANN001 - a sandbox
    sb.write_file("/tmp/gold.patch", patch)
    r = sb.exec("git apply /tmp/gold.patch", cwd="/testbed")
    assert r.exit_code == 0, r.stdout + r.stderr


@pytest.mark.parametrize("name", ["swe-bench-4", "swe-bench-5", "swe-gym", "swe-smith", "swe-rebench",
                                  "swe-bench-extra"])
def test_a_record_runs_on_its_datasets_image_and_its_gold_fix_resolves(tagged, name):
    task = tagged[name]
    sb, started = start_task(task)
    try:
        if name == "swe-smith":  # the bug applied at reset, one commit that shows nothing of it
            assert started.base_commit != task.base_commit and len(started.base_commit) == 40
            assert sb.exec("git rev-list --all | wc -l", cwd="/testbed").stdout.strip() == "1"
            assert "!= len(set(seq))" in sb.exec("grep -n 'len(seq)' toolz/itertoolz.py", cwd="/testbed").stdout
            assert not grade(sb, started, timeout=600).resolved  # the bug is there: the unchanged repo fails
        else:
            assert started.base_commit == BASE
        _apply(sb, task.patch)
        result = grade(sb, started, timeout=600)
        assert result.resolved, (result.error, result.fail_to_pass, result.pass_to_pass)
    finally:
        sb.close()


def test_r2e_gym_hides_its_tests_and_runner_from_the_agent(tagged):
    task = tagged["r2e-gym"]
    assert images.present("namanjain12/toolz_final:" + task.instance_id.rpartition("__")[2])
    sb, started = start_task(task)
    try:
        assert started.base_commit == BASE
        gone = " ".join(shlex.quote(p) for p in task.hidden_paths)
        assert sb.exec(f"ls -d {gone} 2>/dev/null | wc -l").stdout.strip() == "0"
        assert sb.exec("git status --porcelain", cwd="/testbed").stdout == ""  # nothing untracked shows
        _apply(sb, task.patch)  # the gold patch, made from parsed_commit_content, applies at the base commit
        assert "== len(set(seq))" in sb.exec("grep -n 'len(seq)' toolz/itertoolz.py", cwd="/testbed").stdout
    finally:
        sb.close()


def test_validate_takes_a_parquet_file_of_published_records(tagged, tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from envs.tasks.__main__ import main

    rec = json.loads((DATA / "swe-smith.json").read_text())["record"]
    pq.write_table(pa.Table.from_pylist([rec]), tmp_path / "train-00000-of-00001.parquet")
    assert main(["validate", "--tasks", str(tmp_path), "--no-images"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert f"ok   {rec['instance_id']}" in out and "1/1 tasks valid" in out
