#!/usr/bin/env bash
# Build (or update) the environment for the framework integration tests (tests/integrations).
#
#   bash .ci/integrations_env.sh              # creates .venv-integrations/ at the repo root
#   INTEGRATIONS_VENV=/path bash .ci/integrations_env.sh
#
# Hugging Face transformers + accelerate, Lightning and torchtitan are optional extras of
# muonscale, so they get their own venv and exact pins. torch is installed first, pinned to the
# CPU build the main venv uses, so that no framework pulls a multi-GB CUDA build of torch.
# Idempotent: when every pin is already satisfied it installs nothing (a few seconds).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${INTEGRATIONS_VENV:-$ROOT/.venv-integrations}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
START=$(date +%s)

# Pins: the versions these integrations were written and tested against.
REQUIREMENTS=(
    "torch==$TORCH_VERSION"
    "transformers==5.24.0"
    "accelerate==1.15.0"
    "lightning==2.6.6"
    "torchtitan==0.3.0"
    "triton==3.6.0"  # torchtitan imports it (its MoE kernels); the CPU torch wheel does not pull it
    "numpy"
    "pytest"
    "pytest-timeout"
    "pytest-rerunfailures"  # tests/conftest.py: the gloo exit abort's safety net, as in [dev]
)

if [ ! -x "$VENV/bin/python" ]; then
    echo "integrations_env: creating $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
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
    if req.specifier and not req.specifier.contains(installed.split("+")[0], prereleases=True):
        sys.exit(1)
PY
}

if satisfied; then
    echo "integrations_env: requirements already satisfied in $VENV"
else
    echo "integrations_env: installing ${REQUIREMENTS[*]}"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet "torch==$TORCH_VERSION" 2>&1 | grep -v "is ignored" || true
    "$VENV/bin/python" -m pip install --quiet "${REQUIREMENTS[@]}" 2>&1 | grep -v "is ignored" || true
    satisfied || { echo "integrations_env: install failed" >&2; exit 1; }
fi

"$VENV/bin/python" -c "from importlib.metadata import version as v; print('integrations_env:', ' | '.join(f'{n} {v(n)}' for n in ('torch', 'transformers', 'accelerate', 'lightning', 'torchtitan')))"
echo "integrations_env: done in $(( $(date +%s) - START ))s ($(du -sh "$VENV" | cut -f1) at $VENV)"
