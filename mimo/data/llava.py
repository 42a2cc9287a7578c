"""LLaVA-format records -> token ids, loss targets and image paths.

A record: {"id": str, "image": "rel/path.jpg" | ["a.jpg", "b.jpg"] (optional),
"audio": "rel/clip.wav" | [...] (optional), "conversations": [{"from": "human",
"value": "<image>\\nWhat is ...?"}, {"from": "gpt", "value": "..."}, ...]}.

Turns are formatted with the tokenizer's chat template when it has one, else
with the default format

    <bos>USER: {human}\\nASSISTANT: {gpt}<eos>USER: ...

Only the text of `gpt` turns (and the end-of-turn token that closes them)
carries loss. Every `<image>` becomes the vision encoder's placeholder id
repeated once per image token, at its position in the text; every `<audio>`
likewise the audio encoder's, once per audio token.

A chat template that renders image content parts itself (Qwen2-VL's writes
`<|vision_start|><|image_pad|><|vision_end|>` for `{"type": "image"}`) gets each
message as a list of parts, `<image>` tags turned into image parts, as the HF
processor's `apply_chat_template` does; the placeholder token it writes per image
then becomes the image's run. Other templates get the text with its `<image>`
tags, which become the runs.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

from .images import ImageError, check_image, media_name

IMAGE_TAG = "<image>"
AUDIO_TAG = "<audio>"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


class BadRecord(ValueError):
    """A record that cannot be trained on; str() is the reason."""


class DataError(ValueError):
    """A problem that stops the run: str() is one `error: ...` line."""


class MediaError(DataError):
    """A media item that passed its header check but failed to decode, under `on_bad_record: error`.
    Found only by the rank that decodes it (str() is one `error: ...` line per item). `own`: False
    where the failure was another rank's, learnt from the step's loss sum (`Trainer`)."""

    def __init__(self, message: str, own: bool = True):
        super().__init__(message)
        self.own = own


def record_id(record, index: int) -> str:
    rid = record.get("id") if isinstance(record, dict) else None
    return str(rid) if rid is not None else f"#{index}"


@dataclass
class Encoded:
    """One record, tokenised: ids and targets have equal length; images and audio clips in order
    of appearance."""

    id: str
    input_ids: List[int]
    targets: List[bool]
    images: List  # file paths, or the images' bytes (energon)
    audio: List[str] = field(default_factory=list)  # file paths
    grids: Optional[List[Tuple[int, int, int]]] = None  # native-resolution images: patch grids (t, h, w)


class ConversationEncoder:
    """Records -> Encoded. `audio_token`, `tokens_per_audio` and `check_audio` (raises ValueError
    with the reason) are set when the model has an audio encoder."""

    def __init__(self, tokenizer, seq_length: int, image_root: str, image_token: Optional[int],
                 tokens_per_image: int, audio_token: Optional[int] = None, tokens_per_audio: int = 0,
                 check_audio: Optional[Callable[[str], None]] = None,
                 image_grid: Optional[Callable[[int, int], Tuple[int, int, int]]] = None, merge: int = 1):
        """`image_grid` (native-resolution vision): (width, height) -> the image's patch grid (t, h, w);
        each image's run is then t*h*w / merge^2 placeholders, read from its header."""
        self.image_grid, self.merge = image_grid, merge
        self.tok = tokenizer
        self.seq_length = seq_length
        self.image_root = image_root
        self.image_token = image_token
        self.tokens_per_image = tokens_per_image
        self.audio_token, self.tokens_per_audio, self.check_audio = audio_token, tokens_per_audio, check_audio
        self.has_template = getattr(tokenizer, "chat_template", None) is not None
        # The text the template writes for one image part, when it renders image parts (else None).
        self.image_text = self._image_part_text() if self.has_template else None
        tags = [IMAGE_TAG if self.image_text is None else self.image_text, AUDIO_TAG]
        self._tags = re.compile("(" + "|".join(re.escape(t) for t in tags) + ")")
        self._image_piece = tags[0]

    def encode(self, record, index: int, known_grids: Optional[List[Tuple[int, int, int]]] = None,
               checked: bool = False) -> Encoded:
        """The record's tokens; raises BadRecord with the reason when it cannot be used. `checked`: its
        media headers were read before (mimo.data.record_index), native images' grids `known_grids`:
        no header is read again."""
        rid = record_id(record, index)
        turns = self._turns(record)
        images = self._media(record, "image", IMAGE_TAG, turns, self.image_token, "image(s)", "vision")
        audio = self._media(record, "audio", AUDIO_TAG, turns, self.audio_token, "audio clip(s)", "audio")
        runs = {IMAGE_TAG: [self.image_token] * self.tokens_per_image,
                AUDIO_TAG: [self.audio_token] * self.tokens_per_audio}
        grids = None
        if checked:
            grids = None if self.image_grid is None else list(known_grids or [])
        elif self.image_grid is not None:  # native resolution: each image's run from its header
            grids = []
            for p in images:
                try:
                    w, h = check_image(self._path(p))
                except (ImageError, ValueError) as exc:
                    raise BadRecord(str(exc)) from None
                try:
                    grids.append(self.image_grid(w, h))
                except ValueError as exc:  # the size itself (an aspect ratio beyond 200:1): name the image
                    raise BadRecord(f"image {media_name(self._path(p))} ({w} x {h} pixels): {exc}") from None
        runs[self._image_piece] = runs.pop(IMAGE_TAG)
        ids, targets, seen = [], [], 0
        for text, target in self._segments(turns):
            for piece in self._tags.split(text):
                if piece in runs:  # a media item's placeholder run: never a loss target
                    run = runs[piece]
                    if piece == self._image_piece:
                        seen += 1
                        if seen > len(images):  # the text itself holds the template's image token
                            raise BadRecord(f"the text holds more {piece!r} than the record's "
                                            f"{len(images)} image(s)")
                        if grids is not None:
                            t, h, w = grids[seen - 1]
                            run = [self.image_token] * (t * h * w // (self.merge * self.merge))
                    ids += run
                    targets += [False] * len(run)
                elif piece:
                    t = self.tok(piece, add_special_tokens=False)["input_ids"]
                    ids += t
                    targets += [target] * len(t)
        if seen != len(images):
            raise BadRecord(f"the chat template wrote {seen} image(s) for the record's {len(images)}")
        if len(ids) > self.seq_length:
            raise BadRecord(f"{len(ids)} tokens, longer than data.seq_length ({self.seq_length})")
        paths = [self._path(p) for p in images]  # bytes: inline
        clips = [self._path(p) for p in audio]
        if checked:
            return Encoded(rid, ids, targets, paths, clips, grids)
        for p in paths if grids is None else []:  # native resolution: checked above, for the grids
            try:
                check_image(p)
            except ImageError as exc:
                raise BadRecord(str(exc)) from None
        for p in clips:
            try:
                self.check_audio(p)
            except ValueError as exc:
                raise BadRecord(str(exc)) from None
        return Encoded(rid, ids, targets, paths, clips, grids)

    def media(self, record) -> Tuple[List, List]:
        """The paths (or inline bytes) of a usable record's images and audio clips, without tokenising it."""
        turns = self._turns(record)
        images = self._media(record, "image", IMAGE_TAG, turns, self.image_token, "image(s)", "vision")
        audio = self._media(record, "audio", AUDIO_TAG, turns, self.audio_token, "audio clip(s)", "audio")
        return [self._path(p) for p in images], [self._path(p) for p in audio]

    def _path(self, p):
        return os.path.join(self.image_root, p) if isinstance(p, str) else p

    @staticmethod
    def _media(record, key: str, tag: str, turns, token: Optional[int], noun: str, kind: str) -> List:
        """The record's `key` list (images or audio clips), checked against its `tag`s."""
        items = record.get(key, [])
        items = [items] if isinstance(items, (str, bytes)) else items
        if not isinstance(items, list) or not all(isinstance(i, (str, bytes)) for i in items):
            raise BadRecord(f"`{key}` must be a path or a list of paths")
        tags = sum(v.count(tag) for _, v in turns)
        if tags != len(items):
            raise BadRecord(f"{tags} `{tag}` tag(s) but {len(items)} {noun}")
        if items and token is None:
            raise BadRecord(f"has {noun} but the model has no {kind} encoder")
        return items

    @staticmethod
    def _turns(record) -> List[Tuple[str, str]]:
        if not isinstance(record, dict):
            raise BadRecord("not a JSON object")
        conv = record.get("conversations")
        if not isinstance(conv, list) or not conv:
            raise BadRecord("no `conversations` list")
        turns = []
        for i, t in enumerate(conv):
            if not isinstance(t, dict) or not isinstance(t.get("from"), str) or not isinstance(t.get("value"), str):
                raise BadRecord(f"conversations[{i}] needs a string `from` and a string `value`")
            role = ROLES.get(t.get("from"))
            if role is None:
                raise BadRecord(f"conversations[{i}]: unknown speaker {t.get('from')!r}")
            try:  # JSON allows escapes of half an emoji (a lone surrogate); no tokenizer takes them
                t["value"].encode("utf-8")
            except UnicodeEncodeError as exc:
                raise BadRecord(f"conversations[{i}].value is not valid Unicode text (a lone surrogate at "
                                f"character {exc.start})") from None
            turns.append((role, t["value"]))
        if not any(r == "assistant" for r, _ in turns):
            raise BadRecord("no gpt turn")
        return turns

    def _segments(self, turns) -> List[Tuple[str, bool]]:
        """(text, carries loss) in order; text may hold `<image>` tags."""
        if self.has_template:
            return self._template_segments(turns)
        tok, out = self.tok, []
        if tok.bos_token:
            out.append((tok.bos_token, False))
        for role, value in turns:
            if role == "assistant":
                out += [("ASSISTANT: ", False), (value, True)]
                if tok.eos_token:
                    out.append((tok.eos_token, True))
            elif role == "user":
                out.append((f"USER: {value}\n", False))
            else:
                out.append((f"{value}\n", False))
        return out

    def _image_part_text(self) -> Optional[str]:
        """The image placeholder token's text if the chat template writes it once for an image content
        part (as Qwen2-VL's does, inside <|vision_start|> ... <|vision_end|>), else None: the template
        takes plain text and `<image>` tags mark the images."""
        if self.image_token is None or not 0 <= self.image_token < len(self.tok):
            return None
        text = self.tok.convert_ids_to_tokens(self.image_token)
        if not text or text == self.tok.unk_token:
            return None
        probe = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "probe"}]}]
        try:
            rendered = self.tok.apply_chat_template(probe, tokenize=False)
        except Exception:  # noqa: BLE001 (any template error: it is a text-only template)
            return None
        if not isinstance(rendered, str) or rendered.count(text) != 1 or "probe" not in rendered \
                or "'type'" in rendered:  # printed the parts list as text: a text-only template
            return None
        return text

    def _template_segments(self, turns) -> List[Tuple[str, bool]]:
        """Cut the rendered conversation at turn boundaries: the assistant header the template
        adds (add_generation_prompt) is prompt, the rest of an assistant turn is target."""
        def render(msgs, gen=False):
            try:
                return self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            except Exception as exc:  # noqa: BLE001 (a template's raise_exception, e.g. roles that must alternate)
                raise BadRecord(f"the chat template refuses the conversation: {type(exc).__name__}: {exc}") from None
        msgs = [{"role": r, "content": v if self.image_text is None else _parts(v)} for r, v in turns]
        out, done = [], ""
        for k, (role, _) in enumerate(turns):
            full = render(msgs[:k + 1])
            if role == "assistant":
                header = render(msgs[:k], gen=True) if k else ""
                if header.startswith(done) and full.startswith(header):
                    out += [(header[len(done):], False), (full[len(header):], True)]
                elif full.startswith(done):
                    out.append((full[len(done):], True))
                else:
                    raise BadRecord("the chat template does not render turns as prefixes of the conversation")
            else:
                if not full.startswith(done):
                    raise BadRecord("the chat template does not render turns as prefixes of the conversation")
                out.append((full[len(done):], False))
            done = full
        return out


def _parts(value: str) -> List[dict]:
    """A turn's text as chat-template content parts: an image part for each `<image>` tag, in place."""
    parts = []
    for k, text in enumerate(value.split(IMAGE_TAG)):
        if k:
            parts.append({"type": "image"})
        if text:
            parts.append({"type": "text", "text": text})
    return parts
