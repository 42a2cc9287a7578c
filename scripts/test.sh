#!/usr/bin/env bash
# Set up (if needed) and run the test suite: the README's test command and CI's.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m slow`.
# Test files run MIMO_TEST_WORKERS at a time (default 2; each file whole on one worker, so its
# module fixtures are built once); MIMO_TEST_WORKERS=0 runs everything in this process. xdist
# hands out files with many tests first, which mixes the long multi-rank files with quick ones;
# starting the long ones together instead oversubscribes 2 cores (one try had 16% of the tests
# done after 17 minutes; this order runs all of them in about 18).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m pytest -q -n "${MIMO_TEST_WORKERS:-2}" --dist loadfile "$@"
