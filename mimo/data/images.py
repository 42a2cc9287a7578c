"""Images: checked from their header on every rank, decoded only where an encoder consumes them.

Decoding: Pillow -> RGB -> the vision tower's HF image processor when the
model comes from Hugging Face (`model.hf`), else a bicubic resize to the
encoder's `image_size` and the CLIP normalisation (per channel, mean
0.4815, 0.4578, 0.4082 and std 0.2686, 0.2613, 0.2758 on [0, 1] values), the
statistics most LLaVA vision towers were trained with.
"""

from __future__ import annotations

import errno
import io
import os
import re
import stat
from typing import Optional, Tuple, Union

import torch

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class ImageError(ValueError):
    """An image that cannot be used; the message is the reason, for the bad-record warning."""


class MediaReadError(OSError):
    """The filesystem failed to read a media file (EIO, ESTALE, EMFILE...): not a verdict on the record.

    Every rank plans the step from the records alone and the ranks must agree on which records are bad;
    a read failure one rank met is not shared, so it stops the run instead of skipping the record on that
    rank only (which would leave the ranks with different steps)."""


# Errors every rank meets alike on a shared filesystem (a path or permission problem): a verdict on the
# record, like a missing file.
_SAME_ON_EVERY_RANK = {errno.ENOENT, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR, errno.ENAMETOOLONG,
                       errno.ELOOP}


def read_failure(path, exc: OSError) -> Optional[MediaReadError]:
    """A MediaReadError when `exc` is a failure of this rank's read (an errno such as EIO, ESTALE or
    EMFILE), else None: the file's content is at fault (Pillow raises errno-less errors for bad data),
    or its path or permissions, which every rank sees alike."""
    if exc.errno is None or exc.errno in _SAME_ON_EVERY_RANK:
        return None
    return MediaReadError(exc.errno, f"reading {media_name(path)} failed: {exc.strerror or exc} (a filesystem error, "
                                     "not a bad file; the run stops rather than skip it on one rank)")


def _open(src: Union[str, bytes]):
    from PIL import Image

    return Image.open(io.BytesIO(src) if isinstance(src, bytes) else src)


def media_name(src: Union[str, bytes]) -> str:
    return src if isinstance(src, str) else f"({len(src)} bytes inline)"


def _reason(exc: Exception) -> str:
    """Pillow's message without the in-memory file object it names for inline bytes (an address
    that differs on every read, and means nothing to the user: `media_name` says what it is)."""
    return re.sub(r" ?<_io\.BytesIO object at 0x[0-9a-fA-F]+>", "", str(exc))


def check_image(path: Union[str, bytes]) -> Tuple[int, int]:
    """(width, height) from the header; raise ImageError unless `path` (a file, or an image's
    bytes) has a header Pillow recognises.

    Reads the header only (a few hundred bytes, no pixels), so every rank can
    afford it and all ranks reach the same verdict on a record from the
    record alone: they must agree which samples a step holds.
    """
    from PIL import Image

    if isinstance(path, str):
        check_file(path, "image", ImageError)
    try:
        with _open(path) as img:
            w, h = img.size
    except Image.DecompressionBombError as exc:  # a header claiming more pixels than Pillow will decode
        raise ImageError(f"image {media_name(path)} too large: {exc}") from None
    except OSError as exc:  # UnidentifiedImageError included
        failure = read_failure(path, exc)
        if failure is not None:
            raise failure from None
        raise ImageError(f"unreadable image {media_name(path)}: {_reason(exc)}") from None
    if w < 1 or h < 1:
        raise ImageError(f"empty image {media_name(path)}")
    return w, h


def check_file(path: str, kind: str, bad: type) -> None:
    """`bad(reason)` (the record's verdict) unless the media file `path` is a regular file; MediaReadError
    where this rank could not look (EIO...). Looked up before it is opened: opening a named pipe would
    wait for a writer, on every rank."""
    try:
        mode = os.stat(path).st_mode
    except ValueError:  # a NUL character, or half an emoji (a lone surrogate), in the path
        raise bad(f"{kind} path {path!r} is not a valid file name") from None
    except OSError as exc:
        raise file_failure(path, exc, kind, bad) from None
    if stat.S_ISDIR(mode):
        raise bad(f"{kind} is a directory: {path}")
    if not stat.S_ISREG(mode):
        raise bad(f"{kind} is not a regular file: {path}")


def file_failure(path: str, exc: OSError, kind: str, bad: type) -> Exception:
    """What an OSError looking up or opening the media file `path` means: this rank's read failed
    (MediaReadError: the run stops), else the record's verdict `bad(reason)`, as on every rank."""
    failure = read_failure(path, exc)
    if failure is not None:
        return failure
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return bad(f"{kind} not found: {path}")
    return bad(f"unreadable {kind} {path}: {exc.strerror or exc}")


def _decode_failure(path: Union[str, bytes], exc: Exception) -> Exception:
    """What an error decoding an image whose header passed means: this rank's read failed (an OSError
    with an errno such as EIO: MediaReadError, the run stops), else the pixels are bad (ImageError)."""
    failure = read_failure(path, exc) if isinstance(exc, OSError) else None
    return failure if failure is not None else ImageError(f"unreadable image {media_name(path)}: {_reason(exc)}")


class ImageLoader:
    """path (or the image's bytes) -> float32 [3, H, W] pixels for the vision encoder."""

    def __init__(self, image_size: int, hf_dir: Optional[str] = None):
        self.image_size = image_size
        self.processor = None
        if hf_dir is not None:
            from transformers import AutoImageProcessor

            self.processor = AutoImageProcessor.from_pretrained(hf_dir)

    def __call__(self, path: Union[str, bytes]) -> torch.Tensor:
        from PIL import Image

        try:
            with _open(path) as img:
                rgb = img.convert("RGB")
        except (OSError, ValueError, SyntaxError) as exc:  # the header was fine, the pixels are not (truncated)
            raise _decode_failure(path, exc) from None
        if self.processor is not None:
            return self.processor(images=rgb, return_tensors="pt")["pixel_values"][0].float()
        rgb = rgb.resize((self.image_size, self.image_size), Image.BICUBIC)
        x = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8)
        x = x.view(self.image_size, self.image_size, 3).permute(2, 0, 1).float() / 255.0
        mean = torch.tensor(CLIP_MEAN).view(3, 1, 1)
        std = torch.tensor(CLIP_STD).view(3, 1, 1)
        return (x - mean) / std


class NativeImageLoader:
    """path (or bytes) -> float32 patches [t*h*w, C*T*P*P] of a native-resolution encoder (`enc`),
    as the Qwen2-VL processor cuts them (`mimo.data.native_images.image_patches`); the processor's
    image_mean / image_std when the model's HF directory `hf_dir` names them, else CLIP's."""

    def __init__(self, enc, hf_dir: Optional[str] = None):
        self.enc, self.mean, self.std = enc, CLIP_MEAN, CLIP_STD
        if hf_dir is not None:
            from mimo.config.hf_files import qwen_processor_settings

            settings = qwen_processor_settings(hf_dir)
            self.mean = settings["image_mean"] or CLIP_MEAN
            self.std = settings["image_std"] or CLIP_STD

    def __call__(self, path: Union[str, bytes]) -> torch.Tensor:
        from .native_images import image_patches

        try:
            with _open(path) as img:
                img.load()
                patches, _ = image_patches(img, self.enc, self.mean, self.std)
        except (OSError, ValueError, SyntaxError) as exc:  # the header was fine, the pixels are not
            raise _decode_failure(path, exc) from None
        return torch.from_numpy(patches)
