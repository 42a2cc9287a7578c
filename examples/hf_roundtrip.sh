#!/usr/bin/env bash
# Import -> train -> export -> reload, with a tiny random LLaVA (no download), on CPU ranks.
#   bash examples/hf_roundtrip.sh [WORK_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${1:-/tmp/mimo_hf_roundtrip}
PY=${PYTHON:-python}
mkdir -p "$WORK"
# The script's own outputs only (WORK may hold other files): a rerun starts from a new tiny model and
# exports into an empty directory, as --hf-export requires.
rm -rf "$WORK/tiny_llava" "$WORK/trained_hf" "$WORK/inputs.pt" "$WORK/mimo_logits.pt" "$WORK/trained_logits.pt"
CFG=examples/configs/llava_hf_cpu.yaml

# 1. A tiny random LLaVA (CLIP + Llama with GQA) written by transformers.
$PY tools/make_tiny_llava.py --out "$WORK/tiny_llava"

# 2. The config takes its architecture from the HF config.json (no weights read).
$PY -m mimo.config check $CFG --set model.hf="$WORK/tiny_llava" --world-size 3

# 3. The imported model gives transformers' logits (FP32, at this layout).
$PY - "$WORK" <<'PYEOF'
import sys, torch
w = sys.argv[1]
g = torch.Generator().manual_seed(0)
ids = torch.randint(1, 100, (2, 40), generator=g)
ids[0, 3:19] = 127; ids[1, 10:26] = 127          # image_token_id, one per image feature
torch.save({"input_ids": ids, "pixel_values": torch.randn(2, 3, 16, 16, generator=g)}, f"{w}/inputs.pt")
PYEOF
$PY tools/hf_logits.py --config $CFG --set model.hf="$WORK/tiny_llava" --inputs "$WORK/inputs.pt" --out "$WORK/mimo_logits.pt"

# 4. Train a few steps on 3 ranks and export the trained model.
torchrun --nproc-per-node 3 examples/pretrain_mimo.py --config $CFG --set model.hf="$WORK/tiny_llava" \
    --device cpu --hf-export "$WORK/trained_hf"

# 5. transformers loads the export; mimo reads it back with the same logits as transformers.
$PY tools/hf_logits.py --config $CFG --set model.hf="$WORK/trained_hf" --inputs "$WORK/inputs.pt" --out "$WORK/trained_logits.pt"
$PY - "$WORK" <<'PYEOF'
import sys, torch
from transformers import LlavaForConditionalGeneration
w = sys.argv[1]
inputs = torch.load(f"{w}/inputs.pt", weights_only=True)
def ref(d):
    with torch.no_grad():
        return LlavaForConditionalGeneration.from_pretrained(d).eval()(**inputs).logits
for name, d, mine in (("imported", "tiny_llava", "mimo_logits.pt"), ("trained+exported", "trained_hf", "trained_logits.pt")):
    r, m = ref(f"{w}/{d}"), torch.load(f"{w}/{mine}", weights_only=True)["logits"]
    diff = float((m - r).abs().max() / r.abs().max())
    print(f"{name}: max rel logits diff mimo vs transformers {diff:.2e}", "ok" if diff < 1e-4 else "MISMATCH")
    assert diff < 1e-4
changed = float((ref(f"{w}/trained_hf") - ref(f"{w}/tiny_llava")).abs().max())
print(f"training changed the logits by up to {changed:.3e}")
assert changed > 0
PYEOF
echo "round trip ok: $WORK/trained_hf"
