#!/usr/bin/env python
"""FP32 logits of a mimo model for given inputs: verify a Hugging Face conversion.

    python tools/hf_logits.py --config FILE.yaml --inputs IN.pt --out OUT.pt [--set a.b=v ...]

IN.pt: {"input_ids": int64 [B, S], "pixel_values": float32 [N, 3, H, W]} with each
image's placeholder tokens (image_token_id, one per image feature) already expanded
in input_ids and images in order of appearance: what LlavaForConditionalGeneration
takes. (An audio encoder reads "input_features" [N, mel, frames], as Whisper does.)
A native-resolution vision encoder (Qwen2-VL / Qwen2.5-VL) reads what their processor
emits: "pixel_values" float32 [sum of patches, C*T*P*P] and "image_grid_thw" int64
[N, 3], each image's placeholder run t*h*w / spatial_merge_size^2 tokens long.
Starts the ranks the layout needs (CPU, gloo), runs one FP32 forward and writes
{"logits": float32 [B, S, V]} to OUT.pt. Exit 2 with one `error:` line for bad input.
"""

import argparse
import os
import pickle
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--inputs", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--set", action="append", default=[], metavar="PATH=VALUE")
    args = p.parse_args(argv)
    import torch

    from mimo.config import ConfigError, apply_overrides, load_config, read_yaml, without_data
    from mimo.hf import HFWeightsError, check_hf_weights
    from mimo.training.hf_logits import hf_logits

    try:
        # The model only: a training config's data (records, tokenizer) need not exist here.
        raw = without_data(apply_overrides(read_yaml(args.config), args.set))
        check_hf_weights(load_config(raw))
        try:
            inputs = torch.load(args.inputs, map_location="cpu", weights_only=True)
        except (OSError, RuntimeError) as exc:
            print(f"error: {args.inputs}: cannot read ({exc})", file=sys.stderr)
            return 2
        except pickle.UnpicklingError:  # the safe loader refused it: it holds more than tensors and plain data
            print(f"error: {args.inputs}: holds objects an inputs file may not hold (tensors and plain data only)",
                  file=sys.stderr)
            return 2
        except Exception:  # noqa: BLE001 (pickle reading other bytes fails with any error: KeyError, IndexError...)
            print(f"error: {args.inputs}: not a file torch.save wrote (a dict of tensors with input_ids)",
                  file=sys.stderr)
            return 2
        if not isinstance(inputs, dict) or "input_ids" not in inputs:
            print(f"error: {args.inputs}: must hold a dict with input_ids", file=sys.stderr)
            return 2
        logits = hf_logits(raw, inputs)
    except (ConfigError, HFWeightsError) as exc:
        print(str(exc), file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"error: {args.inputs}: {exc}", file=sys.stderr)
        return 2
    torch.save({"logits": logits.float()}, args.out)
    print(f"wrote {args.out}: logits {list(logits.shape)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
