#!/usr/bin/env bash
# Create .venv and install mimo with its pinned dependencies.
# Without an NVIDIA GPU it installs the CPU build of torch (a few hundred MB)
# instead of the multi-GB CUDA build that a plain `pip install torch` pulls.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
pip_q() { python -m pip install --quiet --disable-pip-version-check "$@"; }
if ! python -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip_q "torch==2.13.0"
  else
    # A local CPU wheel (pip find-links) or PyTorch's CPU index.
    pip_q "torch==2.13.0+cpu" 2>/dev/null \
      || pip_q "torch==2.13.0+cpu" --index-url https://download.pytorch.org/whl/cpu \
           --extra-index-url https://pypi.org/simple
  fi
fi
pip_q -e ".[test]"
echo "mimo installed in $(pwd)/.venv (torch $(python -c 'import torch; print(torch.__version__)'))"
