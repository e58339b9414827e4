#!/usr/bin/env bash
# Builds the base image agentenv/base offline (no container registry is reachable):
# a debootstrap rootfs with python3 (also as `python`, as in E2B's base image), git, pip and the tools a coding agent
# needs, and E2B's `user` account, imported
# with `docker import`. Skipped when an image built from the same inputs is present.
set -euo pipefail

IMAGE="${AGENTENV_BASE_IMAGE:-agentenv/base}"
SUITE="$(. /etc/os-release && echo "$VERSION_CODENAME")"
MIRROR="${AGENTENV_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
PACKAGES="python3,python-is-python3,python3-pip,python3-venv,python3-pytest,git,ca-certificates,procps,psmisc,less,patch,diffutils,findutils,grep,sed,gawk,curl,make,file,tree,ripgrep,jq,xz-utils,bzip2,unzip"
# The hash of every input: a change to this script or the package list rebuilds the image.
HASH="$( { echo "$SUITE $PACKAGES"; cat "${BASH_SOURCE[0]}"; } | sha256sum | cut -c1-16)"
DOCKER=/usr/bin/docker

have="$($DOCKER image inspect "$IMAGE" --format '{{index .Config.Labels "agentenv.inputs"}}' 2>/dev/null || true)"
if [ "$have" = "$HASH" ]; then
    echo "[base-image] $IMAGE is up to date ($HASH)"
    exit 0
fi

work="$(mktemp -d /var/tmp/agentenv-rootfs.XXXXXX)"
trap 'rm -rf "$work"' EXIT
echo "[base-image] debootstrap $SUITE into $work (about a minute)"
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$work/rootfs" "$MIRROR" >"$work/debootstrap.log" 2>&1 \
    || { tail -n 30 "$work/debootstrap.log" >&2; echo "[base-image] debootstrap failed" >&2; exit 1; }
rm -rf "$work/rootfs"/var/cache/apt/archives/*.deb "$work/rootfs"/var/lib/apt/lists/*
mkdir -p "$work/rootfs/testbed"
# E2B's account: uid 1000 with its own group and /home/user, what E2B's templates run commands as by default.
chroot "$work/rootfs" useradd --create-home --uid 1000 --user-group --shell /bin/bash user
echo "[base-image] docker import -> $IMAGE"
tar -C "$work/rootfs" -c . | $DOCKER import \
    --change "LABEL agentenv.inputs=$HASH" \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'WORKDIR /testbed' \
    --change 'CMD ["/bin/bash"]' \
    - "$IMAGE" >/dev/null
echo "[base-image] built $IMAGE ($HASH)"
