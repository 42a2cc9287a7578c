#!/usr/bin/env bash
# Set up (if needed) and train the demo model on 2 CPU ranks (gloo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec torchrun --nproc-per-node 2 examples/pretrain_mimo.py --config examples/configs/cpu_demo.yaml --device cpu "$@"
