# shellcheck shell=bash
# SGLang and aibrix_kvcache for the engine tests (issue 22), installed into
# the engines environment beside vLLM and LMCache. scripts/prereqs'
# part_engines sources this file, appends "$ENGINES_EXTRA_PINS" to its
# stamp (so a change of these pins reinstalls the environment) and, once
# vLLM, LMCache and torch are in, calls
#
#     install_engines_extra "$dir"
#
# Both packages are installed without their dependencies, because their
# pins cannot share an environment with vLLM's: sglang 0.5.23 pins
# torch==2.14.1 and CUDA packages (sglang-kernel, flashinfer, flash-attn-4),
# aibrix-kvcache 0.8.0 pins redis==6.0.0 and requires the PyPI `asyncio`
# (a 2015 copy of the standard library module, never wanted on Python 3).
# The environment keeps vLLM's torch. What the tests import of SGLang's and
# AIBrix's requirements that the environment lacks is added here, pinned;
# the import check below names a module that is still missing. pip's list
# of the pins left unmet (`sglang requires torch==2.14.1`, ...) is expected:
# it is counted, and shown whole only when pip fails.

SGLANG_VERSION=0.5.23
AIBRIX_KVCACHE_VERSION=0.8.0
# sglang: IPython (sglang/utils.py imports it at load), orjson, gguf (its
# quantization layers, imported by its memory pools); aibrix_kvcache:
# cityhash (its `farmhash` key hasher), more-itertools, zstandard.
ENGINES_EXTRA_DEPS=(ipython==9.18.1 orjson==3.13.0 gguf==0.19.0 cityhash==0.4.10 more-itertools==11.2.1 zstandard==0.25.0)
ENGINES_EXTRA_PINS="sglang==$SGLANG_VERSION aibrix-kvcache==$AIBRIX_KVCACHE_VERSION ${ENGINES_EXTRA_DEPS[*]}"
# What the tests import (python/tests/engines/test_sglang_backend.py,
# test_aibrix_connector.py): the check that the install is usable.
ENGINES_EXTRA_IMPORTS="import sglang.srt.mem_cache.storage.backend_factory, sglang.srt.mem_cache.pool_host.mha, sglang.srt.mem_cache.memory_pool, aibrix_kvcache.l2, aibrix_kvcache.memory.allocator"

# install_engines_extra DIR: SGLang and aibrix_kvcache (no dependencies),
# then the few requirements listed above (with theirs, as far as DIR lacks
# them), into the virtual environment DIR; fails naming a module the tests
# import that is still missing.
install_engines_extra() {
    local dir=$1 log unmet
    local pip=("$dir/bin/python" -m pip install --disable-pip-version-check --progress-bar off --quiet)
    log=$(mktemp)
    # pip lists each pin the environment does not meet (expected: see the
    # top of this file); printed whole only when pip fails.
    if ! { "${pip[@]}" --no-deps "sglang==$SGLANG_VERSION" "aibrix-kvcache==$AIBRIX_KVCACHE_VERSION" &&
        "${pip[@]}" "${ENGINES_EXTRA_DEPS[@]}"; } >"$log" 2>&1; then
        cat "$log" >&2
        rm -f "$log"
        return 1
    fi
    unmet=$(grep -c ' requires ' "$log" || true)
    rm -f "$log"
    echo "         sglang $SGLANG_VERSION, aibrix-kvcache $AIBRIX_KVCACHE_VERSION without their dependencies (pip reports $unmet pins unmet in the environment, as intended), and ${ENGINES_EXTRA_DEPS[*]}"
    "$dir/bin/python" -c "$ENGINES_EXTRA_IMPORTS" 2>/dev/null || {
        echo "engines: SGLang or aibrix_kvcache does not import in $dir:" >&2
        "$dir/bin/python" -c "$ENGINES_EXTRA_IMPORTS" 2>&1 | tail -3 >&2
        return 1
    }
}
