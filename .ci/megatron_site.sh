#!/usr/bin/env bash
# Build (or check) .megatron-site/: megatron-core and the Python packages it needs unpacked into
# one folder, for a machine that has Python 3.12 and CUDA torch but neither megatron-core nor a
# network (the lent GPU machine). Carry it there and put it on PYTHONPATH:
#
#   bash .ci/megatron_site.sh                       # here: downloads wheels, unpacks (~12 MiB)
#   # device tool: carry [".megatron-site"], command:
#   PYTHONPATH=. python3 benchmarks/gpu.py --out $OUT
#   # benchmarks/gpu.py finds .megatron-site/ and runs benchmarks/megatron_gpu.py with
#   # PYTHONPATH=<repo>:<repo>/.megatron-site
#
#   MEGATRON_SITE=/path bash .ci/megatron_site.sh   # another folder
#   PIP_PYTHON=/path/to/python bash .ci/megatron_site.sh   # the Python whose pip downloads
#
# Only wheels go in (pip download --only-binary=:all: --no-deps for CPython 3.12 on x86-64
# manylinux), so the Python that runs this script does not matter. torch, numpy and triton are
# NOT included: the target machine has its own CUDA build. Idempotent: a stamp file records the
# pinned list, and a folder built from the same pins is left alone.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SITE="${MEGATRON_SITE:-$ROOT/.megatron-site}"
STAMP="$SITE/.megatron_site_pins"
START=$(date +%s)

# Pins: megatron-core and emerging-optimizers as in .ci/megatron_env.sh; absl-py is
# emerging-optimizers' only requirement besides torch; packaging is megatron-core's (pytest
# brings it too, but a bare machine may lack it). megatron-core's own wheel is platform
# specific (cp312-cp312-manylinux_2_24/2_28_x86_64: one small C++ dataset helper).
PINS=(
    "megatron-core==0.19.2"
    "emerging-optimizers==0.3.0"
    "absl-py==2.5.1"
    "packaging==26.4"
)
MAX_MIB=48   # the device tool carries at most 64 MiB in all

find_pip_python() {
    for candidate in "${PIP_PYTHON:-}" "$ROOT/.venv/bin/python" "$ROOT/.venv-megatron/bin/python" python3; do
        [ -n "$candidate" ] || continue
        if "$candidate" -m pip --version >/dev/null 2>&1; then
            echo "$candidate"; return 0
        fi
    done
    return 1
}

size_mib() { du -sm "$SITE" | cut -f1; }

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "${PINS[*]}" ] && [ -d "$SITE/megatron/core" ]; then
    echo "megatron_site: $SITE is up to date (${PINS[*]})"
else
    PIP_PY="$(find_pip_python)" || { echo "megatron_site: no Python with pip found (set PIP_PYTHON)" >&2; exit 1; }
    WHEELS="$(mktemp -d)"
    trap 'rm -rf "$WHEELS"' EXIT
    echo "megatron_site: downloading ${PINS[*]} with $PIP_PY"
    "$PIP_PY" -m pip download --quiet --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp --abi cp312 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux2014_x86_64 \
        --dest "$WHEELS" "${PINS[@]}"
    rm -rf "$SITE"
    mkdir -p "$SITE"
    for wheel in "$WHEELS"/*.whl; do
        echo "megatron_site: unpacking $(basename "$wheel")"
        "$PIP_PY" -m zipfile -e "$wheel" "$SITE"
    done
    echo "${PINS[*]}" > "$STAMP"
fi

MIB="$(size_mib)"
echo "megatron_site: $SITE holds $MIB MiB ($(ls "$SITE" | grep -c dist-info) wheels) in $(( $(date +%s) - START ))s"
if [ "$MIB" -gt "$MAX_MIB" ]; then
    echo "megatron_site: $MIB MiB is over the $MAX_MIB MiB budget for the device carry" >&2
    exit 1
fi
