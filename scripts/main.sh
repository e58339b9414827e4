#!/usr/bin/env bash
# The main job on the embedded defaults: bootstrap the host, then run the platform's demo.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/bootstrap.sh"
exec "$ROOT/.venv/bin/agentenv" tour "$@"
