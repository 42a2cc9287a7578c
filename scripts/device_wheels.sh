#!/usr/bin/env bash
# Fetch into .whl/ the wheels a lent GPU machine lacks, for tools/gpu_session.sh: its image (Python 3.12,
# torch, Triton, transformers, safetensors, Pillow, einops) has no megatron-core and cannot download.
# Run it here, where PyPI is reachable, then name .whl in the device call's carry (.gitignore keeps the
# folder out of git; WHEELS names another folder, as for gpu_session.sh). The version is the one
# setup.py pins.
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(sed -n 's/^ *"megatron-core==\([0-9][0-9.]*\)",.*/\1/p' setup.py)
if [ -z "$version" ]; then
    echo "error: no megatron-core==X pin found in setup.py" >&2
    exit 1
fi
WHEELS=${WHEELS:-.whl}
mkdir -p "$WHEELS"
# Two versions of one package in the folder would stop the whole install there.
rm -f "$WHEELS"/megatron_core-*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$WHEELS" "megatron-core==$version"
ls "$WHEELS"
