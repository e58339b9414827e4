"""The official harness's process: ``swebench`` (4.1.0 or 5.0.2) used as a library, offline, one request batch.

Run by ``envs.grading.runners.official`` as ``python -I -S official_worker.py FOLDER`` with a JSON list of
requests on stdin; it answers a JSON list on stdout. ``FOLDER`` holds one pinned ``swebench`` (and
``unidiff``), installed with ``pip install --no-deps --target`` (scripts/bootstrap.sh): 4.x and 5.x cannot share
an environment, so each version is its own folder and its own process, and neither is ever imported by ``envs``.

Only the modules the grading needs are loaded (constants, log parsers, grading, the eval-script builders),
under package objects made here, because ``swebench``'s and ``swebench.harness``'s ``__init__`` import docker,
datasets and modal. What those modules import but the grading never calls — ``datasets``, ``docker``,
``modal``, ``requests``, ``dotenv``, ``tqdm``, ``ghapi`` — is replaced by stand-ins that raise when used:
nothing here can reach a network, so nothing hangs offline (4.x's ``make_test_spec`` fetches requirements
from GitHub for its environment script; the eval script, built here by ``make_eval_script_list``, needs none).
This file uses the standard library only, and is not imported by the package (it is run as a program).

Requests (``op``):
- ``version``: the package's version, read from the folder;
- ``eval_script`` (4.x): the eval script ``make_eval_script_list`` builds for ``instance`` with ``specs`` (or
  the package's own ``MAP_REPO_VERSION_TO_SPECS[repo][version]``), as ``TestSpec.eval_script`` renders it;
  ``directives: "rebench"`` takes test directives as SWE-rebench's fork does;
- ``report``: ``get_eval_report`` on ``log`` for ``spec`` (the fields its ``TestSpec`` needs), with the status
  map ``get_logs_eval`` read; ``flavour: "rebench"`` grades as SWE-rebench's fork does (the record's
  ``install_config.log_parser``; no whole-log fallback), with 4.x's parsers and report functions;
- ``verdict``: ``get_eval_tests_report`` and ``get_resolution_status`` on a status map;
- ``parse``: one log parser by name on a text.
"""

import importlib.util
import json
import os
import re
import sys
import tempfile
import types

_STUBBED = ("datasets", "docker", "docker.errors", "docker.models", "docker.models.containers", "modal", "requests",
            "requests.adapters", "dotenv", "tqdm", "tqdm.auto", "ghapi", "ghapi.all", "git", "bs4", "chardet")


class _Offline(types.ModuleType):
    """A stand-in for a module the grading imports but never needs: using it raises."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if self.__name__ == "dotenv" and name == "load_dotenv":
            return lambda *a, **k: False  # called at import by swebench.harness.utils: a no-op here

        def refuse(*args, **kwargs):
            raise RuntimeError(f"{self.__name__}.{name} is not available in the official-harness process "
                               "(it runs offline, with the grading modules only)")
        return type(name, (), {"__init__": refuse, "__call__": refuse}) if name[:1].isupper() else refuse


def _load(folder):
    """Package objects for ``swebench`` and ``swebench.harness`` (their ``__init__`` files are not run)."""
    sys.path[:0] = [folder]
    for name in _STUBBED:
        sys.modules[name] = _Offline(name)
    root = os.path.join(folder, "swebench")
    for name, path in (("swebench", root), ("swebench.harness", os.path.join(root, "harness"))):
        pkg = types.ModuleType(name)
        pkg.__path__ = [path]
        sys.modules[name] = pkg
    with open(os.path.join(root, "__init__.py"), encoding="utf-8") as f:
        m = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", f.read())
    sys.modules["swebench"].__version__ = m.group(1) if m else "unknown"  # type: ignore[attr-defined]


def _module(name):
    return importlib.import_module(name)


def _rebench_directives(instance):
    """SWE-rebench's fork: the test patch's changed files (not deleted ones), less the non-test extensions."""
    import io

    from unidiff import PatchSet

    constants = _module("swebench.harness.constants")
    files = [f.path for f in PatchSet(io.StringIO(instance["test_patch"])) if not f.is_removed_file]
    return [d for d in files if not any(d.endswith(ext) for ext in constants.NON_TEST_EXTS)]


def _eval_script(req):
    constants = _module("swebench.harness.constants")
    instance = req["instance"]
    repo, version = instance["repo"], instance["version"]
    specs = req.get("specs")
    if specs is not None:  # a record's own specs (SWE-rebench's install_config, SWE-Gym's): read from the table
        constants.MAP_REPO_VERSION_TO_SPECS.setdefault(repo, {})[version] = specs
        constants.MAP_REPO_TO_EXT.setdefault(repo, "py")
    else:
        specs = constants.MAP_REPO_VERSION_TO_SPECS[repo][version]
    py = _module("swebench.harness.test_spec.python")
    if req.get("directives") == "rebench":
        py.get_test_directives = _rebench_directives
    scripts = _module("swebench.harness.test_spec.create_scripts")
    lines = scripts.make_eval_script_list(instance, specs, "testbed", "/testbed", instance["base_commit"],
                                          instance["test_patch"])
    return {"script": "\n".join(["#!/bin/bash", "set -uxo pipefail", *lines]) + "\n",
            "install": specs.get("install") or ""}


def _spec(req):
    s = req["spec"]
    major = sys.modules["swebench"].__version__.split(".")[0]
    if major == "5":
        types5 = _module("swebench.types")
        return types5.TestSpec(instance_id=s["instance_id"], image=s.get("image", ""), eval_script_list=[],
                               repo=s["repo"], version=s["version"], FAIL_TO_PASS=s["FAIL_TO_PASS"],
                               PASS_TO_PASS=s["PASS_TO_PASS"], log_parser=s["log_parser"], eval_type=s["eval_type"])
    constants = _module("swebench.harness.constants")
    parsers = _module("swebench.harness.log_parsers")
    if s.get("parser"):  # a repository the package does not know (SWE-Gym): graded with the parser named
        py = _module("swebench.harness.log_parsers.python")
        parsers.MAP_REPO_TO_PARSER.setdefault(s["repo"], getattr(py, s["parser"]))
        constants.MAP_REPO_VERSION_TO_SPECS.setdefault(s["repo"], {}).setdefault(s["version"], {"test_cmd": ""})
    ts = _module("swebench.harness.test_spec.test_spec")
    return ts.TestSpec(instance_id=s["instance_id"], repo=s["repo"], version=s["version"], repo_script_list=[],
                       eval_script_list=[], env_script_list=[], arch="x86_64", FAIL_TO_PASS=s["FAIL_TO_PASS"],
                       PASS_TO_PASS=s["PASS_TO_PASS"], language="py", docker_specs={}, namespace=None)


def _rebench_report(req, path):
    """SWE-rebench's fork's ``get_logs_eval`` and ``get_eval_report``, on 4.x's parsers and report functions."""
    constants = _module("swebench.harness.constants")
    grading = _module("swebench.harness.grading")
    py = _module("swebench.harness.log_parsers.python")
    s = req["spec"]
    with open(path, encoding="utf-8") as f:
        content = f.read()
    out = {"patch_is_None": False, "patch_exists": True, "patch_successfully_applied": False, "resolved": False}
    bad = [c for c in (constants.APPLY_PATCH_FAIL, constants.RESET_FAILED, constants.TESTS_ERROR,
                       constants.TESTS_TIMEOUT) if c in content]
    if bad or constants.START_TEST_OUTPUT not in content or constants.END_TEST_OUTPUT not in content:
        return {}, False, out
    parser = py.MAP_REPO_TO_PARSER_PY.get(s["log_parser"]) or getattr(py, s["log_parser"])
    body = content.split(constants.START_TEST_OUTPUT)[1].split(constants.END_TEST_OUTPUT)[0]
    sm = parser(body, None)
    out["patch_successfully_applied"] = True
    eval_type = constants.EvalType.FAIL_ONLY if s["repo"] in constants.FAIL_ONLY_REPOS else \
        constants.EvalType.PASS_AND_FAIL
    report = grading.get_eval_tests_report(sm, {"FAIL_TO_PASS": s["FAIL_TO_PASS"],
                                                "PASS_TO_PASS": s["PASS_TO_PASS"]}, eval_type=eval_type)
    out["resolved"] = grading.get_resolution_status(report) == constants.ResolvedStatus.FULL.value
    out["tests_status"] = report
    return sm, True, out


def _report(req):
    grading = _module("swebench.harness.grading")
    with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False, encoding="utf-8",
                                     errors="surrogateescape") as f:
        f.write(req["log"])
    try:
        if req.get("flavour") == "rebench":
            sm, found, report = _rebench_report(req, f.name)
        else:
            spec = _spec(req)
            sm, found = grading.get_logs_eval(spec, f.name)
            pred = {"instance_id": spec.instance_id, "model_patch": "", "model_name_or_path": "agentenv"}
            report = grading.get_eval_report(spec, pred, f.name, True)[spec.instance_id]
    finally:
        os.unlink(f.name)
    return {"statuses": sm, "found": found, "report": report}


def _verdict(req):
    constants = _module("swebench.harness.constants")
    grading = _module("swebench.harness.grading")
    gold = {"FAIL_TO_PASS": req["FAIL_TO_PASS"], "PASS_TO_PASS": req["PASS_TO_PASS"]}
    report = grading.get_eval_tests_report(req["statuses"], gold, eval_type=constants.EvalType(req["eval_type"]))
    return {"tests_status": report, "resolution": grading.get_resolution_status(report)}


def _parse(req):
    major = sys.modules["swebench"].__version__.split(".")[0]
    parsers = _module("swebench.harness.log_parsers")
    if major == "5":
        fn = parsers.PARSER_REGISTRY[req["parser"]]
    else:
        fn = getattr(_module("swebench.harness.log_parsers.python"), req["parser"])
    return {"statuses": fn(req["log"], None)}


_OPS = {"eval_script": _eval_script, "report": _report, "verdict": _verdict, "parse": _parse,
        "version": lambda req: {"version": sys.modules["swebench"].__version__}}


def main():
    _load(sys.argv[1])
    requests = json.loads(sys.stdin.buffer.read().decode("utf-8", "surrogateescape"))
    answers = []
    for req in requests:
        try:
            answers.append({"ok": True, **_OPS[req["op"]](req)})
        except Exception as e:  # one bad request answers with its error; the others still run
            answers.append({"ok": False, "error": f"{type(e).__name__}: {e}"})
    sys.stdout.buffer.write(json.dumps(answers).encode("utf-8", "surrogateescape"))


if __name__ == "__main__":
    main()
