#!/usr/bin/env bash
# Host bootstrap for agentenv, idempotent: a second run finishes in seconds.
#   Docker engine (Debian's docker.io, experimental on), CRIU >= 4 (built from Debian's
#   source tarball where the packaged one fails `criu check`), the offline base image
#   agentenv/base, btrfs-progs for the sandbox volume (disk limits), and the project's virtual
#   environment (.venv) with its test extras.
# Usage: scripts/bootstrap.sh [--skip-venv]      (as root, on Debian 12 or 13)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${AGENTENV_CACHE:-/var/cache/agentenv}"
CRIU_VERSION="4.1.1"
CRIU_SHA256="f80a66cb3726bb2116266d4759ce3bcbfab7abdb6b6d430bf20dd41911717afe"
SKIP_VENV=0
[ "${1:-}" = "--skip-venv" ] && SKIP_VENV=1

log() { printf '\033[1m[bootstrap]\033[0m %s\n' "$*"; }
die() { printf '[bootstrap] error: %s\n' "$*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "run as root"
export DEBIAN_FRONTEND=noninteractive
mkdir -p "$CACHE"

APT_UPDATED=0
apt_install() {  # apt_install PKG... : installs only what is missing
    local missing=()
    for p in "$@"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p"); done
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ "$APT_UPDATED" = 0 ]; then log "apt-get update"; apt-get update -qq; APT_UPDATED=1; fi
    log "installing ${missing[*]}"
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

version_ge() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" = "$2" ]; }

# --- 1. Docker engine -------------------------------------------------------------------
apt_install docker.io runc containerd iptables iproute2 nftables util-linux debootstrap tar xz-utils ca-certificates
# The sandbox volume (agentenv/host/volume.py): a sparse btrfs image on a loop device, with quotas, that agentenv
# makes under each AGENTENV_HOME on first use. This kernel has no XFS quotas and no ext4 quota format.
apt_install btrfs-progs
# The web console's browser tests (tests/integration/console): headless Chromium driven through Debian's own
# chromedriver (Selenium is pointed at /usr/bin/chromedriver, so it never downloads a browser).
apt_install chromium chromium-driver
# A registry for the image-fetching tests (tests/integration/test_image_store.py): Debian's docker-registry, which
# each test starts itself on a loopback port (Docker treats 127.0.0.0/8 registries as insecure: no TLS). The
# package's own service would listen on every address: it is kept off.
if ! dpkg-query -W -f='${Status}' docker-registry 2>/dev/null | grep -q "ok installed"; then
    apt_install docker-registry
    if command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
        systemctl disable --now docker-registry.service >/dev/null 2>&1 || true
    fi
fi
modprobe -q loop 2>/dev/null || true
modprobe -q btrfs 2>/dev/null || true
# Sandboxes run in user namespaces (agentenv/host/userns.py). A lazy restore's CRIU opens a userfaultfd from inside
# one, which needs this; the sandboxes' own code cannot use it (their seccomp filter refuses the system call).
if [ "$(cat /proc/sys/vm/unprivileged_userfaultfd 2>/dev/null)" != 1 ]; then
    echo 'vm.unprivileged_userfaultfd = 1' >/etc/sysctl.d/60-agentenv-userfaultfd.conf
    sysctl -q -w vm.unprivileged_userfaultfd=1 || log "could not set vm.unprivileged_userfaultfd: restores are eager"
fi
mkdir -p /etc/docker
if ! grep -q '"experimental": *true' /etc/docker/daemon.json 2>/dev/null; then
    echo '{"experimental": true, "storage-driver": "overlay2"}' >/etc/docker/daemon.json
fi
DOCKER=/usr/bin/docker
if ! $DOCKER info >/dev/null 2>&1; then
    log "starting dockerd"
    if command -v systemctl >/dev/null && systemctl is-system-running >/dev/null 2>&1; then
        systemctl restart docker
    else
        # a dockerd still starting up or shutting down gets ten seconds to settle; one that never
        # answers is replaced
        for _ in $(seq 20); do
            pgrep -x dockerd >/dev/null || break
            $DOCKER info >/dev/null 2>&1 && break
            sleep 0.5
        done
        if ! $DOCKER info >/dev/null 2>&1; then
            pkill -x dockerd 2>/dev/null || true
            for _ in $(seq 40); do pgrep -x dockerd >/dev/null || break; sleep 0.5; done
            rm -f /var/run/docker.pid  # left by a killed dockerd; its pid may belong to another process now
            nohup dockerd >>/var/log/agentenv-dockerd.log 2>&1 &
        fi
    fi
    for _ in $(seq 120); do $DOCKER info >/dev/null 2>&1 && break; sleep 0.5; done
    $DOCKER info >/dev/null 2>&1 || die "dockerd did not answer within 60 s; see /var/log/agentenv-dockerd.log"
fi
log "docker $($DOCKER version --format '{{.Server.Version}}') is up"

# --- 2. CRIU >= 4 -------------------------------------------------------------------------
# Patches to 4.1.1 (scripts/criu-patches): kernels >= 6.16 answer EOPNOTSUPP for SO_PASSCRED on
# TCP sockets, which makes CRIU 4.1.1 fail to dump any process holding one (0001); --empty-ns net also
# skips the namespace's conntrack tables, ~20 ms of every memory snapshot (0002, see agentenv/snapshot/criu.py);
# CRIU's helper tasks no longer share fs with their parent, which made the restore of any sandbox with a
# process whose session leader had exited ('cmd &') fail (0003, upstream c7395f4, in CRIU 4.2); an empty
# read-only tmpfs (runc's mask over /proc/acpi, /sys/firmware...) is saved and restored without running tar,
# 3-4 ms each of every dump and every restore (0004); a tree in a user namespace whose non-dumpable agent CRIU
# had restored could not be dumped again (0005: its check that the namespaces belong to the user namespace);
# $CRTOOLS_SCRIPT_ACTIONS limits action scripts to the actions it names (0006: one shell run per restore, not six).
# A lazy dump's page server (post-copy) works without CAP_SYS_RESOURCE (0007: its pipe within fs.pipe-max-size).
# RUNDIR: where CRIU caches its kernel probe (criu.kdat, ~30 ms a run); it keeps it only on a tmpfs,
# and /run is not always one, so our build uses a small tmpfs of its own (mounted by agentenv).
CRIU_RUNDIR=/run/agentenv-criu
PATCH_STAMP="$( { cat "$ROOT"/scripts/criu-patches/*.patch; echo "RUNDIR=$CRIU_RUNDIR"; } | sha256sum | cut -c1-16)"
criu_ok() {  # our patched build (no release has 0005)
    command -v criu >/dev/null 2>&1 || return 1
    criu check >/dev/null 2>&1 || return 1
    [ "$(command -v criu)" = /usr/local/sbin/criu ] && [ "$(cat "$CACHE/criu.patches" 2>/dev/null)" = "$PATCH_STAMP" ]
}
build_criu() {
    local src="$CACHE/criu-$CRIU_VERSION"
    if [ ! -x "$src/criu/criu" ] || [ "$(cat "$src/.patches" 2>/dev/null)" != "$PATCH_STAMP" ]; then
        log "building CRIU $CRIU_VERSION from Debian's source tarball (about a minute)"
        apt_install build-essential patch pkg-config libprotobuf-dev libprotobuf-c-dev protobuf-c-compiler \
            protobuf-compiler python3-protobuf libnl-3-dev libnet1-dev libcap-dev libaio-dev libbsd-dev \
            libgnutls28-dev libnftables-dev uuid-dev libdrm-dev dpkg-dev
        local tarball="$CACHE/criu_$CRIU_VERSION.orig.tar.xz"
        if [ ! -f "$tarball" ] || ! echo "$CRIU_SHA256  $tarball" | sha256sum -c --status; then
            install -m 644 "$ROOT/scripts/trixie-src.sources" /etc/apt/sources.list.d/agentenv-trixie-src.sources
            apt-get update -qq
            # The .dsc and .debian.tar.xz may answer 404 while the upstream tarball arrives: check it, go on.
            (cd "$CACHE" && apt-get source --download-only criu/trixie >/dev/null 2>&1) || true
        fi
        [ -f "$tarball" ] || die "could not fetch criu_$CRIU_VERSION.orig.tar.xz"
        echo "$CRIU_SHA256  $tarball" | sha256sum -c --status || die "sha256 mismatch for $tarball"
        rm -rf "$src" && tar -C "$CACHE" -xf "$tarball"
        for p in "$ROOT"/scripts/criu-patches/*.patch; do patch -d "$src" -p1 -s <"$p" || die "patch $p failed"; done
        make -C "$src" -j"$(nproc)" criu RUNDIR="$CRIU_RUNDIR" >"$CACHE/criu-build.log" 2>&1 \
            || die "CRIU build failed: $CACHE/criu-build.log"
        make -C "$src" lib >>"$CACHE/criu-build.log" 2>&1 || die "pycriu build failed: $CACHE/criu-build.log"
        echo "$PATCH_STAMP" >"$src/.patches"
    fi
    install -m 0755 "$src/criu/criu" /usr/local/sbin/criu
    echo "$PATCH_STAMP" >"$CACHE/criu.patches"
    rm -rf "$CACHE/pycriu" && cp -r "$src/lib/pycriu" "$CACHE/pycriu"
}
if ! criu_ok; then
    build_criu   # Debian 12's 3.17 fails on this kernel; 13's 4.1.1 lacks the 6.16+ socket fix
    criu_ok || die "criu check still fails: run 'criu check' to see why"
fi
log "criu $(criu --version | awk '/^Version/{print $2}') passes criu check"

# --- 3. Base image ------------------------------------------------------------------------
"$ROOT/scripts/build-base-image.sh"

# --- 4. Python environment ----------------------------------------------------------------
if [ "$SKIP_VENV" = 0 ]; then
    VENV="$ROOT/.venv"
    STAMP="$VENV/.agentenv-installed"
    WANT="$(cat "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)"
    # A .venv made from another interpreter (an older bootstrap took the first python3.11 on PATH) is made again.
    if [ -f "$VENV/pyvenv.cfg" ] && ! grep -qx 'home = /usr/bin' "$VENV/pyvenv.cfg"; then
        log "remaking .venv from the distribution's /usr/bin/python3 (it was made from $(sed -n 's/^home = //p' "$VENV/pyvenv.cfg"))"
        rm -rf "$VENV"
    fi
    if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
        log "installing the Python environment in .venv (torch and the project; a few minutes the first time)"
        # The distribution's own interpreter, never whatever is first on PATH (a pyenv or a newer build would hide
        # what a fresh Debian runs: 3.11.2 on Debian 12, whose tarfile has no extraction filters).
        apt_install python3 python3-venv
        [ -x "$VENV/bin/python" ] || /usr/bin/python3 -m venv "$VENV"
        pip() { { "$VENV/bin/pip" "$@" 2>&1; } | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
        pip install -q --upgrade pip
        # Pin the CPU build that the package registries here serve; a bare 'torch' pulls CUDA wheels.
        "$VENV/bin/python" -c "import torch" 2>/dev/null || pip install -q "torch==2.13.0"
        # the distribution was named agentenv before (that name on the package index is another project's): the old
        # editable install goes, or its entry points and console script would stand beside the new one's
        ! "$VENV/bin/pip" show -q agentenv >/dev/null 2>&1 || pip uninstall -q -y agentenv
        pip install -q -e "$ROOT[all,test,docs,frameworks]"
        # the official SWE-bench log parser, for a test that cross-checks ours (its own dependencies are not needed)
        pip install -q --no-deps "swebench==5.0.2"
        # verifiers for envs.frameworks.verifiers: its own pins clash with agentenv[e2b]'s (see pyproject's verifiers extra)
        pip install -q --no-deps "verifiers==0.4.0" "prime-sandboxes==0.5.1"
        echo "$WANT" >"$STAMP"
    fi
    # the official SWE-bench harnesses the grader runs as their own processes (envs.grading.runners.official):
    # 4.x and 5.x cannot share one environment, so each pinned version gets a folder of its own
    for v in 4.1.0 5.0.2; do
        [ -d "$VENV/swebench/$v/swebench-$v.dist-info" ] || "$VENV/bin/pip" install -q --no-deps \
            --target "$VENV/swebench/$v" "swebench==$v" "unidiff==0.7.5" 2>&1 | grep -v "is ignored: it is neither" || true
        [ -d "$VENV/swebench/$v/swebench-$v.dist-info" ] || die "swebench $v did not install into $VENV/swebench/$v"
    done
    # CRIU's Python bindings: the packaged ones (Debian 13) or the ones built above.
    SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    [ -d "$CACHE/pycriu" ] && echo "$CACHE" >"$SITE/agentenv-pycriu.pth"
    "$VENV/bin/python" -c "import pycriu" || die "pycriu does not import in .venv"
    log "python environment ready: $VENV ($("$VENV/bin/python" -c 'import sys; print(sys.version.split()[0], sys._base_executable)'))"
    # --- 5. The sandbox volume of the default home (/var/lib/agentenv): made once, mounted again after a reboot
    "$VENV/bin/agentenv" volume || die "the sandbox volume has no quotas: sandboxes cannot get disk limits"
    # --- 5b. E2B's code-interpreter image: the base image and the pinned data stack (wheels through .venv's pip)
    AGENTENV_PIP="$VENV/bin/python -m pip" "$ROOT/scripts/build-code-interpreter-image.sh" 2>&1 \
        | { grep -v "is ignored: it is neither" || true; } \
        || die "the code-interpreter image did not build (its output is above)"
    # --- 6. harbor's own venv (harbor needs Python >= 3.12, Debian 12 has 3.11): CPython 3.13 built from Debian's
    # source, about 3 minutes on 2 cores more, so only when asked; without it the harbor test skips, saying how
    if [ "${AGENTENV_HARBOR:-0}" = 1 ]; then
        AGENTENV_CACHE="$CACHE" bash "$ROOT/scripts/python3.13.sh" "$ROOT/.venv-harbor" >/dev/null \
            || die "no Python >= 3.12 for harbor (see $CACHE/python3.13-build.log)"
    fi
fi
log "bootstrap done"
