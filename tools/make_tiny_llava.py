#!/usr/bin/env python
"""Write a tiny random Hugging Face model directory (no download), for tests and examples.

    python tools/make_tiny_llava.py --out DIR [--vision clip|siglip] [--text llama|qwen2|mistral] [--tie]
    python tools/make_tiny_llava.py --out DIR --whisper

LLaVA: a CLIP or SigLIP vision tower, a Llama (GQA), Qwen2 (QKV bias) or Mistral
LLM, image_token_id = the last vocabulary id. Whisper: the whole model (mimo
uses its encoder).
"""

import argparse
import sys

VOCAB = 128


def make_llava(out: str, vision: str = "clip", text: str = "llama", tie: bool = False, seed: int = 0,
               rope_scaling: bool = False, **text_kw) -> str:
    """`text_kw`: more fields of the text config (e.g. Mistral's sliding_window)."""
    import torch
    from transformers import (CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration,
                              MistralConfig, Qwen2Config, SiglipVisionConfig)

    torch.manual_seed(seed)
    vkw = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, image_size=16,
               patch_size=4)
    vc = CLIPVisionConfig(projection_dim=16, **vkw) if vision == "clip" else SiglipVisionConfig(**vkw)
    tkw = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, tie_word_embeddings=tie,
               **text_kw)
    if rope_scaling:
        tkw["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 16}
    tc = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[text](**tkw)
    cfg = LlavaConfig(vision_config=vc, text_config=tc, image_token_id=VOCAB - 1, tie_word_embeddings=tie,
                      vision_feature_layer=-2 if vision == "clip" else -1,
                      vision_feature_select_strategy="default" if vision == "clip" else "full")
    model = LlavaForConditionalGeneration(cfg)
    with torch.no_grad():  # larger than the default init so differences show in the logits
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(out)
    return out


def make_whisper(out: str, seed: int = 0) -> str:
    import torch
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperModel

    torch.manual_seed(seed)
    cfg = WhisperConfig(d_model=32, encoder_layers=2, encoder_attention_heads=2, decoder_layers=1,
                        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
                        max_source_positions=16, max_target_positions=16, vocab_size=64, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, suppress_tokens=[],
                        begin_suppress_tokens=[])
    model = WhisperModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(out)
    # Like a real Whisper directory, the feature extractor the data pipeline uses for its audio.
    WhisperFeatureExtractor(feature_size=cfg.num_mel_bins).save_pretrained(out)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--vision", choices=("clip", "siglip"), default="clip")
    p.add_argument("--text", choices=("llama", "qwen2", "mistral"), default="llama")
    p.add_argument("--tie", action="store_true")
    p.add_argument("--whisper", action="store_true")
    args = p.parse_args(argv)
    if args.whisper:
        make_whisper(args.out)
    else:
        make_llava(args.out, args.vision, args.text, args.tie)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
