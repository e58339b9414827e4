#!/usr/bin/env bash
# Builds agentenv/code-interpreter, the image of E2B's code-interpreter templates: agentenv/base plus the data stack
# people chart with (numpy, pandas, matplotlib; scripts/code-interpreter/requirements.txt, every package pinned).
# The wheels come from the package index on the host (pip's cache keeps them); the build itself runs without a
# network and installs only those wheels. Skipped when an image built from the same inputs (this script, the pins,
# the base image) is present.
set -euo pipefail

IMAGE="${AGENTENV_CODE_INTERPRETER_IMAGE:-agentenv/code-interpreter}"
BASE="${AGENTENV_BASE_IMAGE:-agentenv/base}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PINS="$HERE/code-interpreter/requirements.txt"
PIP="${AGENTENV_PIP:-python3 -m pip}"
DOCKER=/usr/bin/docker

base_id="$($DOCKER image inspect "$BASE" --format '{{.Id}}')"
HASH="$( { echo "$base_id"; cat "${BASH_SOURCE[0]}" "$PINS"; } | sha256sum | cut -c1-16)"
have="$($DOCKER image inspect "$IMAGE" --format '{{index .Config.Labels "agentenv.inputs"}}' 2>/dev/null || true)"
if [ "$have" = "$HASH" ]; then
    echo "[code-interpreter-image] $IMAGE is up to date ($HASH)"
    exit 0
fi

# the wheels for the image's own python, whichever Debian the base image is
pyver="$($DOCKER run --rm --network none "$BASE" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
work="$(mktemp -d /var/tmp/agentenv-code-interpreter.XXXXXX)"
trap 'rm -rf "$work"' EXIT
mkdir "$work/wheels"
cp "$PINS" "$work/wheels/requirements.txt"
echo "[code-interpreter-image] wheels for python $pyver"
$PIP download --quiet --only-binary=:all: --python-version "$pyver" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --no-deps -r "$PINS" -d "$work/wheels"
cat >"$work/Dockerfile" <<DOCKERFILE
FROM $BASE
COPY wheels /tmp/wheels
RUN python3 -m pip install --no-index --no-deps --find-links /tmp/wheels --break-system-packages \
        --no-compile -r /tmp/wheels/requirements.txt \
    && rm -rf /tmp/wheels /root/.cache \
    && MPLBACKEND=Agg python3 -c 'import numpy, pandas, matplotlib.pyplot'
LABEL agentenv.inputs=$HASH
DOCKERFILE
echo "[code-interpreter-image] docker build -> $IMAGE"
$DOCKER build --quiet --network none --tag "$IMAGE" "$work" >/dev/null
echo "[code-interpreter-image] built $IMAGE ($HASH)"
