# shellcheck shell=bash
# Mooncake Store for the benchmarks, a peer to compare with: PyPI
# mooncake-transfer-engine-non-cuda in a virtual environment outside the
# clone, made on first use. Its binaries link libibverbs1, libnuma1 and
# librdmacm1 (Debian) even for TCP. Sourced; MOONCAKE_VENV may be set.

# 0.3.13 itself links libcudart.so.12 into its "non-CUDA" store module;
# .post1 is the same release without that link.
MOONCAKE_VERSION=${MOONCAKE_VERSION:-0.3.13.post1}
MOONCAKE_VENV=${MOONCAKE_VENV:-${KVPLANE_TOOLS:-$HOME/.cache/kvplane-tools}/mooncake-$MOONCAKE_VERSION}
export MOONCAKE_VENV

mooncake_install() {
    "$MOONCAKE_VENV/bin/python" -c 'import mooncake.store' 2>/dev/null && return 0
    echo "==> installing mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION into $MOONCAKE_VENV (once)" >&2
    python3 -m venv "$MOONCAKE_VENV"
    "$MOONCAKE_VENV/bin/pip" install -q "mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION"
    if ! "$MOONCAKE_VENV/bin/python" -c 'import mooncake.store' 2>"$MOONCAKE_VENV/import.log"; then
        cat "$MOONCAKE_VENV/import.log" >&2
        echo "mooncake.store does not load; on Debian: apt-get install libibverbs1 libnuma1 librdmacm1" >&2
        exit 1
    fi
}
