#!/usr/bin/env bash
# A CPython >= 3.12 for the harnesses that need one (harbor requires 3.12): Debian 12 packages only 3.11, and the
# prebuilt interpreters (python-build-standalone, uv's, the npm portable-python installers) are fetched from GitHub
# releases, which this machine cannot reach. Debian's own registry has CPython 3.13's source (trixie's python3.13
# source package): this builds it into a prefix of its own, beside the system's Python, touching nothing else.
# Idempotent: a prefix whose interpreter already runs is left as it is, and so is a venv already holding harbor.
#   usage: scripts/python3.13.sh [VENV]     (root; PREFIX=/opt/agentenv-python3.13, CACHE=/var/cache/agentenv)
# With VENV (e.g. "$ROOT/.venv-harbor"), also a virtual environment of that interpreter holding this checkout's
# agentenv, editable, with its harbor extra (harbor pinned), for agentenv.harness.harbor. Prints the interpreter last.
set -euo pipefail
VERSION=3.13.5
SHA256=93e583f243454e6e9e4588ca2c2662206ad961659863277afcdb96801647d640  # python3.13_3.13.5.orig.tar.xz
PREFIX="${AGENTENV_PYTHON313_PREFIX:-/opt/agentenv-python3.13}"
CACHE="${AGENTENV_CACHE:-/var/cache/agentenv}"
PY="$PREFIX/bin/python3.13"
log() { printf '\033[1m[python3.13]\033[0m %s\n' "$*" >&2; }
die() { printf '[python3.13] error: %s\n' "$*" >&2; exit 1; }

HARBOR_VERSION=0.25.0  # as pyproject.toml's harbor extra pins it
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-}"

harbor_venv() {  # the venv of harbor and agentenv; pycriu as the main venv finds it (bootstrap builds it in CACHE)
    [ -n "$VENV" ] || return 0
    if [ -x "$VENV/bin/harbor" ] && "$VENV/bin/python" -c "import agentenv, harbor, importlib.metadata as m; \
import dockerfile_parse; assert m.version('harbor') == '$HARBOR_VERSION'" 2>/dev/null; then return 0; fi
    log "making $VENV: harbor $HARBOR_VERSION and agentenv (editable)"
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q -e "$ROOT[harbor]" 2>&1 | { grep -v "is ignored: it is neither" || true; }
    site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    [ -d "$CACHE/pycriu" ] && echo "$CACHE" >"$site/agentenv-pycriu.pth"
    "$VENV/bin/python" -c "import agentenv, harbor" || die "harbor or agentenv does not import in $VENV"
}

if "$PY" -c 'import ssl, sqlite3, zlib, lzma, bz2, ctypes, venv' 2>/dev/null; then harbor_venv; echo "$PY"; exit 0; fi
[ "$(id -u)" = 0 ] || die "run as root"
export DEBIAN_FRONTEND=noninteractive
mkdir -p "$CACHE"
DEPS=(build-essential dpkg-dev pkg-config libssl-dev zlib1g-dev libbz2-dev liblzma-dev libffi-dev libsqlite3-dev
      libreadline-dev libncurses-dev libgdbm-dev uuid-dev)
missing=()
for p in "${DEPS[@]}"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]}"
    apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
tarball="$CACHE/python3.13_$VERSION.orig.tar.xz"
if [ ! -f "$tarball" ] || ! echo "$SHA256  $tarball" | sha256sum -c --status; then
    install -m 644 "$ROOT/scripts/trixie-src.sources" /etc/apt/sources.list.d/agentenv-trixie-src.sources
    apt-get update -qq
    (cd "$CACHE" && apt-get source --download-only "python3.13=$VERSION-2+deb13u5" >/dev/null 2>&1 \
        || apt-get source --download-only python3.13/trixie >/dev/null 2>&1) || true
fi
[ -f "$tarball" ] || die "could not fetch python3.13_$VERSION.orig.tar.xz from Debian's trixie sources"
echo "$SHA256  $tarball" | sha256sum -c --status || die "sha256 mismatch for $tarball"
src="$CACHE/Python-$VERSION"
rm -rf "$src" && tar -C "$CACHE" -xf "$tarball"
log "building CPython $VERSION into $PREFIX (a few minutes)"
(cd "$src" && ./configure --prefix="$PREFIX" --with-ensurepip=install >"$CACHE/python3.13-build.log" 2>&1 \
    && make -j"$(nproc)" >>"$CACHE/python3.13-build.log" 2>&1 \
    && make altinstall >>"$CACHE/python3.13-build.log" 2>&1) || die "CPython build failed: $CACHE/python3.13-build.log"
"$PY" -c 'import ssl, sqlite3, zlib, lzma, bz2, ctypes, venv' || die "$PY lacks a standard module"
rm -rf "$src"
harbor_venv
echo "$PY"
