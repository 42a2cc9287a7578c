#!/usr/bin/env python
"""Write a small LLaVA-format dataset with generated images and a matching tiny tokenizer.

    python tools/make_sample_data.py OUT_DIR [--records 64] [--image-size 32] [--seed 0] [--energon]
                                     [--audio N [--audio-ms 150]]

OUT_DIR/train.json      a JSON list of LLaVA records (captions, two-image questions, text-only turns)
OUT_DIR/images/*.png    the pictures: a coloured shape on a coloured background
OUT_DIR/tokenizer/      an HF tokenizer (word level, built offline with `tokenizers`)
with --audio N, N more records with an `<audio>` clip (every third also with an image), after the others:
OUT_DIR/audio/*.wav     tones (16 kHz, 16-bit PCM mono) of --audio-ms / 2 to --audio-ms milliseconds
with --energon, the one-image records also as megatron-energon datasets (WebDataset shards, then `energon prepare`):
OUT_DIR/energon_captioning/   CaptioningSample (image: png, caption: txt)
OUT_DIR/energon_vqa/          VQASample (image: png, context: txt, answers: json)

Everything is offline and deterministic in --seed, so the demo and the tests run without a network.
"""

import argparse
import json
import os
import random
import sys

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40),
           "white": (245, 245, 245), "black": (15, 15, 15)}
SHAPES = ("square", "circle", "triangle")
WORDS = ("a an the on of in is are what picture shown shape colour color background two same different yes no "
         "describe image images both first second and it this there which count how many one shapes hello "
         "answer briefly please thanks you welcome say three sound tone high low hear do loud quiet").split()
SPECIAL = ["<pad>", "<unk>", "<s>", "</s>"]  # <pad> is id 0: mimo pads with id 0


def draw(path, shape, fg, bg, size, rng):
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), COLOURS[bg])
    d = ImageDraw.Draw(img)
    lo, hi = rng.randint(2, size // 4), rng.randint(3 * size // 4, size - 2)
    if shape == "square":
        d.rectangle([lo, lo, hi, hi], fill=COLOURS[fg])
    elif shape == "circle":
        d.ellipse([lo, lo, hi, hi], fill=COLOURS[fg])
    else:
        d.polygon([(size // 2, lo), (lo, hi), (hi, hi)], fill=COLOURS[fg])
    img.save(path)


def make_records(out, n, size, rng):
    os.makedirs(os.path.join(out, "images"), exist_ok=True)
    colours = list(COLOURS)
    records, k = [], 0

    def picture():
        nonlocal k
        shape, fg = rng.choice(SHAPES), rng.choice(colours)
        bg = rng.choice([c for c in colours if c != fg])
        name = f"images/img{k:04d}.png"
        k += 1
        draw(os.path.join(out, name), shape, fg, bg, size, rng)
        return name, shape, fg, bg

    for i in range(n):
        kind = i % 4
        if kind in (0, 1):  # caption
            name, shape, fg, bg = picture()
            q = rng.choice(["<image>\nwhat is shown in the picture ?", "describe the image briefly .",
                            "<image>\nwhat shape is this ?"])
            if "<image>" not in q:
                q = q + "\n<image>"
            records.append({"id": f"cap{i:04d}", "image": name, "conversations": [
                {"from": "human", "value": q}, {"from": "gpt", "value": f"a {fg} {shape} on a {bg} background ."}]})
        elif kind == 2:  # two images, two rounds
            a, b = picture(), picture()
            same = "yes" if a[2] == b[2] else "no"
            records.append({"id": f"two{i:04d}", "image": [a[0], b[0]], "conversations": [
                {"from": "human", "value": "<image>\n<image>\nare both shapes the same colour ?"},
                {"from": "gpt", "value": same + " ."},
                {"from": "human", "value": "what is the first shape ?"},
                {"from": "gpt", "value": f"a {a[2]} {a[1]} ."}]})
        else:  # text only
            records.append({"id": f"txt{i:04d}", "conversations": [
                {"from": "human", "value": "hello , how many shapes are there ?"},
                {"from": "gpt", "value": rng.choice(["one shape .", "two shapes .", "three shapes ."])}]})
    return records


def make_audio_records(out, n, max_ms, rng, images_from):
    """n records with a generated tone each; every third also asks about one of `images_from`'s images."""
    import wave

    import numpy as np

    os.makedirs(os.path.join(out, "audio"), exist_ok=True)
    pictures = [r for r in images_from if isinstance(r.get("image"), str)]
    records = []
    for i in range(n):
        pitch, loud = rng.choice(["high", "low"]), rng.choice(["loud", "quiet"])
        freq, amp = (1800.0 if pitch == "high" else 300.0), (0.8 if loud == "loud" else 0.1)
        samples = rng.randint(16 * max_ms // 2, 16 * max_ms)  # 16 samples per millisecond
        name = f"audio/clip{i:04d}.wav"
        with wave.open(os.path.join(out, name), "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(16000)
            wave_ = 32767 * amp * np.sin(2 * np.pi * freq * np.arange(samples) / 16000)
            w.writeframes(wave_.astype("<i2").tobytes())
        record = {"id": f"aud{i:04d}", "audio": name, "conversations": [
            {"from": "human", "value": "<audio>\nwhat do you hear ?"},
            {"from": "gpt", "value": f"a {loud} {pitch} tone ."}]}
        if i % 3 == 2 and pictures:
            pic = pictures[i % len(pictures)]
            record["image"] = pic["image"]
            record["conversations"] = [
                {"from": "human", "value": "<image>\n<audio>\ndescribe the image and the sound ."},
                {"from": "gpt", "value": pic["conversations"][1]["value"][:-2] + f" and a {pitch} tone ."}]
        records.append(record)
    return records


def make_tokenizer(out):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = SPECIAL + sorted(set(WORDS) | set(COLOURS) | set(SHAPES) | {"USER", "ASSISTANT", ":", ".", ",", "?"})
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.save_pretrained(os.path.join(out, "tokenizer"))
    return len(vocab)


def make_energon(out, records):
    """Write one WebDataset shard per sample type and prepare it with energon's own CLI."""
    import contextlib
    import io
    import tarfile

    kinds = {"captioning": ("CaptioningSample", {"image": "png", "caption": "txt"}),
             "vqa": ("VQASample", {"image": "png", "context": "txt", "answers": "json"})}
    for kind, (sample_type, field_map) in kinds.items():
        root = os.path.join(out, f"energon_{kind}")
        os.makedirs(root, exist_ok=True)
        with tarfile.open(os.path.join(root, "shard-000000.tar"), "w") as tar:
            for r in records:
                if not isinstance(r.get("image"), str):
                    continue
                question, answer = (t["value"] for t in r["conversations"][:2])
                parts = {"png": open(os.path.join(out, r["image"]), "rb").read()}
                if kind == "captioning":
                    parts["txt"] = answer.encode()
                else:
                    parts["txt"] = question.replace("<image>", "").strip().encode()
                    parts["json"] = json.dumps([answer]).encode()
                for ext, data in parts.items():
                    info = tarfile.TarInfo(f"{r['id']}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        # `energon prepare ROOT ...`, run in this process (the same click command the CLI runs).
        from megatron.energon.cli.main import main as energon_cli

        with contextlib.redirect_stdout(io.StringIO()):
            energon_cli(["prepare", root, "--non-interactive", "--split-parts", "train:shard-{000000..000000}.tar",
                         "--sample-type", sample_type, "--field-map", json.dumps(field_map), "--no-progress",
                         "--num-workers", "1"], standalone_mode=False)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--records", type=int, default=64)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--energon", action="store_true", help="also write prepared megatron-energon datasets")
    p.add_argument("--audio", type=int, default=0, help="also write this many records with an audio clip")
    p.add_argument("--audio-ms", type=int, default=150, help="longest audio clip in milliseconds")
    args = p.parse_args(argv)
    if args.records < 1 or args.image_size < 8 or args.audio < 0 or args.audio_ms < 2:
        print("error: --records must be >= 1, --image-size >= 8, --audio >= 0 and --audio-ms >= 2", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    records = make_records(args.out_dir, args.records, args.image_size, rng)
    image_records = list(records)
    records += make_audio_records(args.out_dir, args.audio, args.audio_ms, rng, records)
    with open(os.path.join(args.out_dir, "train.json"), "w") as f:
        json.dump(records, f, indent=1)
    n = make_tokenizer(args.out_dir)
    if args.energon:
        make_energon(args.out_dir, image_records)
    clips = f"{args.audio} audio clips, " if args.audio else ""
    print(f"wrote {len(records)} records, {len(os.listdir(os.path.join(args.out_dir, 'images')))} images, {clips}"
          f"and a {n}-token tokenizer to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
