"""A tiny two-encoder config shared by tests (dicts, so each test can tweak a copy)."""

import copy

TINY = {
    "model": {
        "language": dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=128,
                         max_sequence_length=64),
        "encoders": {
            "images": dict(kind="vision", num_layers=1, hidden_size=16, num_attention_heads=2, image_size=8,
                           patch_size=4, frozen=False, projector={"kind": "mlp"}),
            "audio": dict(kind="audio", num_layers=1, hidden_size=16, num_attention_heads=2, clip_frames=16,
                          frames_per_token=4, num_mel_bins=8, frozen=True, projector={"kind": "linear"}),
        },
    },
    "parallelism": {"language": {}, "images": {}, "audio": {}},
    "data": {"seq_length": 48, "seed": 3},
    "training": {"global_batch_size": 8, "micro_batch_size": 2, "train_iters": 3, "optimizer": "sgd", "lr": 0.1,
                 "seed": 7},
}

# `training.adam_eps` of the tests that compare weights after Adam steps across layouts. With the default
# 1e-8 an element whose gradient is near 0 moves by about lr * sign(g), so summation-order rounding that
# flips or halves such a gradient moves the weight by up to lr; how many elements do so depends on the
# machine's kernels (one machine put a TP2 x DP2 run 1.3e-3 of the largest weight away from 1 rank, others
# 1.6e-4). An eps above those gradients keeps the update a smooth function of them, so the weights can be
# compared tightly.
PARITY_ADAM_EPS = 1e-3


def tiny(**layout):
    """TINY with every module on the same layout (e.g. tiny(tp=2, dp=2))."""
    raw = copy.deepcopy(TINY)
    raw["parallelism"] = {m: dict(layout) for m in ("language", "images", "audio")}
    return raw
