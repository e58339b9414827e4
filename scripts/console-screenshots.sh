#!/usr/bin/env bash
# Retake the screenshots of docs/console.md and docs/viewer.md (docs/console/*.png): the console's and the viewer's
# browser tests take them as they run, into docs/console/ with AGENTENV_SCREENSHOTS=1 (a scratch folder otherwise).
# Needs a bootstrapped checkout (scripts/bootstrap.sh: Chromium, chromium-driver, Docker). Commit the pictures that
# changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
for f in tests/integration/console/test_*.py; do  # one at a time: each starts a server and a browser of its own
  AGENTENV_SCREENSHOTS=1 "${PYTHON:-$ROOT/.venv/bin/python}" -m pytest -q -p no:cacheprovider "$f"
done
git status --short docs/console/
