#!/usr/bin/env bash
# The whole test suite: bootstrap the host, lint and type-check, then unit and integration tests.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
scripts/bootstrap.sh
VENV="$ROOT/.venv/bin"
echo "== ruff";  "$VENV/ruff" check .
echo "== mypy";  "$VENV/mypy" agentenv envs policy rollout trainer bench tests/typecheck
echo "== pytest"
# pytest exits 5 when it collected no test: that is a failure here, like any non-zero exit.
"$VENV/python" -m pytest -p no:cacheprovider tests "$@"
