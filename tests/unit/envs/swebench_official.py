"""The official SWE-bench package's pytest log parser, loaded without ``swebench.harness``'s heavy ``__init__``
(it pulls in docker, datasets and modal), for the tests that cross-check our parsers against it (unit and
integration). The package is a test-only dependency (``pip install --no-deps swebench``); without it the
calling test is skipped."""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest

SWEBENCH_PASSING = {"PASSED", "XFAIL"}  # swebench.harness.grading.test_passed


def load_swebench_parser() -> tuple[Callable[[str, object], dict[str, str]], str]:
    """``swebench.harness.log_parsers.python.parse_log_pytest`` and the package version, without importing
    ``swebench.harness`` (whose ``__init__`` pulls in docker, datasets and modal)."""
    spec = importlib.util.find_spec("swebench")
    if spec is None or spec.origin is None:
        pytest.skip("the swebench package is not installed (pip install --no-deps swebench)")
    root = Path(spec.origin).parent
    saved = {k: sys.modules.get(k) for k in ("swebench", "swebench.harness", "swebench.harness.constants",
                                             "swebench.types", "swebench.harness.log_parsers.python")}
    try:
        import swebench

        harness = types.ModuleType("swebench.harness")
        harness.__path__ = [str(root / "harness")]
        sys.modules["swebench.harness"] = harness
        for name, path in (("swebench.harness.constants", root / "harness" / "constants" / "__init__.py"),
                           ("swebench.types", root / "types.py"),
                           ("swebench.harness.log_parsers.python", root / "harness" / "log_parsers" / "python.py")):
            mod_spec = importlib.util.spec_from_file_location(name, path)
            assert mod_spec is not None and mod_spec.loader is not None
            module = importlib.util.module_from_spec(mod_spec)
            sys.modules[name] = module
            mod_spec.loader.exec_module(module)
        return module.parse_log_pytest, swebench.__version__
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
