#!/usr/bin/env bash
# Set up (if needed), write the sample LLaVA dataset (offline) and train the demo model on it on 2 CPU ranks (gloo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
[ -f data/sample/train.json ] || python tools/make_sample_data.py data/sample
exec torchrun --nproc-per-node 2 examples/pretrain_mimo.py --config examples/configs/cpu_llava_demo.yaml --device cpu "$@"
