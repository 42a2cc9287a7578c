"""Tiny random Qwen2.5-VL and Qwen2-VL models saved offline, and processor-style inputs for them.

Shared by the end-to-end logits / export tests (tests/test_qwen_vl_logits.py). Qwen2.5-VL: three
ViT layers, the middle one full-attention and the others windowed (a 56 px window is 4 x 4 patches,
so the larger images below hold several windows), tied input/output embeddings. Qwen2-VL: two
LayerNorm / quick_gelu ViT layers (no windows), untied. HF initialises norms to ones and biases to
zeros; they are redrawn here so every weight moves the logits.
"""

import json
import os
import shutil

import torch

VOCAB, IMAGE = 128, 120                 # image_token_id; video, vision_start, vision_end follow it
PATCH, TEMPORAL, MERGE, WINDOW = 14, 2, 2, 56
WIDTH = 3 * TEMPORAL * PATCH * PATCH    # one patch row of pixel_values
SECTION = [2, 3, 3]                     # head_dim 16: 8 rotary frequencies for time, height, width
# (t, h, w) in patches, three sizes: 6, 9 and 2 LLM tokens; the first two span 2 and 4 windows.
GRIDS = [(1, 4, 6), (1, 6, 6), (1, 2, 4)]
SEQ = 48
PROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": PATCH, "temporal_patch_size": TEMPORAL,
             "merge_size": MERGE, "min_pixels": 28 * 28, "max_pixels": 28 * 28 * 16}


def _text(tie: bool):
    return dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=tie, bos_token_id=1,
                eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                 "mrope_section": SECTION})


def build(version: str, seed: int = 0):
    """A tiny random Qwen2_5_VLForConditionalGeneration ("2.5") or Qwen2VLForConditionalGeneration ("2")."""
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                              Qwen2VLForConditionalGeneration)

    ids = dict(image_token_id=IMAGE, video_token_id=IMAGE + 1, vision_start_token_id=IMAGE + 2,
               vision_end_token_id=IMAGE + 3)
    torch.manual_seed(seed)
    if version == "2.5":
        vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                      patch_size=PATCH, temporal_patch_size=TEMPORAL, spatial_merge_size=MERGE, window_size=WINDOW,
                      fullatt_block_indexes=[1])
        model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
            text_config=_text(True), vision_config=vision, tie_word_embeddings=True, **ids))
    else:
        vision = dict(depth=2, embed_dim=32, mlp_ratio=2, num_heads=2, hidden_size=64, patch_size=PATCH,
                      temporal_patch_size=TEMPORAL, spatial_merge_size=MERGE)
        model = Qwen2VLForConditionalGeneration(Qwen2VLConfig(text_config=_text(False), vision_config=vision,
                                                              **ids))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5) if "norm" in name or name.endswith("ln_q.weight") else p.normal_(0, 0.1)
            elif "visual" in name:
                p.normal_(0, 0.2)
    return model.eval()


def save(model, directory: str, tokenizer_from: str = None) -> str:
    """The model's HF directory: weights, config, the image processor's settings (and a tokenizer's
    files, when given a directory holding one)."""
    model.save_pretrained(directory)
    with open(os.path.join(directory, "preprocessor_config.json"), "w") as f:
        json.dump(PROCESSOR, f)
    if tokenizer_from:
        for name in os.listdir(tokenizer_from):
            shutil.copy2(os.path.join(tokenizer_from, name), os.path.join(directory, name))
    return directory


def all_full_attention(directory: str, out: str) -> str:
    """A copy of a Qwen2.5-VL directory (its weights linked) whose every ViT layer is full-attention."""
    os.makedirs(out)
    for name in os.listdir(directory):
        if name != "config.json":
            os.symlink(os.path.join(directory, name), os.path.join(out, name))
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    vc = config["vision_config"]
    vc["fullatt_block_indexes"] = list(range(vc["depth"]))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return out


def inputs(seed: int = 0):
    """Two rows of SEQ tokens as the processor lays them out (<|vision_start|> run <|vision_end|>):
    images 0 and 1 in row 0, image 2 in row 1; pixel_values [Σ patches, WIDTH], image_grid_thw [3, 3]."""
    g = torch.Generator().manual_seed(seed)
    text = lambda n: torch.randint(3, IMAGE - 1, (n,), generator=g).tolist()  # noqa: E731
    image = lambda grid: [IMAGE + 2] + [IMAGE] * (grid[0] * grid[1] * grid[2] // MERGE ** 2) + [IMAGE + 3]  # noqa: E731
    rows = [text(4) + image(GRIDS[0]) + text(3) + image(GRIDS[1]) + text(5),
            text(2) + image(GRIDS[2]) + text(10)]
    ids = torch.tensor([r + text(SEQ - len(r)) for r in rows])
    pixels = torch.randn(sum(t * h * w for t, h, w in GRIDS), WIDTH, generator=g)
    return {"input_ids": ids, "pixel_values": pixels, "image_grid_thw": torch.tensor(GRIDS)}


def reference(model, batch):
    """transformers' logits [B, S, V] (FP32)."""
    with torch.no_grad():
        return model(**batch, mm_token_type_ids=(batch["input_ids"] == IMAGE).long()).logits


def rel(got, ref) -> float:
    return float((got - ref).abs().max() / ref.abs().max())
