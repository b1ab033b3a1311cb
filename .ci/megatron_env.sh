#!/usr/bin/env bash
# Build (or update) the Python 3.12 environment for the Megatron-Core integration tests.
#
#   bash .ci/megatron_env.sh            # creates .venv-megatron/ at the repo root (git-ignored)
#   MEGATRON_VENV=/path bash .ci/megatron_env.sh
#
# megatron-core 0.19 needs Python >= 3.12; the main project venv is 3.11, so the Megatron
# adapter is tested in its own venv. Idempotent: when every pinned requirement is already
# satisfied it installs nothing (a few seconds). A fresh build downloads torch from PyPI
# (the default CUDA build, ~3 GB on disk, runs fine on CPU). transformer-engine and apex are
# NOT installed: Megatron's local layer spec and CPU code paths do not need them.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MEGATRON_VENV:-$ROOT/.venv-megatron}"
START=$(date +%s)

find_python312() {
    for candidate in "${PYTHON312:-}" python3.12 /root/.pyenv/versions/3.12.1/bin/python3.12 \
            "$HOME/.pyenv/versions/3.12.1/bin/python3.12"; do
        [ -n "$candidate" ] || continue
        # pyenv shims exist even when the version is not selected: check that it really runs.
        if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
            command -v "$candidate"; return 0
        fi
    done
    if command -v pyenv >/dev/null 2>&1; then
        local root; root="$(pyenv root)"
        # shellcheck disable=SC2012
        local found; found="$(ls -d "$root"/versions/3.12*/bin/python3.12 2>/dev/null | tail -1)"
        if [ -n "$found" ]; then echo "$found"; return 0; fi
    fi
    return 1
}

# Pins: the versions this adapter was written and tested against.
REQUIREMENTS=(
    "megatron-core==0.19.2"
    "emerging-optimizers==0.3.0"
    "torch>=2.6,<=2.14.1"
    "numpy"
    "pytest"
    "pytest-timeout"
)

if [ ! -x "$VENV/bin/python" ]; then
    PY312="$(find_python312)" || { echo "megatron_env: no python3.12 found (set PYTHON312)" >&2; exit 1; }
    echo "megatron_env: creating $VENV with $PY312"
    "$PY312" -m venv "$VENV"
fi

satisfied() {
    "$VENV/bin/python" - "${REQUIREMENTS[@]}" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version

try:
    from packaging.requirements import Requirement
except ImportError:  # pip vendors packaging
    from pip._vendor.packaging.requirements import Requirement

for line in sys.argv[1:]:
    req = Requirement(line)
    try:
        installed = version(req.name)
    except PackageNotFoundError:
        sys.exit(1)
    if req.specifier and not req.specifier.contains(installed, prereleases=True):
        sys.exit(1)
PY
}

if satisfied; then
    echo "megatron_env: requirements already satisfied in $VENV"
else
    echo "megatron_env: installing ${REQUIREMENTS[*]}"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet "${REQUIREMENTS[@]}"
fi

"$VENV/bin/python" -c "from importlib.metadata import version as v; print('megatron_env: megatron-core', v('megatron-core'), '| emerging-optimizers', v('emerging-optimizers'), '| torch', v('torch'))"
echo "megatron_env: done in $(( $(date +%s) - START ))s ($(du -sh "$VENV" | cut -f1) at $VENV)"
