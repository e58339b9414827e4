#!/usr/bin/env bash
# The main job on the embedded defaults: bootstrap the host, then train k3-mini with RL end to end
# (trainer/configs/main.toml: SFT warm start, GRPO on Lookup-v0 with groups forked from one reset, held-out
# evaluation before and after RL, one SWE-v0 iteration), writing runs/main/.
# Arguments go to `agentenv train`: --quick (the few-minute CI variant), --seed N, --name NAME, --dry-run,
# --resume, --policy-url URL, --ray-address HOST:PORT, --set section.key=value. The sandbox tour: `agentenv tour`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/agentenv" train --config "$ROOT/trainer/configs/main.toml" "$@"
