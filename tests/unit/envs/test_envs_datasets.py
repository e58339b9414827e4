"""The SWE datasets' records load unchanged into one Task: one hand-made record per dataset (tests/unit/envs/data/
datasets, each citing where its field list came from), detected, named by its dataset's image rule, read from
JSONL, JSON, Parquet and a ``datasets.Dataset``; a record that cannot be run names the field."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from envs.datasets import DATASETS, adapt, detect, read_records
from envs.datasets.diffs import DiffError, reverse_diff
from envs.task import Task, TaskError, load_tasks

DATA = Path(__file__).parent / "data" / "datasets"
FIXTURES = {p.stem: json.loads(p.read_text()) for p in sorted(DATA.glob("*.json"))}
BASE = "26f76044a35d608215086f5604d50713be4044ea"
NEW = "5d1c0a7e9f1b2c3d4e5f60718293a4b5c6d7e8f9"
IMAGES = {  # each dataset's rule (envs.datasets.rules cites where each comes from)
    "swe-bench-4": "swebench/sweb.eval.x86_64.pytoolz_1776_toolz-9001:latest",
    "swe-bench-5": "swebench/sweb.eval.x86_64.pytoolz_1776_toolz-9002:latest",
    "swe-gym": "xingyaoww/sweb.eval.x86_64.pytoolz_s_toolz-9003",
    "swe-smith": "jyangballin/swesmith.x86_64.pytoolz_1776_toolz.93ebb5ae",
    "r2e-gym": f"namanjain12/toolz_final:{NEW}",
    "swe-rebench": "swerebench/sweb.eval.x86_64.pytoolz_1776_toolz-9004:latest",
    "swe-bench-extra": "agentenv/swe-pytoolz__toolz:12",
}


def fixture(name: str) -> tuple[str, dict]:
    f = FIXTURES[name]
    return f["dataset"], dict(f["record"])


def test_every_dataset_has_a_record_with_its_published_fields_and_source():
    assert set(IMAGES) == set(FIXTURES)
    assert {f["dataset"] for f in FIXTURES.values()} == set(DATASETS) - {"agentenv"}
    for name, f in FIXTURES.items():
        assert list(f["record"]) == f["fields"] and len(f["source"]) > 40, name


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_a_record_loads_as_published_with_its_datasets_image(name):
    dataset, rec = fixture(name)
    named = dataset if name == "swe-gym" else None  # SWE-Gym is told apart by its repositories; this one is not
    if named is None:
        assert detect(rec) == dataset
    t = Task.from_json(rec, dataset=named)
    assert (t.dataset, t.image) == (dataset, IMAGES[name])
    assert t.problem_statement == rec["problem_statement"] and t.patch.startswith("diff --git a/toolz/itertoolz.py")
    assert "+        return len(seq) == len(set(seq))" in t.patch  # the gold fix, whatever the dataset calls it
    if dataset != "r2e-gym":
        assert t.FAIL_TO_PASS == ("toolz/tests/test_itertoolz.py::test_isdistinct",) and len(t.PASS_TO_PASS) == 2
    assert Task.from_json(t.to_json()) == t  # the native form round-trips (its dataset named in it)
    assert Task.from_json(json.loads(json.dumps(t.to_json()))) == t


def test_unknown_fields_are_kept_and_the_datasets_own_fields_are_typed():
    t5 = Task.from_json(fixture("swe-bench-5")[1])
    assert (t5.eval_type, t5.log_parser, t5.metadata["split"]) == ("pass_and_fail", "parse_log_pytest", "test")
    assert t5.eval_script.startswith("#!/bin/bash\nset -uxo pipefail") and t5.base_commit == BASE
    t4 = Task.from_json(fixture("swe-bench-4")[1])
    assert (t4.log_parser, t4.eval_script, t4.version) == ("", "", "0.12")  # 4.x: the harness picks by repository
    rebench = Task.from_json(fixture("swe-rebench")[1])
    assert rebench.install_config["test_cmd"].startswith("pytest") and rebench.log_parser == "parse_log_pytest"
    extra = Task.from_json(fixture("swe-bench-extra")[1])
    assert extra.version == "12" and extra.metadata["meta"]["is_lite"] and extra.metadata["license"]


def test_swe_smith_applies_its_bug_at_reset_and_the_gold_fix_is_its_reverse():
    _, rec = fixture("swe-smith")
    t = Task.from_json(rec)
    assert t.bug_patch == rec["patch"] and t.patch == reverse_diff(rec["patch"])
    assert t.base_is_head and t.metadata["branch_commit"] == "0" * 40  # the GitHub branch is not in the image
    assert reverse_diff(t.patch) == rec["patch"]
    bad = {**rec, "instance_id": "not-a-smith-id"}
    del bad["image_name"]
    with pytest.raises(TaskError) as e:
        Task.from_json(bad, dataset="swe-smith")
    assert e.value.field == "instance_id" and "image_name" in str(e.value)


def test_r2e_gym_gets_an_id_a_gold_patch_and_hides_its_tests():
    _, rec = fixture("r2e-gym")
    t = Task.from_json(rec)
    assert t.instance_id == f"toolz__{NEW}" and t.repo == "toolz" and t.base_commit == BASE
    assert t.hidden_paths == ("/r2e_tests", "/testbed/run_tests.sh") and t.FAIL_TO_PASS == ()
    assert t.expected_output == {"test_isdistinct": "PASSED", "test_take": "PASSED", "test_drop": "PASSED"}
    assert t.gold_files == ["toolz/itertoolz.py"]  # the test file of the commit is not in the gold patch
    assert "git clean" not in " ".join(t.setup_commands)  # the image's .venv is untracked in /testbed
    assert any(".venv/" in c for c in t.setup_commands)


@pytest.mark.parametrize(("name", "change", "field", "words"), [
    ("swe-rebench", {"install_config": "pytest"}, "install_config", "must be an object"),
    ("r2e-gym", {"parsed_commit_content": "{not json"}, "parsed_commit_content", "not valid JSON"),
    ("r2e-gym", {"parsed_commit_content": '{"file_diffs": [{}]}'}, "parsed_commit_content", "ParsedCommit"),
    ("r2e-gym", {"expected_output_json": '["x"]'}, "expected_output_json", "test -> status"),
    ("r2e-gym", {"expected_output_json": "{}"}, "expected_output_json", "names no test"),
    ("r2e-gym", {"docker_image": ""}, "docker_image", "image name"),
    ("swe-bench-5", {"eval_type": "sometimes"}, "eval_type", "must be one of"),
    ("swe-bench-5", {"log_parser": "Django!"}, "log_parser", "known: pytest, parse_log_pytest"),
    ("swe-bench-4", {"dataset": "swe-bench-xl"}, "dataset", "unknown dataset"),
    ("swe-bench-4", {"hidden_paths": ["r2e_tests"]}, "hidden_paths", "absolute path"),
    ("swe-bench-4", {"hidden_paths": ["/testbed"]}, "hidden_paths", "absolute path"),
    ("swe-smith", {"patch": "GIT binary patch\nliteral 1\n"}, "patch", "reversed"),
    ("swe-bench-4", {"FAIL_TO_PASS": "[]"}, "FAIL_TO_PASS", "at least one"),
])
def test_a_record_that_cannot_run_names_the_field(name, change, field, words):
    rec = {**fixture(name)[1], **change}
    with pytest.raises(TaskError) as e:
        Task.from_json(rec, where="data.jsonl:3")
    assert e.value.field == field and words in str(e.value) and "data.jsonl:3" in str(e.value)


def test_detection_reads_the_fields_and_a_caller_can_name_the_dataset():
    _, rec = fixture("swe-gym")
    assert detect({**rec, "repo": "getmoto/moto"}) == "swe-gym"
    assert detect({**rec, "repo": "django/django"}) == "swe-bench"
    assert detect(rec) == "agentenv"  # a plain SWE-bench shape of an unknown repository: bring your own image
    assert adapt(rec, "swe-gym")["image"] == IMAGES["swe-gym"]
    with pytest.raises(TaskError, match="'swe-bench' was asked for"):
        Task.from_json({**rec, "dataset": "swe-gym"}, dataset="swe-bench")


def _all_records() -> list[dict]:
    out = []
    for name in sorted(IMAGES):
        dataset, rec = fixture(name)
        out.append({**rec, "dataset": dataset} if name == "swe-gym" else rec)
    return out


def test_jsonl_json_parquet_and_a_datasets_object_load_the_same_tasks(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = _all_records()
    want = [Task.from_json(r) for r in records]
    (tmp_path / "all.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "all.json").write_text(json.dumps({"tasks": records}))
    assert load_tasks(tmp_path / "all.jsonl") == want == load_tasks(tmp_path / "all.json")
    # Parquet as the hub publishes each dataset: typed columns (int version, struct meta, a UTC timestamp)
    folder = tmp_path / "hub"
    folder.mkdir()
    for i, rec in enumerate(records):
        table = pa.Table.from_pylist([rec])
        if "license" in rec:  # SWE-bench-extra's created_at is a timestamp[ns, tz=UTC] column
            ts = pa.array([pa.scalar(1733652000, pa.timestamp("s", tz="UTC")).as_py()], pa.timestamp("ns", "UTC"))
            table = table.set_column(table.schema.get_field_index("created_at"), "created_at", ts)
        pq.write_table(table, folder / f"train-{i:05d}-of-{len(records):05d}.parquet")
    got = load_tasks(folder)
    assert [t.instance_id for t in got] == [t.instance_id for t in want]
    extra = next(t for t in got if t.dataset == "swe-bench-extra")
    assert extra.metadata["created_at"].startswith("2024-12-08T10:00:00") and extra.version == "12"
    assert [t for t in got if t.dataset != "swe-bench-extra"] == [t for t in want if t.dataset != "swe-bench-extra"]
    assert load_tasks(folder / f"train-00000-of-{len(records):05d}.parquet") == [want[0]]
    with pytest.raises(TaskError, match="no such file"):
        load_tasks(folder / "train-99999.parquet")


def test_a_hugging_face_dataset_object_loads_and_a_dataset_dict_asks_for_a_split():
    datasets = pytest.importorskip("datasets")
    _, rec = fixture("swe-bench-4")
    ds = datasets.Dataset.from_list([rec, {**rec, "instance_id": "pytoolz__toolz-9010"}])
    tasks = load_tasks(ds)
    assert [t.instance_id for t in tasks] == ["pytoolz__toolz-9001", "pytoolz__toolz-9010"]
    assert tasks[0] == Task.from_json(rec)
    with pytest.raises(TaskError, match=r"pass one split, e.g. dataset\['test'\]"):
        load_tasks(datasets.DatasetDict({"test": ds}))
    assert read_records(ds)[1][0].endswith("[1]")


def test_bad_sources_say_where(tmp_path):
    (tmp_path / "x.parquet").write_text("not parquet")
    with pytest.raises(TaskError, match="x.parquet: not a readable Parquet file"):
        load_tasks(tmp_path / "x.parquet")
    (tmp_path / "y.jsonl").write_text('{"instance_id": "a"}\n{oops\n')
    with pytest.raises(TaskError, match="y.jsonl:2: not valid JSON"):
        load_tasks(tmp_path / "y.jsonl")
    with pytest.raises(TaskError, match="datasets.Dataset, got int"):
        load_tasks(3)


def _git(cwd: Path, *args: str, input: str | None = None) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, input=input,
                          capture_output=True, text=True, check=True).stdout


def test_reverse_diff_undoes_what_git_applied(tmp_path):
    """Edits, a new file, a deleted one, a mode change, a rename and a last line without a newline: git applies the
    diff, then its reverse, and the tree is the one it started from."""
    repo = tmp_path / "r"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.py").write_text("".join(f"line {i}\n" for i in range(30)))
    (repo / "gone.txt").write_text("bye\n")
    (repo / "run.sh").write_text("echo hi\n")
    (repo / "old_name.py").write_text("x = 1\ny = 2\n")
    (repo / "tail.txt").write_text("no newline")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "base")
    text = (repo / "a.py").read_text().replace("line 3\n", "line three\nline 3b\n").replace("line 20\n", "")
    (repo / "a.py").write_text(text.replace("line 27\n", "line 27\n-- not a header\n"))
    (repo / "gone.txt").unlink()
    (repo / "new.txt").write_text("hello\n")
    (repo / "run.sh").chmod(0o755)
    (repo / "old_name.py").rename(repo / "new_name.py")
    (repo / "tail.txt").write_text("no newline, still\n")
    _git(repo, "add", "-A")
    forward = _git(repo, "diff", "--cached", "-M", "HEAD")
    assert "rename from old_name.py" in forward and "old mode" in forward and "\\ No newline" in forward
    _git(repo, "commit", "-qm", "changed")
    _git(repo, "apply", "--index", "-", input=reverse_diff(forward))
    assert _git(repo, "diff", "--cached", "--stat", "HEAD~1") == ""  # back where it started
    assert reverse_diff(reverse_diff(forward)) == forward
    with pytest.raises(DiffError, match="short of its header"):
        reverse_diff("--- a/x\n+++ b/x\n@@ -1,3 +1,3 @@\n a\n")
