"""Each dataset's rules: how a record of it is recognised, what its fields are called here, and its image.

Where each rule comes from (read from the datasets' cards and harnesses; the fixtures in
``tests/unit/envs/data/datasets`` cite them record by record):

- SWE-bench: ``swebench.image_builder.image_spec.ImageSpec.name`` (swebench 5) and ``swebench.harness.test_spec``
  (4.x): ``swebench/sweb.eval.x86_64.<instance_id>:latest`` with ``__`` -> ``_1776_``, lowercased. 5.x rows carry
  ``image``, ``eval_script``, ``log_parser``, ``eval_type`` (``swebench.harness.utils.make_test_spec``).
- SWE-Gym: OpenHands' ``evaluation/benchmarks/swe_bench/run_infer.py`` (``get_instance_docker_image``, SWE-Gym's
  README points there): ``xingyaoww/sweb.eval.x86_64.<instance_id>`` with ``__`` -> ``_s_``, lowercased.
- SWE-smith: ``swesmith/profiles/base.py`` (``RepoProfile.image_name``):
  ``jyangballin/swesmith.x86_64.<owner>_1776_<repo>.<commit[:8]>``, lowercased; an instance id is
  ``<owner>__<repo>.<commit[:8]>.<bug>`` and its ``patch`` introduces the bug (``swesmith/harness/utils.py``
  applies it with ``--reverse`` as the gold fix).
- R2E-Gym: ``src/r2egym/repo_analysis/repo_testextract.py``: ``namanjain12/<repo_name>_final:<new commit>``, the
  repository at /testbed at the old commit, the tests in ``/r2e_tests`` and ``run_tests.sh`` in /testbed
  (``src/r2egym/agenthub/runtime/docker.py`` hides both from the agent and grades against
  ``expected_output_json``).
- SWE-rebench: SWE-rebench's SWE-bench fork (``swebench/harness/test_spec/test_spec.py``, ``--namespace
  swerebench``): ``swerebench/sweb.eval.x86_64.<instance_id lowercased>:latest`` with ``__`` -> ``_1776_``;
  ``install_config`` holds ``test_cmd`` and ``log_parser``. V2 rows name their image in ``image_name``.
- SWE-bench-extra: nebius/SWE-bench-extra's card: SWE-bench's fields with list-typed FAIL_TO_PASS / PASS_TO_PASS,
  an int ``version``, ``meta`` and ``license``; it publishes no images, so its records get agentenv's rule.
- agentenv: ``agentenv/swe-<name>:<version>`` (``pypi/NAME`` -> ``NAME``, ``OWNER/NAME`` -> ``owner__name``), what
  ``agentenv tasks images`` builds.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable, Mapping
from typing import Any

from envs.datasets.diffs import DiffError, reverse_diff
from envs.datasets.r2e import gold_patch as r2e_gold_patch

DATASETS = ("agentenv", "swe-bench", "swe-gym", "swe-smith", "r2e-gym", "swe-rebench", "swe-bench-extra")

# SWE-bench's repositories (full, Lite, Verified): the Python keys of swebench's MAP_REPO_TO_PARSER
SWE_BENCH_REPOS = frozenset({
    "astropy/astropy", "django/django", "marshmallow-code/marshmallow", "matplotlib/matplotlib", "mwaskom/seaborn",
    "pallets/flask", "psf/requests", "pvlib/pvlib-python", "pydata/xarray", "pydicom/pydicom", "pylint-dev/astroid",
    "pylint-dev/pylint", "pytest-dev/pytest", "pyvista/pyvista", "scikit-learn/scikit-learn", "sqlfluff/sqlfluff",
    "sphinx-doc/sphinx", "sympy/sympy"})
# SWE-Gym's eleven repositories (its paper's table 1), lowercased
SWE_GYM_REPOS = frozenset({
    "getmoto/moto", "project-monai/monai", "pandas-dev/pandas", "python/mypy", "dask/dask", "iterative/dvc",
    "conan-io/conan", "pydantic/pydantic", "facebookresearch/hydra", "bokeh/bokeh", "modin-project/modin"})
SMITH_ID = re.compile(r"(?P<owner>[^/]+?)__(?P<repo>[^/]+)\.(?P<sha>[0-9a-f]{8})\.(?P<bug>[^./]+)")
R2E_HIDDEN = ("/r2e_tests", "/testbed/run_tests.sh")
# what an R2E-Gym image leaves untracked in /testbed and git must not show as the agent's change
R2E_EXCLUDES = (".venv/", "r2e_tests", "run_tests.sh")


class RecordError(ValueError):
    """A record's ``field`` is wrong for its dataset; the message says how."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(message)


def agentenv_image(repo: str, version: str) -> str:
    """agentenv's own rule: ``agentenv/swe-<name>:<version>`` (see the module doc)."""
    name = repo.strip()
    name = name[len("pypi/"):] if name.startswith("pypi/") else name.replace("/", "__")
    name = re.sub(r"[^a-z0-9._-]+", "-", name.lower())
    return f"agentenv/swe-{name}:{re.sub(r'[^A-Za-z0-9_.-]+', '-', version.strip())}"


def _text(rec: Mapping[str, Any], name: str, why: str) -> str:
    v = rec.get(name)
    if not isinstance(v, str) or not v.strip():
        raise RecordError(name, f"required ({why}), a non-empty string; got {v!r}"[:300])
    return v


def _swe_bench_image(rec: Mapping[str, Any]) -> str:
    iid = _text(rec, "instance_id", "SWE-bench's image is named after it")
    return f"swebench/sweb.eval.x86_64.{iid}:latest".replace("__", "_1776_").lower()


def _swe_gym_image(rec: Mapping[str, Any]) -> str:
    iid = _text(rec, "instance_id", "SWE-Gym's image is named after it")
    return f"xingyaoww/sweb.eval.x86_64.{iid}".replace("__", "_s_").lower()


def _swe_smith_image(rec: Mapping[str, Any]) -> str:
    iid = _text(rec, "instance_id", "SWE-smith's image is named after its repository and commit")
    m = SMITH_ID.fullmatch(iid)
    if not m:
        raise RecordError("instance_id", f"a SWE-smith id is <owner>__<repo>.<commit[:8]>.<bug>, got {iid!r}; or "
                                         "give the image in 'image_name'")
    return f"jyangballin/swesmith.x86_64.{m['owner']}_1776_{m['repo']}.{m['sha']}".lower()


def _r2e_image(rec: Mapping[str, Any]) -> str:
    return f"namanjain12/{_text(rec, 'repo_name', 'R2E-Gym names its image after it')}_final:" \
           f"{_text(rec, 'commit_hash', 'R2E-Gym tags its image with it')}"


def _swe_rebench_image(rec: Mapping[str, Any]) -> str:
    iid = _text(rec, "instance_id", "SWE-rebench's image is named after it")
    return f"swerebench/sweb.eval.x86_64.{iid.lower()}:latest".replace("__", "_1776_")


def _agentenv_image(rec: Mapping[str, Any]) -> str:
    repo = _text(rec, "repo", "the image is named from the repository and version")
    version = rec.get("version")
    if not isinstance(version, str) or not version.strip():
        raise RecordError("image", "required when the record has no 'version' (the image is named from the "
                                   "repository and version: agentenv/swe-<name>:<version>)")
    return agentenv_image(repo, version)


IMAGE_RULES: dict[str, Callable[[Mapping[str, Any]], str]] = {
    "agentenv": _agentenv_image, "swe-bench": _swe_bench_image, "swe-gym": _swe_gym_image,
    "swe-smith": _swe_smith_image, "r2e-gym": _r2e_image, "swe-rebench": _swe_rebench_image,
    "swe-bench-extra": _agentenv_image}
# the fields a dataset publishes its image under, first found wins (before its rule)
IMAGE_FIELDS = {"swe-smith": ("image_name",), "r2e-gym": ("docker_image",),
                "swe-rebench": ("docker_image", "image_name")}


def image_for(dataset: str, record: Mapping[str, Any]) -> str:
    """The image a record of ``dataset`` runs in: its ``image`` field, else the one its dataset publishes it
    under, else the dataset's naming rule."""
    for name in ("image", *IMAGE_FIELDS.get(dataset, ())):
        v = record.get(name)
        if v is not None:
            if not isinstance(v, str) or not v.strip():
                raise RecordError(name, f"an image name, a non-empty string; got {v!r}"[:300])
            return v.strip()
    return IMAGE_RULES[_known(dataset)](record)


def _known(dataset: Any) -> str:
    if dataset not in DATASETS:
        raise RecordError("dataset", f"unknown dataset {dataset!r}; known: {', '.join(DATASETS)}")
    return str(dataset)


def record_id(record: Mapping[str, Any]) -> str:
    """The id a record's task gets: its ``instance_id``; R2E-Gym's rows have none: ``<repo_name>__<commit_hash>``
    ("" when a record has neither)."""
    iid = record.get("instance_id") or record.get("id")
    if not iid and record.get("repo_name") and record.get("commit_hash"):
        return f"{record['repo_name']}__{record['commit_hash']}"
    return str(iid or "")


def detect(record: Mapping[str, Any]) -> str:
    """The dataset a record comes from, by its fields: a ``dataset`` field names it; R2E-Gym's
    ``expected_output_json`` / ``parsed_commit_content``; SWE-rebench's ``install_config``; SWE-smith's
    ``image_name`` with a SWE-smith id; SWE-bench 5's ``eval_script`` / ``eval_type``; agentenv's
    ``test_command`` / ``setup_commands``; SWE-bench-extra's ``meta`` (``is_lite``, ...); then the repository
    (SWE-Gym's and SWE-bench's) or FAIL_TO_PASS as a JSON string (SWE-bench's Hugging Face rows); else agentenv."""
    if "dataset" in record:
        return _known(record["dataset"])
    if "expected_output_json" in record or "parsed_commit_content" in record:
        return "r2e-gym"
    if "install_config" in record:
        return "swe-rebench"
    iid = record.get("instance_id")
    if "image_name" in record and isinstance(iid, str) and SMITH_ID.fullmatch(iid):
        return "swe-smith"
    if "eval_script" in record or "eval_type" in record:
        return "swe-bench"
    if "test_command" in record or "setup_commands" in record:
        return "agentenv"
    meta = record.get("meta")
    if isinstance(meta, Mapping) and ({"is_lite", "failed_lite_validators", "has_test_patch"} & set(meta)):
        return "swe-bench-extra"
    repo = str(record.get("repo") or "").lower()
    if repo in SWE_GYM_REPOS:
        return "swe-gym"
    if repo in SWE_BENCH_REPOS or isinstance(record.get("FAIL_TO_PASS"), str):
        return "swe-bench"
    return "agentenv"


def adapt(record: Mapping[str, Any], dataset: str | None = None) -> dict[str, Any]:
    """``record`` in the Task's field names (see the package doc); every published field is kept. Idempotent:
    a record already in the Task's names (``Task.to_json``) comes back unchanged but for what it lacked."""
    name = _known(dataset) if dataset is not None else detect(record)
    rec = dict(record)
    if rec.get("dataset", name) != name:
        raise RecordError("dataset", f"the record says {rec['dataset']!r} but {name!r} was asked for")
    rec["dataset"] = name
    version = rec.get("version")
    if isinstance(version, int | float) and not isinstance(version, bool):
        rec["version"] = str(version)  # SWE-bench-extra publishes an int; some dumps 3.0 as a number
    if name == "r2e-gym":
        _r2e(rec)
    if name == "swe-smith" and "bug_patch" not in rec:
        bug = _text(rec, "patch", "SWE-smith's patch introduces the bug; its reverse is the gold fix")
        try:
            rec["patch"], rec["bug_patch"] = reverse_diff(bug), bug
        except DiffError as e:
            raise RecordError("patch", f"cannot be reversed into the gold fix: {e}") from None
        # its base_commit is the instance branch's commit on GitHub, not in the image: kept as `branch_commit`;
        # here the bug is applied to the image's HEAD at reset
        if "base_commit" in rec:
            rec["branch_commit"] = rec["base_commit"]
        rec["base_commit"] = "HEAD"
    if name == "swe-rebench":
        config = rec.get("install_config")
        if not isinstance(config, Mapping):
            raise RecordError("install_config", f"must be an object (test_cmd, log_parser, ...), got "
                                                f"{type(config).__name__}")
        if "log_parser" not in rec and isinstance(config.get("log_parser"), str):
            rec["log_parser"] = config["log_parser"]
    if name != "agentenv":
        rec.setdefault("log_parser", "")  # the dataset's harness chooses by repository (SWE-bench 4.x rows)
    rec["image"] = image_for(name, rec)
    return rec


def _r2e(rec: dict[str, Any]) -> None:
    """R2E-Gym's rows: no instance id, repository, gold patch or FAIL_TO_PASS of SWE-bench's kind; derive them."""
    if "instance_id" not in rec or "repo" not in rec:
        repo = _text(rec, "repo_name", "R2E-Gym's repository")
        _text(rec, "commit_hash", "R2E-Gym names its instances by it")
        rec.setdefault("instance_id", record_id(rec))
        rec.setdefault("repo", repo)
    expected = rec.get("expected_output_json")
    if not isinstance(expected, str):
        raise RecordError("expected_output_json", f"R2E-Gym grades against it: a JSON object (test -> status) in a "
                                                  f"string, got {type(expected).__name__}")
    parsed: dict[str, Any] = {}
    if "patch" not in rec or "base_commit" not in rec:
        try:
            parsed = json.loads(_text(rec, "parsed_commit_content", "the gold patch is read from it"))
        except ValueError as e:
            raise RecordError("parsed_commit_content", f"not valid JSON: {e}") from None
        if not isinstance(parsed, dict):
            raise RecordError("parsed_commit_content", "must be a JSON object (R2E-Gym's ParsedCommit)")
    if "patch" not in rec:
        try:
            rec["patch"] = r2e_gold_patch(parsed)
        except ValueError as e:
            raise RecordError("parsed_commit_content", str(e)) from None
    old = parsed.get("old_commit_hash")
    base = rec.setdefault("base_commit", old if isinstance(old, str) and old else "HEAD")
    rec.setdefault("FAIL_TO_PASS", [])
    rec.setdefault("hidden_paths", list(R2E_HIDDEN))
    if "setup_commands" not in rec:  # no `git clean`: the image's venv and test runner are untracked in /testbed
        b = shlex.quote(base)
        rec["setup_commands"] = [
            f"git cat-file -e {b}^{{commit}} && git checkout -q -f {b}",
            "mkdir -p .git/info && printf '%s\\n' " + " ".join(shlex.quote(x) for x in R2E_EXCLUDES)
            + " >> .git/info/exclude"]
