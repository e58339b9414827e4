"""Task records: validation names the task and the field; JSON and JSONL loaders; the shipped set."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from envs import grading
from envs.task import (
    HEAD,
    LOG_PARSERS,
    PYTEST_COMMAND,
    Task,
    TaskError,
    diff_paths,
    image_name,
    load_tasks,
    resolve_task,
    shipped_tasks,
    write_tasks,
)

PATCH = "diff --git a/m.py b/m.py\n--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n"


def record(**over):
    rec = {"instance_id": "demo__1", "repo": "org/demo", "base_commit": "a" * 40, "patch": PATCH, "test_patch": "",
           "problem_statement": "x is wrong", "FAIL_TO_PASS": ["tests/test_m.py::test_x"],
           "PASS_TO_PASS": ["tests/test_m.py::test_y"], "image": "agentenv/swe-demo:1",
           "test_command": "pytest -rA {tests}"}
    rec.update(over)
    return rec


def test_a_valid_record_round_trips():
    t = Task.from_json(record(version=1.2, created_at="2024"))
    assert t.version == "1.2" and t.log_parser == "pytest"
    assert t.metadata["created_at"] == "2024"  # unknown SWE-bench fields are kept
    assert t.test_files == ["tests/test_m.py"]
    assert Task.from_json(t.to_json()) == t


def test_fail_to_pass_may_be_a_json_encoded_list():
    t = Task.from_json(record(FAIL_TO_PASS='["a.py::t1", "a.py::t2"]', PASS_TO_PASS="[]"))
    assert t.FAIL_TO_PASS == ("a.py::t1", "a.py::t2") and t.PASS_TO_PASS == ()


@pytest.mark.parametrize(("field", "value", "words"), [
    ("base_commit", "not-a-sha", "git commit"),
    ("repo", "", "required"),
    ("image", None, "required"),
    ("FAIL_TO_PASS", [], "at least one"),
    ("FAIL_TO_PASS", "not json", "JSON-encoded"),
    ("PASS_TO_PASS", ["tests/test_m.py::test_x"], "FAIL_TO_PASS too"),
    ("patch", "just text", "unified diff"),
    ("log_parser", "nope", "unknown parser"),
    ("setup_commands", [1], "list of non-empty strings"),
    ("hints_text", 3, "must be a string"),
])
def test_validation_errors_name_the_task_and_the_field(field, value, words):
    with pytest.raises(TaskError) as e:
        Task.from_json(record(**{field: value}))
    assert e.value.task == "demo__1" and e.value.field == field
    assert "demo__1" in str(e.value) and field in str(e.value) and words in str(e.value)


def test_a_bad_instance_id_is_named():
    with pytest.raises(TaskError) as e:
        Task.from_json(record(instance_id="has space"))
    assert e.value.field == "instance_id"


def test_jsonl_errors_carry_the_line(tmp_path):
    p = tmp_path / "set.jsonl"
    p.write_text(json.dumps(record()) + "\n\n" + json.dumps(record(instance_id="demo__2", repo="")) + "\n")
    with pytest.raises(TaskError) as e:
        load_tasks(p)
    assert f"{p}:3" in str(e.value) and e.value.task == "demo__2" and e.value.field == "repo"
    p.write_text("{not json\n")
    with pytest.raises(TaskError, match=":1: not valid JSON"):
        load_tasks(p)


def test_json_files_and_defaults(tmp_path):
    rec = record()
    del rec["image"], rec["test_command"]
    p = tmp_path / "set.json"
    p.write_text(json.dumps({"tasks": [rec]}))
    with pytest.raises(TaskError, match="image") as e:  # no version: no image name to derive
        load_tasks(p)
    assert e.value.field == "image" and "version" in str(e.value)
    [t] = load_tasks(p, defaults={"image": "img:1", "test_command": "pytest {tests}"})
    assert t.image == "img:1"


# A record as SWE-bench publishes it (the Hugging Face dataset's fields and encodings; a made-up instance).
PUBLISHED = {
    "repo": "astropy/astropy", "instance_id": "astropy__astropy-99999",
    "base_commit": "d16bfe05a744909de4b27f5875fe0d4ed41ce607",
    "patch": "diff --git a/astropy/m.py b/astropy/m.py\n--- a/astropy/m.py\n+++ b/astropy/m.py\n"
             "@@ -1 +1 @@\n-x = 1\n+x = 2\n",
    "test_patch": "diff --git a/astropy/tests/test_m.py b/astropy/tests/test_m.py\nnew file mode 100644\n"
                  "--- /dev/null\n+++ b/astropy/tests/test_m.py\n@@ -0,0 +1,2 @@\n+def test_x():\n+    pass\n",
    "problem_statement": "x should be 2", "hints_text": "", "created_at": "2022-03-03T15:14:54Z",
    "version": "4.3", "FAIL_TO_PASS": '["astropy/tests/test_m.py::test_x"]',
    "PASS_TO_PASS": '["astropy/tests/test_m.py::test_y", "astropy/tests/test_n.py::test_z[a-b]"]',
    "environment_setup_commit": "298ccb478e6bf092953bca67a3d29dc6c35f6752",
}


def test_a_published_swe_bench_record_loads_as_it_is(tmp_path):
    p = tmp_path / "swe-bench.jsonl"
    p.write_text(json.dumps(PUBLISHED) + "\n")
    [t] = load_tasks(p)
    assert t.FAIL_TO_PASS == ("astropy/tests/test_m.py::test_x",) and len(t.PASS_TO_PASS) == 2
    assert (t.version, t.environment_setup_commit) == ("4.3", PUBLISHED["environment_setup_commit"])
    assert t.metadata["created_at"] == "2022-03-03T15:14:54Z" and t.hints_text == ""
    assert t.image == "agentenv/swe-astropy__astropy:4.3"  # the naming rule: repository and version
    assert t.test_command == PYTEST_COMMAND and t.base_commit == PUBLISHED["base_commit"]
    assert t.gold_files == ["astropy/m.py"] and t.test_files == ["astropy/tests/test_m.py", "astropy/tests/test_n.py"]
    assert Task.from_json(t.to_json()) == t


def test_the_image_naming_rule_matches_what_the_image_builder_names():
    from envs.images import ImageRecipe

    assert image_name("pypi/toolz", "0.12.1") == "agentenv/swe-toolz:0.12.1"
    assert image_name("pypi/more-itertools", "10.5.0") == ImageRecipe("more-itertools", "10.5.0", "0" * 64).tag
    assert image_name("Owner/My_Repo", "1.0+local") == "agentenv/swe-owner__my_repo:1.0-local"


def test_base_commit_may_be_the_images_head():
    t = Task.from_json(record(base_commit="HEAD"))
    assert t.base_commit == HEAD and t.base_is_head
    rec = record()
    del rec["base_commit"]
    assert Task.from_json(rec).base_is_head  # omitted: the image's HEAD
    assert not Task.from_json(record()).base_is_head
    with pytest.raises(TaskError, match="or 'HEAD'"):
        Task.from_json(record(base_commit="main"))


def test_diff_paths_reads_both_headers():
    diff = PUBLISHED["test_patch"] + "--- a/old.py\n+++ /dev/null\n"
    assert diff_paths(diff) == ["astropy/tests/test_m.py", "old.py"]


def test_duplicates_are_refused_and_write_round_trips(tmp_path):
    t = Task.from_json(record())
    p = tmp_path / "out.jsonl"
    write_tasks([t, t], p)
    with pytest.raises(TaskError, match="duplicate"):
        load_tasks(p)
    write_tasks([t], p)
    assert load_tasks(p) == [t]
    assert resolve_task(str(p)) == t and resolve_task(f"{p}::demo__1") == t
    with pytest.raises(TaskError, match="no task"):
        resolve_task(f"{p}::other")


def test_log_parser_names_match_the_graders():
    assert set(grading.PARSERS) == {p for p in LOG_PARSERS if not p.startswith("parse_log_")}


def test_the_shipped_set_is_big_enough_and_well_formed():
    tasks = shipped_tasks()
    libs = Counter(t.metadata["library"] for t in tasks)
    assert len(tasks) >= 40 and len(libs) >= 5, libs
    for t in tasks:
        assert t.image.startswith("agentenv/swe-") and t.setup_commands and t.patch
        assert t.metadata["license"] in ("MIT", "BSD-3-Clause", "Apache-2.0")
        assert all("::" in x for x in t.FAIL_TO_PASS + t.PASS_TO_PASS)
        assert "{tests}" in t.test_command
