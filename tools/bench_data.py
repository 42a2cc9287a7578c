#!/usr/bin/env python
"""Samples/s of the LLaVA data loader alone (planning, tokenising, packing, image decoding), on CPU.

    python tools/bench_data.py [--records 512] [--image-size 224] [--steps 20] [--workers 0 2]
                               [--audio N [--audio-ms 10000]]

Builds a sample dataset with tools/make_sample_data.py in a temporary directory, then reads
`--steps` steps of a global batch of 16 packed sequences as one rank consuming every sample
would, once per value of --workers (data.num_workers), and prints one JSON line each. With --audio N
the dataset also holds N records with a WAV clip, and the model an audio encoder taking 80 mel bins
over a 10 s window (1000 frames, 250 tokens): clips are decoded to Whisper log-mel features too.
"""

import argparse
import copy
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

RAW = {
    "model": {"language": dict(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=128,
                               max_sequence_length=1024, attention="bitfield"),
              "encoders": {"images": dict(kind="vision", num_layers=1, hidden_size=16, num_attention_heads=2,
                                          image_size=224, patch_size=32)}},
    "parallelism": {"language": {}, "images": {}},
    "data": {"kind": "llava", "seq_length": 512, "packing": True},
    "training": {"global_batch_size": 16, "micro_batch_size": 1},
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=512)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    p.add_argument("--audio", type=int, default=0)
    p.add_argument("--audio-ms", type=int, default=10000)
    args = p.parse_args(argv)
    import make_sample_data
    from mimo.config import load_config
    from mimo.data import build_dataset, collate
    from mimo.data.llava_dataset import sample_items

    with tempfile.TemporaryDirectory() as tmp:
        make_sample_data.main([tmp, "--records", str(args.records), "--image-size", str(args.image_size),
                               "--audio", str(args.audio), "--audio-ms", str(args.audio_ms)])
        for workers in args.workers:
            raw = copy.deepcopy(RAW)
            raw["data"].update(path=os.path.join(tmp, "train.json"), tokenizer=os.path.join(tmp, "tokenizer"),
                               num_workers=workers)
            if args.audio:
                raw["model"]["encoders"]["audio"] = dict(kind="audio", num_layers=1, hidden_size=16,
                                                         num_attention_heads=2, num_mel_bins=80, clip_frames=1000,
                                                         frames_per_token=4)
                raw["parallelism"]["audio"] = {}
            cfg = load_config(raw)
            ds = build_dataset(cfg)
            G = cfg.training.global_batch_size
            ds.prefetch(lambda step: sample_items(ds, step, range(G), ds.loaders))
            start, images, clips, tokens = time.perf_counter(), 0, 0, 0
            for step in range(args.steps):
                b = collate([ds.sample(step * G + j) for j in range(G)], cfg.placeholder_ids)
                images += b["images"].shape[0]
                clips += b["audio"].shape[0] if args.audio else 0
                tokens += int((b["document_ids"] >= 0).sum())
            dt = time.perf_counter() - start
            print(json.dumps({"num_workers": workers, "steps": args.steps, "samples_per_s": args.steps * G / dt,
                              "images_per_s": images / dt, "clips_per_s": clips / dt, "tokens_per_s": tokens / dt,
                              "packing_efficiency": tokens / (args.steps * G * cfg.data.seq_length),
                              "image_size": args.image_size}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
