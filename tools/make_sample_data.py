#!/usr/bin/env python
"""Write a small LLaVA-format dataset with generated images and a matching tiny tokenizer.

    python tools/make_sample_data.py OUT_DIR [--records 64] [--image-size 32] [--seed 0] [--energon]
                                     [--audio N [--audio-ms 150]] [--image-sizes WxH,...] [--qwen-vl]

OUT_DIR/train.json      a JSON list of LLaVA records (captions, two-image questions, text-only turns)
OUT_DIR/images/*.png    the pictures: a coloured shape on a coloured background
OUT_DIR/tokenizer/      an HF tokenizer (word level, built offline with `tokenizers`)
with --image-sizes, the pictures take these sizes in turn (width x height pixels) instead of --image-size square;
with --qwen-vl (for native-resolution models), pictures of five sizes (unless --image-sizes) and a tokenizer with
Qwen2-VL's chat format: ChatML turns (<|im_start|>, <|im_end|>) and its chat template, which writes
<|vision_start|><|image_pad|><|vision_end|> for an image; <|image_pad|> is id 120 (QWEN_VL_IDS), as in a
128-token model's config (image_token_id).
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


# Five picture sizes (width x height) for --qwen-vl: with 8-pixel merge blocks (patch 4, merge 2) and
# max_pixels 1024 they are 5 different grids (4, 8, 12, 15 and 16 LLM tokens).
QWEN_VL_SIZES = [(16, 16), (32, 16), (16, 48), (40, 24), (40, 40)]


def draw(path, shape, fg, bg, size, rng):
    """A shape on a background; size: an int (square) or (width, height)."""
    from PIL import Image, ImageDraw

    w, h = (size, size) if isinstance(size, int) else size
    img = Image.new("RGB", (w, h), COLOURS[bg])
    d = ImageDraw.Draw(img)
    x0, x1 = rng.randint(2, w // 4), rng.randint(3 * w // 4, w - 2)
    # A square picture draws one extent for both axes (the generated data stays what it always was).
    y0, y1 = (x0, x1) if w == h else (rng.randint(2, h // 4), rng.randint(3 * h // 4, h - 2))
    if shape == "square":
        d.rectangle([x0, y0, x1, y1], fill=COLOURS[fg])
    elif shape == "circle":
        d.ellipse([x0, y0, x1, y1], fill=COLOURS[fg])
    else:
        d.polygon([(w // 2, y0), (x0, y1), (x1, y1)], fill=COLOURS[fg])
    img.save(path)


def make_records(out, n, size, rng):
    """size: an int (square pictures) or a list of (width, height), taken in turn by the pictures."""
    os.makedirs(os.path.join(out, "images"), exist_ok=True)
    colours = list(COLOURS)
    records, k = [], 0

    def picture():
        nonlocal k
        shape, fg = rng.choice(SHAPES), rng.choice(colours)
        bg = rng.choice([c for c in colours if c != fg])
        name = f"images/img{k:04d}.png"
        k += 1
        draw(os.path.join(out, name), shape, fg, bg, size if isinstance(size, int) else size[(k - 1) % len(size)],
             rng)
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


# Qwen2-VL's chat template (as its tokenizer_config.json ships it, less video numbering): a system turn
# first unless the conversation has one, ChatML turns, an image part as <|vision_start|><|image_pad|><|vision_end|>.
QWEN_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video' or 'video' in content %}"
    "<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# The vision tokens' ids: image_token_id, video_token_id, vision_start_token_id, vision_end_token_id.
QWEN_VL_IDS = {"<|image_pad|>": 120, "<|video_pad|>": 121, "<|vision_start|>": 122, "<|vision_end|>": 123}


def make_qwen_vl_tokenizer(directory):
    """A word-level tokenizer with Qwen2-VL's chat format, saved to `directory`; its size (124)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = set(WORDS) | set(COLOURS) | set(SHAPES) | {".", ",", "?", ":", "system", "user", "assistant", "You",
                                                        "helpful"}
    vocab = SPECIAL + sorted(words) + ["<|im_start|>", "<|im_end|>"]
    first = min(QWEN_VL_IDS.values())
    vocab += [f"<|reserved_{i}|>" for i in range(first - len(vocab))] + sorted(QWEN_VL_IDS, key=QWEN_VL_IDS.get)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                                   eos_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>", *QWEN_VL_IDS])
    fast.chat_template = QWEN_VL_TEMPLATE
    fast.save_pretrained(directory)
    return len(vocab)


def _sizes(text):
    """'16x16,32x16' -> [(16, 16), (32, 16)]."""
    try:
        sizes = [tuple(int(v) for v in part.lower().split("x")) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(len(s) != 2 or min(s) < 8 for s in sizes):
        raise argparse.ArgumentTypeError(f"expected WxH,WxH,... with sides >= 8, got {text!r}")
    return sizes


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
    p.add_argument("--image-sizes", type=_sizes, default=None,
                   help="picture sizes taken in turn, WxH,WxH,... (default: --image-size square)")
    p.add_argument("--qwen-vl", action="store_true",
                   help="a tokenizer with Qwen2-VL's chat format, and pictures of five sizes unless --image-sizes")
    args = p.parse_args(argv)
    if args.records < 1 or args.image_size < 8 or args.audio < 0 or args.audio_ms < 2:
        print("error: --records must be >= 1, --image-size >= 8, --audio >= 0 and --audio-ms >= 2", file=sys.stderr)
        return 2
    from mimo.config.outputs import output_problem

    problem = output_problem(args.out_dir, "directory")
    if problem:
        print(f"error: OUT_DIR: {problem}", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    sizes = args.image_sizes or (QWEN_VL_SIZES if args.qwen_vl else args.image_size)
    records = make_records(args.out_dir, args.records, sizes, rng)
    image_records = list(records)
    records += make_audio_records(args.out_dir, args.audio, args.audio_ms, rng, records)
    with open(os.path.join(args.out_dir, "train.json"), "w") as f:
        json.dump(records, f, indent=1)
    if args.qwen_vl:
        n = make_qwen_vl_tokenizer(os.path.join(args.out_dir, "tokenizer"))
    else:
        n = make_tokenizer(args.out_dir)
    if args.energon:
        make_energon(args.out_dir, image_records)
    clips = f"{args.audio} audio clips, " if args.audio else ""
    print(f"wrote {len(records)} records, {len(os.listdir(os.path.join(args.out_dir, 'images')))} images, {clips}"
          f"and a {n}-token tokenizer to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
