#!/usr/bin/env bash
# Everything the GPU-speed figures need from one lent GPU, in one call, most important first, inside
# a time budget (docs/benchmarks.md, "GPU bench"):
#   0. tools/gpu_check.py --quick: the compiled kernels against the fp32 reference (forward and
#      backward at 4k and 8k), a bf16 training step, offload: the figures below mean little without it;
#   1. tools/gpu_bench.py: attention table (bitfield / flex / SDPA), mimo vs megatron-core step,
#      the profiled step's top kernels, and the planner profile;
#   2. the profile's predicted vs measured one-GPU step (python -m mimo.planner.profile);
#   3. examples/configs/gpu_llava_1gpu.yaml trained for 10 steps (the 1.24B LLaVA-style model's MFU);
#   4. tools/plan.py --evaluate: the planner with the measured profile against that run;
#   5. with the time left, tools/tune_attention.py (launch settings of the current kernels, with the
#      bench's grouped KV heads; `gpu_bench.py --skip step --kernel-config OUT_DIR/tuned.json` then
#      sets its winners against flex_attention).
#
#   bash tools/gpu_session.sh OUT_DIR [BUDGET_S]     # default budget 570 s
#   bash tools/gpu_session.sh OUT_DIR BUDGET_S attention
#
# Files in OUT_DIR: gpu_check.json, gpu_bench.jsonl, gpu_bench.profile.json, llava_1gpu.jsonl, plan_eval.json,
# tune.log, tuned.json and session.log (every step's output, a "step NAME: rc R, S s" line after each).
# `attention` (the third argument) measures bitfield attention only, for kernel work whose other
# figures are already in: step 0, the attention table at 16k-64k tokens (attention.jsonl), step 5,
# then the table again with the tuned settings (attention_tuned.jsonl) with the time left.
# Wheels in .whl/ (megatron-core, which the GPU image lacks: scripts/device_wheels.sh fetches it; WHEELS
# names another folder) are installed into /tmp/site once CUDA is found; without a CUDA device it says so and exits 0,
# installing nothing. BUDGET_S must be a whole number of seconds (1-999999).
# PYTHON overrides the interpreter (default python3).
set -u
OUT=${1:?usage: bash tools/gpu_session.sh OUT_DIR [BUDGET_S] [attention]}
BUDGET=${2:-570}
FOCUS=${3:-all}
case "$FOCUS" in
    all|attention) ;;
    *) echo "error: the third argument must be 'attention' (or 'all', the default), got '$FOCUS'" >&2; exit 2;;
esac
case "$BUDGET" in
    ''|*[!0-9]*|0) echo "error: BUDGET_S must be a positive whole number of seconds, got '$BUDGET'" >&2; exit 2;;
esac
if [ "${#BUDGET}" -gt 6 ] || [ "$((10#$BUDGET))" -lt 1 ]; then
    echo "error: BUDGET_S must be 1 to 999999 seconds, got $BUDGET" >&2
    exit 2
fi
BUDGET=$((10#$BUDGET))
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
START=$(date +%s)
mkdir -p "$OUT"
LOG="$OUT/session.log"
: > "$LOG"
export PYTHONUNBUFFERED=1

left() { echo $((BUDGET - ($(date +%s) - START))); }
min() { if [ "$1" -lt "$2" ]; then echo "$1"; else echo "$2"; fi; }

# step NAME LIMIT_S CMD...: runs CMD under `timeout`, its output appended to the log.
step() {
    local name=$1 limit=$2 t0 rc
    shift 2
    if [ "$limit" -lt 10 ]; then
        echo "step $name: skipped, its share of the budget (${limit}s) is under 10 s" | tee -a "$LOG"
        return
    fi
    echo "== step $name (limit ${limit}s): $*" >> "$LOG"
    t0=$(date +%s)
    timeout "$limit" "$@" >> "$LOG" 2>&1
    rc=$?
    echo "step $name: rc $rc, $(($(date +%s) - t0)) s" | tee -a "$LOG"
}

# No CUDA: nothing to measure, and nothing installed (the wheels are for the GPU machine's Python).
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)" >> "$LOG" 2>&1; then
    echo "gpu_session: no CUDA device on this machine; nothing measured" | tee -a "$LOG"
    exit 0
fi
if ls "$WHEELS"/*.whl > /dev/null 2>&1; then
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "$WHEELS"/*.whl >> "$LOG" 2>&1; then
        echo "error: installing $WHEELS/*.whl failed (see $LOG)" | tee -a "$LOG"
        exit 1
    fi
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# Every step imports megatron-core; the GPU image lacks it (scripts/device_wheels.sh fetches the wheel).
if ! "$PY" -c "import megatron.core" >> "$LOG" 2>&1; then
    echo "error: megatron-core is not importable here: run 'bash scripts/device_wheels.sh' before the call" \
         "and carry .whl (see $LOG)" | tee -a "$LOG"
    exit 1
fi
"$PY" -c "import torch; print('device:', torch.cuda.get_device_name(), '| torch', torch.__version__)" | tee -a "$LOG"

# Files a step writes only when it finishes: none may be left from an earlier session in OUT_DIR.
rm -f "$OUT/tuned.json" "$OUT/tune.log"
# What the steps after the check need at least: the whole session's, or the attention table's.
RESERVE=240
[ "$FOCUS" = attention ] && RESERVE=200
step gpu_check "$(min 90 $(($(left) - RESERVE)))" sh -c "\"$PY\" tools/gpu_check.py --quick > \"$OUT/gpu_check.json\""
cat "$OUT/gpu_check.json" >> "$LOG" 2>/dev/null
if [ "$FOCUS" = attention ]; then
    # The acceptance lengths, longest first; flex_attention and SDPA in the same table. Then tuning with
    # half of what is left (one length when that is little; none under 120 s: it could not finish),
    # then the table with the tuned settings.
    ATTN="--skip step,profile --seqlens 65536,32768,16384"
    # A row started before the bench's --budget-s may run on for up to ~50 s (a cold flex compile at 64k).
    bench_budget() { echo $(($1 > 60 ? $1 - 50 : 10)); }
    LIMIT=$(min 200 $(($(left) - 60)))
    step attention "$LIMIT" "$PY" tools/gpu_bench.py $ATTN --out "$OUT/attention.jsonl" \
        --profile-out "$OUT/attention.profile.json" --budget-s "$(bench_budget "$LIMIT")"
    SEQLENS=16384,65536
    [ "$(left)" -lt 400 ] && SEQLENS=16384
    if [ "$(left)" -ge 120 ]; then
        step tune_attention $(($(left) / 2)) \
            sh -c "\"$PY\" tools/tune_attention.py --seqlens $SEQLENS --kv-heads 8 --json-out \"$OUT/tuned.json\" \
> \"$OUT/tune.log\" 2>&1"
    else
        echo "step tune_attention: skipped, $(left)s of the budget left (it needs 120 s)" | tee -a "$LOG"
    fi
    if [ -f "$OUT/tuned.json" ]; then
        LIMIT=$(($(left) - 10))
        step attention_tuned "$LIMIT" "$PY" tools/gpu_bench.py $ATTN --kernel-config "$OUT/tuned.json" \
            --out "$OUT/attention_tuned.jsonl" --profile-out "$OUT/attention_tuned.profile.json" \
            --budget-s "$(bench_budget "$LIMIT")"
    else
        echo "step attention_tuned: skipped, no tuned.json" | tee -a "$LOG"
    fi
    echo "gpu_session: done in $(($(date +%s) - START)) s of a ${BUDGET} s budget" | tee -a "$LOG"
    exit 0
fi
step gpu_bench "$(min 330 $(($(left) - 170)))" \
    "$PY" tools/gpu_bench.py --out "$OUT/gpu_bench.jsonl" --budget-s 240
step profile_check "$(min 60 "$(left)")" "$PY" -m mimo.planner.profile "$OUT/gpu_bench.profile.json"
step llava_1gpu "$(min 200 $(($(left) - 20)))" \
    "$PY" examples/pretrain_mimo.py --config examples/configs/gpu_llava_1gpu.yaml --device cuda \
    --log-json "$OUT/llava_1gpu.jsonl"
step plan_evaluate "$(min 60 "$(left)")" sh -c "\"$PY\" tools/plan.py --config examples/configs/gpu_llava_1gpu.yaml \
--evaluate --profile \"$OUT/gpu_bench.profile.json\" --measured \"$OUT/llava_1gpu.jsonl\" --json \
> \"$OUT/plan_eval.json\""
cat "$OUT/plan_eval.json" >> "$LOG" 2>/dev/null
# Tuning prints a line per timed candidate and its tables at the end: one length when little time is left.
SEQLENS=16384,65536
[ "$(left)" -lt 300 ] && SEQLENS=16384
step tune_attention $(($(left) - 10)) \
    sh -c "\"$PY\" tools/tune_attention.py --seqlens $SEQLENS --kv-heads 8 --json-out \"$OUT/tuned.json\" \
> \"$OUT/tune.log\" 2>&1"
echo "gpu_session: done in $(($(date +%s) - START)) s of a ${BUDGET} s budget" | tee -a "$LOG"
